"""The scale configs (configs/deepseek-v3-671b.yaml, qwen3-235b-a22b.yaml, qwen3-30b-a3b.yaml) against
the real architectures in configs/models/*/config.json, without weights, GPU or SGLang; and the
uneven pipeline split they need, run for real on CPU.

Tolerances: the uneven-pipeline engine (fp32) against the Hugging Face model in float64: 1e-5
absolute on log-probs (as tests/engine/test_architectures.py, whose reference this uses; observed 2.7e-7 for both); exported weights equal
the checkpoint's bit for bit (fp32 in, fp32 out, no arithmetic on the way).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from megarl.cli import main
from megarl.config.loader import ConfigError, load_config
from megarl.config.validate_pipeline import stage_layers
from tests._dist import run_ranks
from tests.engine.test_architectures import hf_log_probs
from tests.engine.test_megatron_engine import make_rows

ROOT = Path(__file__).resolve().parents[2]
SCALE = {
    "deepseek-v3-671b.yaml": dict(world=256, tp=8, pp=16, ep=16, stages=[3] + [4] * 14 + [2]),
    "qwen3-235b-a22b.yaml": dict(world=128, tp=4, pp=8, ep=16, stages=[11] + [12] * 6 + [11]),
    "qwen3-30b-a3b.yaml": dict(world=16, tp=2, pp=1, ep=8, stages=[48]),
}


def run_cli(monkeypatch, capsys, *argv):
    monkeypatch.chdir(ROOT)  # the configs name model.path relative to the repo root
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("name", sorted(SCALE))
def test_show_config_accepts_scale_config_without_weights_gpu_or_sglang(name, monkeypatch, capsys):
    rc, out, err = run_cli(monkeypatch, capsys, "show-config", f"configs/{name}")
    assert rc == 0, err
    shown = yaml.safe_load(out)
    want = SCALE[name]
    p = shown["actor"]["parallel"]
    assert (shown["cluster"]["num_actor_ranks"], p["tp"], p["pp"], p["ep"]) == (
        want["world"],
        want["tp"],
        want["pp"],
        want["ep"],
    )
    assert shown["rollout"]["backend"] == "sglang" and p["sequence_parallel"] is True
    model_dir = ROOT / shown["model"]["path"]
    assert sorted(f.name for f in model_dir.iterdir() if f.suffix != ".md") == ["config.json"]  # no weights
    cfg = load_config(ROOT / "configs" / name, [])
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    assert stage_layers(cfg.actor.parallel, layers) == want["stages"]
    # colocated: the engines fill the actor pool exactly, every engine node inside one machine
    r = shown["rollout"]
    assert r["num_servers"] * r["tp"] == want["world"]
    assert shown["cluster"]["devices_per_node"] % (r["tp"] // r["nnodes"]) == 0


@pytest.mark.parametrize(
    "name,overrides,key,says",
    [
        # pp that splits no layer count: 61 layers (prime) need first/last_stage_layers for pp=16
        (
            "deepseek-v3-671b.yaml",
            ["actor.parallel.first_stage_layers=null", "actor.parallel.last_stage_layers=null"],
            "actor.parallel.pp",
            "does not divide model.num_hidden_layers=61",
        ),
        (
            "deepseek-v3-671b.yaml",
            ["actor.parallel.last_stage_layers=1"],
            "actor.parallel.first_stage_layers",
            "leave 57 of model.num_hidden_layers=61 layers for 14 middle pipeline stages",
        ),
        # an SGLang engine whose attention ranks do not divide the 128 heads
        (
            "deepseek-v3-671b.yaml",
            ["rollout.tp=24", "rollout.nnodes=3", "rollout.dp=1", "rollout.ep=8", "rollout.num_servers=10"],
            "rollout.tp",
            "do not divide model.num_attention_heads=128",
        ),
        # tp that does not divide the 4 key-value heads
        (
            "qwen3-235b-a22b.yaml",
            ["actor.parallel.tp=8", "cluster.num_actor_ranks=256"],
            "actor.parallel.tp",
            "does not divide model.num_key_value_heads=4",
        ),
        # ep that does not divide the 128 experts (it does divide the 12 ranks of a stage)
        (
            "qwen3-235b-a22b.yaml",
            ["cluster.num_actor_ranks=96", "actor.parallel.ep=12", "rollout.num_servers=12"],
            "actor.parallel.ep",
            "does not divide model.num_experts=128",
        ),
        (
            "qwen3-30b-a3b.yaml",
            [
                "cluster.num_actor_ranks=10",
                "actor.parallel.pp=5",
                "actor.parallel.ep=1",
                "actor.ppo_mini_batch_size=64",
            ],
            "actor.parallel.pp",
            "does not divide model.num_hidden_layers=48",
        ),
        # a tensor-parallel group spanning nodes
        (
            "qwen3-30b-a3b.yaml",
            ["actor.parallel.tp=4", "cluster.devices_per_node=2"],
            "actor.parallel.tp",
            "does not divide cluster.devices_per_node=2",
        ),
    ],
)
def test_show_config_rejects_broken_variant_naming_the_key(name, overrides, key, says, monkeypatch, capsys):
    rc, out, err = run_cli(monkeypatch, capsys, "show-config", f"configs/{name}", *overrides)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1, err  # one line
    assert err.startswith(f"megarl: config error: {key}") and says in err, err


def test_train_refuses_a_config_only_model_dir(monkeypatch, capsys):
    # refused before anything starts (no Ray, no SGLang): the weights check comes first
    rc, _, err = run_cli(monkeypatch, capsys, "train", "configs/qwen3-30b-a3b.yaml")
    assert rc == 2 and err.count("\n") == 1
    assert "model.path='configs/models/qwen3-30b-a3b' holds a config.json but no weights" in err


def test_hf_configs_load_and_mbridge_knows_them():
    from mbridge.core.bridge import _MODEL_REGISTRY
    from transformers import AutoConfig

    for name, arch in (
        ("deepseek-v3", "deepseek_v3"),
        ("qwen3-235b-a22b", "qwen3_moe"),
        ("qwen3-30b-a3b", "qwen3_moe"),
    ):
        c = AutoConfig.from_pretrained(ROOT / "configs" / "models" / name)
        assert c.model_type == arch and arch in _MODEL_REGISTRY
    ds = AutoConfig.from_pretrained(ROOT / "configs" / "models" / "deepseek-v3")
    assert (
        ds.hidden_size,
        ds.num_hidden_layers,
        ds.n_routed_experts,
        ds.first_k_dense_replace,
        ds.q_lora_rank,
        ds.kv_lora_rank,
    ) == (7168, 61, 256, 3, 1536, 512)


@pytest.mark.parametrize(
    "fields,key,says",
    [
        (dict(pp=1, first_stage_layers=2), "first_stage_layers", "needs actor.parallel.pp > 1"),
        (dict(pp=4, vpp=2, first_stage_layers=3), "first_stage_layers", "multiple of actor.parallel.vpp=2"),
        (dict(pp=2, first_stage_layers=40, last_stage_layers=40), "first_stage_layers", "exceed"),
        (dict(pp=2, first_stage_layers=20, last_stage_layers=20), "first_stage_layers", "must add up to"),
        (dict(pp=4, vpp=2, first_stage_layers=2, last_stage_layers=2), "vpp", "does not divide the 23 layers"),
    ],
)
def test_uneven_split_rules(fields, key, says):
    from megarl.config.schema import ParallelConfig

    with pytest.raises(ConfigError, match=says) as err:
        stage_layers(ParallelConfig(**fields), 48 if fields["pp"] != 4 else 50)
    assert err.value.key == f"actor.parallel.{key}"
    assert stage_layers(ParallelConfig(pp=4, vpp=2, first_stage_layers=2, last_stage_layers=2), 48) == [2, 22, 22, 2]
    assert stage_layers(ParallelConfig(pp=3, first_stage_layers=1), 5) == [1, 2, 2]


# ------------------------------------------------------------- uneven pipeline on CPU, for real
def _uneven_on_rank(rank, paths):
    """pp=2 with one layer on the first stage and two on the last (3-layer tiny Qwen3-MoE), then two
    on the first and one on the last (3-layer tiny DeepSeek-V3: the dense layer and an MoE layer
    first, as the 671B config puts the dense layers first)."""
    from megatron.core import parallel_state as ps

    from megarl.config.schema import ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    out = {}
    for name, first in (("qwen3_moe", 1), ("deepseek_v3", 2)):
        spec = EngineSpec(
            model_path=str(paths[name]),
            seed=1,
            micro_batch_size=2,
            parallel=ParallelConfig(pp=2, first_stage_layers=first, sequence_parallel=False),
        )
        engine = MegatronEngine(spec)
        engine.initialize()
        logp = engine.compute_log_prob(make_rows())
        weights = {k: v.clone() for k, v in engine.export_weights()}  # a collective: every rank
        out[name] = {
            "layers": [layer.layer_number for layer in engine.model[0].decoder.layers],
            "log_probs": None if logp is None else logp["log_probs"],
            "weights": weights if rank == 0 else None,
        }
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def uneven_results(tmp_path_factory):
    from megarl.models.tiny import build_tiny_checkpoint

    base = tmp_path_factory.mktemp("uneven")
    paths = {
        "qwen3_moe": build_tiny_checkpoint(base / "qwen3-moe", seed=0, num_hidden_layers=3),
        "deepseek_v3": build_tiny_checkpoint(base / "deepseek-v3", seed=0, preset="tiny-deepseek-v3"),
    }
    return paths, run_ranks(_uneven_on_rank, 2, paths, timeout=180)


@pytest.mark.parametrize("arch,layers", [("qwen3_moe", [[1], [2, 3]]), ("deepseek_v3", [[1, 2], [3]])])
def test_uneven_pipeline_matches_hugging_face(uneven_results, arch, layers):
    from safetensors.torch import load_file

    paths, results = uneven_results
    assert [r[arch]["layers"] for r in results] == layers
    assert results[0][arch]["log_probs"] is None  # only the last stage has log-probs
    got = results[1][arch]["log_probs"].double()
    ref = hf_log_probs(paths[arch])  # float64 (DeepSeek-V3's router: fp32, as Megatron's)
    mask = make_rows()["response_mask"].double()
    torch.testing.assert_close(got * mask, ref * mask, atol=1e-5, rtol=0)
    hf = load_file(str(Path(paths[arch]) / "model.safetensors"))
    exported = results[0][arch]["weights"]
    assert set(exported) == set(hf), sorted(set(hf) ^ set(exported))[:5]
    for k, v in exported.items():
        assert torch.equal(v, hf[k]), k
