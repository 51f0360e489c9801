"""The weight-sync model: per transport, the bound that should dominate does, on layouts built so
that one must (the reasoning in each test, from bytes and datasheet bandwidths); the tensor count
against transformers' own checkpoints; and `megarl plan --json` carrying every transport."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GB = 1e9


def _predict(name: str, overrides: list[str], devices: str, hf: dict | None = None, **kw):
    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.perf.hardware import parse_devices
    from megarl.perf.memory import rollout_memory
    from megarl.perf.steptime import efficiency_of
    from megarl.perf.sync_model import predict

    model = json.loads((ROOT / "configs" / "models" / name / "config.json").read_text())
    base = {"deepseek-v3": "deepseek-v3-671b"}.get(name, name)
    cfg = validate(load_config(str(ROOT / "configs" / f"{base}.yaml"), overrides), model)
    hf = hf or model
    _, device = parse_devices(devices)
    return predict(cfg, hf, device, rollout_memory(cfg, hf, device), efficiency_of(device), **kw), cfg, device


def test_tensor_count_is_the_checkpoints_own():
    """Independent reference: transformers builds each architecture (meta device) and names its
    state dict, which is what a Hugging Face checkpoint holds."""
    import torch
    import transformers

    from megarl.models.tiny import TINY_QWEN3_MOE
    from megarl.models.tiny_archs import ARCH_PRESETS
    from megarl.perf.sync_model import hf_tensor_count

    for name, arch in {**ARCH_PRESETS, "tiny-qwen3-moe": TINY_QWEN3_MOE}.items():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**arch))
        assert hf_tensor_count(arch) == len(model.state_dict()), name


def test_a_moe_model_on_one_node_is_bound_by_its_per_tensor_costs():
    """Qwen3-30B-A3B colocated on 8 H100s (slime's setup): 61 GB crosses NVLink in ~0.2 s, but its
    18,867 tensors cost ~0.19 ms each in buckets (3.5 s): per-tensor overhead dominates."""
    over = ["cluster.num_actor_ranks=8", "actor.parallel.tp=1", "rollout.num_servers=1", "rollout.tp=8"]
    t, _, _ = _predict("qwen3-30b-a3b", over + ["rollout.ep=8"], "8xH100")
    tensor = t["tensor"]
    assert tensor.bound == "per_tensor" and tensor.usable and tensor.why is None
    assert tensor.terms_s["per_tensor"] > 5 * max(tensor.terms_s["links"], tensor.terms_s["gather"])


def test_a_dense_model_over_a_slow_network_is_bound_by_its_links_in_distributed():
    """A dense 8B (llama-shaped, 291 tensors) broadcast to engines on other nodes over A100's 25 GB/s
    NICs: every engine rank receives all 16 GB, ~0.9 s, against ~0.05 s of per-tensor costs."""
    dense = {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    }
    over = ["cluster.placement=disaggregated", "cluster.num_actor_ranks=16", "rollout.num_servers=4"]
    t, _, device = _predict("qwen3-30b-a3b", over, "24xA100", hf=dense)
    from megarl.perf.flops import count_params
    from megarl.perf.steptime import efficiency_of

    dist = t["distributed"]
    assert dist.bound == "links"
    assert dist.terms_s["links"] == pytest.approx(
        count_params(dense).total * 2 / (25 * GB * efficiency_of(device).link), rel=1e-9
    )


def test_tensor_is_not_applicable_when_the_engines_have_hosts_of_their_own():
    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.perf.hardware import parse_devices
    from megarl.perf.memory import rollout_memory
    from megarl.perf.steptime import efficiency_of
    from megarl.perf.sync_model import sync_time

    over = ["cluster.placement=disaggregated", "cluster.num_actor_ranks=16", "rollout.num_servers=4"]
    t, cfg, device = _predict("qwen3-30b-a3b", [*over, "bridge.transport=distributed"], "24xH100")
    assert t["tensor"].s is None and "not applicable" in t["tensor"].why and "disaggregated" in t["tensor"].why
    assert all(t[k].s > 0 for k in ("distributed", "reshard", "disk"))
    # a config that names tensor anyway is priced as the broadcast it would have to be
    hf = json.loads((ROOT / "configs/models/qwen3-30b-a3b/config.json").read_text())
    cfg = validate(load_config(str(ROOT / "configs/qwen3-30b-a3b.yaml"), over), hf)
    assert cfg.bridge.transport == "tensor"
    _, device = parse_devices("24xH100")
    s = sync_time(cfg, hf, device, rollout_memory(cfg, hf, device), efficiency_of(device))
    assert s == pytest.approx(t["distributed"].s)


def test_reshard_spreads_over_the_trainer_ranks_and_distributed_does_not():
    """Engines fixed (8 x tp4 = 32 devices of their own); the trainer grows from 8 to 32 ranks.
    reshard: each rank sends its share of 32 engine shards, so the busiest sender's bytes fall 4x
    until a receiver's own shard binds; distributed: every engine rank receives the whole model
    whoever sends it."""
    engines = ["cluster.placement=disaggregated", "cluster.num_rollout_devices=32", "rollout.num_servers=8"]
    engines += ["rollout.tp=4", "rollout.backend=embedded", "rollout.mem_fraction_static=null"]
    t8, _, _ = _predict("qwen3-30b-a3b", [*engines, "cluster.num_actor_ranks=8", "actor.parallel.tp=1"], "40xH100")
    t32, _, _ = _predict("qwen3-30b-a3b", [*engines, "cluster.num_actor_ranks=32"], "64xH100")
    assert t8["reshard"].usable
    assert t32["reshard"].terms_s["links"] == pytest.approx(t8["reshard"].terms_s["links"] / 4, rel=1e-6)
    assert t32["reshard"].s < t8["reshard"].s / 2  # the pieces each rank packs spread out as well
    assert t32["distributed"].terms_s["links"] == pytest.approx(t8["distributed"].terms_s["links"], rel=1e-9)
    assert t32["distributed"].s == pytest.approx(t8["distributed"].s, rel=0.05)


def test_deepseek_v3_on_256_h100_is_gather_or_link_bound_except_reshard():
    """The shipped 671B layout: tensor's every-rank assembly pulls 15/16 of 1.34 TB through each
    GPU's NIC (PP broadcast), distributed sends all 1.34 TB to every engine rank: tens of seconds.
    reshard moves each rank's own shard: seconds. Stock SGLang cannot receive it. (With the fitted
    per-tensor cost, ~3 ms, the per-tensor term of either may bind instead: the byte terms are
    checked on their own.)"""
    t, _, _ = _predict("deepseek-v3", [], "256xH100")
    assert t["tensor"].terms_s["gather"] > 20 and t["distributed"].terms_s["links"] > 20
    assert t["tensor"].s > 30 and t["distributed"].s > 30
    assert t["reshard"].s < 3 and t["reshard"].bound == "links"
    assert not t["reshard"].usable and "SGLang" in t["reshard"].why
    assert not t["tensor"].usable and "spans hosts" in t["tensor"].why  # engines span 4 hosts each


def test_plan_json_carries_every_transport(capsys, monkeypatch):
    from megarl.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["plan", "configs/qwen3-30b-a3b.yaml", "--devices", "16xH100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sync = out["weight_sync"]
    assert set(sync) == {"tensor", "distributed", "reshard", "disk"}
    assert [k for k, v in sync.items() if v["used"]] == ["tensor"]
    for entry in sync.values():
        assert entry["bound"] in entry["terms_s"] and entry["terms_s"][entry["bound"]] == max(entry["terms_s"].values())
    assert out["terms_s"]["weight_sync"] == pytest.approx(sync["tensor"]["s"])


def test_plan_prints_the_weight_sync_block(capsys, monkeypatch):
    from megarl.cli import main

    monkeypatch.chdir(ROOT)
    args = ["cluster.placement=disaggregated", "cluster.num_actor_ranks=16", "rollout.num_servers=4"]
    assert (
        main(["plan", "configs/qwen3-30b-a3b.yaml", *args, "bridge.transport=distributed", "--devices", "24xH100"]) == 0
    )
    out = capsys.readouterr().out
    block = out[out.index("weight sync per transport") :].splitlines()
    assert any(line.split()[:1] == ["tensor"] and "not applicable" in line for line in block)
    assert any(line.split()[:1] == ["distributed"] and line.endswith("<- bridge.transport") for line in block)
    assert any(line.split()[:1] == ["reshard"] for line in block)


def test_search_json_candidates_carry_the_weight_sync(capsys, monkeypatch):
    from megarl.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["plan", "configs/qwen3-30b-a3b.yaml", "--devices", "16xH100", "--search", "--top", "1", "--json"]) == 0
    cand = json.loads(capsys.readouterr().out)["candidates"][0]
    used = cand["layout"].get("bridge.transport", "tensor")
    assert cand["weight_sync"][used]["used"] and cand["weight_sync"][used]["s"] == pytest.approx(
        cand["terms_s"]["weight_sync"]
    )
