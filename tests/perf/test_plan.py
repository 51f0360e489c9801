"""The planner: memory per device against what Megatron really allocates, the verdicts of
`megarl plan` on the scale configs, and the refusal (exit 2, one line naming the knob) by plan and
by train alike.

The independent reference for memory is the engine itself: two gloo ranks build the tiny MoE model
in three layouts, train one mini-batch, and report the bytes of their parameters, gradient buffers
and optimizer state (offload_groups: what offload moves); the planner predicts the same from the
HF config alone. Tolerance: 2% (Megatron pads its contiguous buffers to bucket boundaries).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._dist import run_ranks
from tests.engine.test_megatron_engine import make_rows

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {
    "ep2-distopt": dict(ep=2, dist=True),
    "pp2-plain": dict(pp=2, dist=False),
    "tp2-distopt": dict(tp=2, dist=True),
}


def _measure_on_rank(rank, model_path):
    import torch

    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine
    from megarl.engine.megatron.offload import offload_groups
    from tests.engine.test_offload import _loss_fn

    torch.set_num_threads(1)
    out = {}
    for name, layout in LAYOUTS.items():
        from megatron.core import parallel_state as ps

        p = ParallelConfig(
            tp=layout.get("tp", 1),
            pp=layout.get("pp", 1),
            ep=layout.get("ep", 1),
            sequence_parallel=layout.get("tp", 1) > 1,
        )
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        engine = MegatronEngine(
            EngineSpec(
                model_path=str(model_path),
                parallel=p,
                micro_batch_size=2,
                seed=1,
                optim=OptimConfig(lr=1e-3, use_distributed_optimizer=layout["dist"]),
            )
        )
        engine.initialize()
        engine.train_mini_batch(make_rows(), _loss_fn)
        groups = offload_groups(engine.model, engine.optimizer)
        out[name] = {k: sum(t.numel() * t.element_size() for t in v) for k, v in groups.items()}
    return out


@pytest.fixture(scope="module")
def measured(tiny_model_path):
    return run_ranks(_measure_on_rank, 2, tiny_model_path)


def _cfg(layout: dict):
    from megarl.config.schema import RunConfig

    cfg = RunConfig()
    p = cfg.actor.parallel
    p.tp, p.pp, p.ep = layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1)
    p.sequence_parallel = p.tp > 1
    cfg.actor.optim.use_distributed_optimizer = layout["dist"]
    cfg.cluster.num_actor_ranks = 2
    return cfg


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_predicted_static_memory_matches_what_megatron_allocates(measured, tiny_model_path, name):
    from megarl.perf.hardware import cpu_device
    from megarl.perf.memory import stage_params, train_memory

    hf = json.loads((Path(tiny_model_path) / "config.json").read_text())
    cfg = _cfg(LAYOUTS[name])
    device = cpu_device(2, host_memory=8 * 2**30, peak=1e9)
    worst = max((r[name] for r in measured), key=lambda m: m["params"])
    predicted = train_memory(cfg, hf, device)
    assert predicted.params == pytest.approx(worst["params"], rel=0.02)
    assert predicted.grads == pytest.approx(worst["grads"], rel=0.02)
    assert predicted.optimizer == pytest.approx(worst["optimizer"], rel=0.02)
    # and every rank, not only the worst: each pipeline stage's own prediction
    per_stage = stage_params(hf, cfg.actor.parallel)
    if cfg.actor.parallel.pp == 2:
        for rank, m in enumerate(measured):
            st = per_stage[rank]
            assert (st.dense + st.expert) * 4 == pytest.approx(m[name]["params"], rel=0.02)


def _load(name: str, *overrides: str):
    from megarl.config.loader import load_config
    from megarl.config.validate import validate

    cfg = validate(load_config(str(ROOT / "configs" / f"{name}.yaml"), list(overrides)))
    hf = json.loads((ROOT / cfg.model.path / "config.json").read_text())
    return cfg, hf


def test_stage_params_add_up_to_the_model_and_split_like_megatron():
    from megarl.perf.flops import count_params
    from megarl.perf.memory import stage_params

    cfg, hf = _load("deepseek-v3-671b")
    p = cfg.actor.parallel
    stages = stage_params(hf, p)
    assert [len(s.layers) for s in stages] == [3] + [4] * 14 + [2]
    assert stages[0].expert == 0  # the three dense layers
    experts = sum(s.expert for s in stages) * p.ep
    assert experts == 256 * 58 * 3 * hf["hidden_size"] * hf["moe_intermediate_size"]
    # unsplit (tp = ep = 1), the stages hold the whole model, once
    from dataclasses import replace

    whole = stage_params(hf, replace(p, tp=1, ep=1))
    assert sum(s.dense + s.expert for s in whole) == count_params(hf).total
    # tied embeddings: one copy with pp = 1, a second on the last stage with pp > 1 (Megatron)
    tied = {**hf, "tie_word_embeddings": True}
    one = stage_params(tied, replace(p, tp=1, ep=1, pp=1, first_stage_layers=None, last_stage_layers=None))
    assert one[0].dense + one[0].expert == count_params(tied).total
    two = stage_params(tied, replace(p, tp=1, ep=1))
    assert sum(s.dense + s.expert for s in two) == count_params(tied).total + hf["vocab_size"] * hf["hidden_size"]


@pytest.mark.parametrize("name", ["deepseek-v3-671b", "qwen3-235b-a22b", "qwen3-30b-a3b"])
def test_plan_prints_the_breakdown_of_each_scale_config(name, capsys, monkeypatch):
    from megarl.cli import main

    monkeypatch.chdir(ROOT)
    cfg, _ = _load(name)
    rc = main(["plan", str(ROOT / "configs" / f"{name}.yaml"), "--devices", f"{cfg.cluster.num_actor_ranks}xH100"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    for phase in ("train", "generate", "sync", "generation", "log-probs", "update", "weight sync"):
        assert phase in out.out
    assert "DOES NOT FIT" not in out.out


@pytest.mark.parametrize(
    "overrides,says",
    [
        (["actor.optim.use_distributed_optimizer=false"], "set actor.optim.use_distributed_optimizer=true"),
        (["actor.recompute=none"], "set actor.recompute=full"),
        (["actor.offload.optimizer=false"], "set actor.offload.optimizer=true"),
        (
            ["actor.offload.optimizer=false", "actor.offload.grads=false", "actor.offload.params=false"],
            "no single change fits: start with actor.offload.optimizer",
        ),
        # 8 GPUs at tp 1 x ep 4: the experts' Adam state is 43 GB per GPU and the rest does not fit
        # beside it, so it goes to the host; in fp32 (which the host optimizer refuses) on 4 GPUs
        # nothing fits
        (
            ["cluster.num_actor_ranks=8", "rollout.num_servers=4", "actor.parallel.tp=1", "actor.parallel.ep=4"],
            "set actor.offload.host_optimizer=1.0",
        ),
        (
            ["cluster.num_actor_ranks=4", "rollout.num_servers=2", "actor.parallel.ep=4", "actor.precision=fp32"],
            "more devices (cluster.num_actor_ranks)",
        ),
    ],
)
def test_an_overfull_layout_is_refused_with_the_knob_to_change(overrides, says, capsys, monkeypatch):
    from megarl.cli import main

    monkeypatch.chdir(ROOT)
    ranks = next((o.split("=")[1] for o in overrides if o.startswith("cluster.num_actor_ranks=")), "16")
    devices = f"{ranks}xH100"
    rc = main(["plan", "configs/qwen3-30b-a3b.yaml", *overrides, "--devices", devices])
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert rc == 2 and "DOES NOT FIT" in out.out
    assert len(err) == 1 and err[0].startswith("megarl: plan: does not fit:")
    assert says in err[0], err[0]


def test_an_async_loop_on_its_own_pools_is_predicted_at_its_slower_side(capsys, monkeypatch):
    """Qwen3-30B-A3B on 64 H100s, 1k-token answers: colocated sync sums the phases; fully_async on
    32 + 32 devices overlaps them, so a step is generation or training, whichever is longer."""
    import re

    from megarl.cli import main

    monkeypatch.chdir(ROOT)
    layout = ["cluster.placement=disaggregated", "cluster.num_actor_ranks=32", "rollout.num_servers=16"]
    printed = {}
    for mode in ("sync", "fully_async"):
        args = [*layout, f"trainer.mode={mode}", "rollout.max_new_tokens=1024"]
        assert main(["plan", "configs/qwen3-30b-a3b.yaml", *args, "--devices", "64xH100"]) == 0
        printed[mode] = capsys.readouterr().out
    t = {
        k: float(v)
        for k, v in re.findall(
            r"^  (generation|log-probs|update|weight sync|total) +([\d.]+)", printed["fully_async"], re.M
        )
    }
    overlapped = float(re.search(r"^  fully_async: ([\d.]+) ", printed["fully_async"], re.M)[1])
    assert overlapped == pytest.approx(max(t["generation"], t["log-probs"] + t["update"] + t["weight sync"]), abs=0.11)
    assert overlapped < t["total"] and "overlap" not in printed["sync"]


def test_train_refuses_before_starting_anything(capsys, tmp_path, monkeypatch):
    from megarl.cli import main

    # a model dir with "weights" (an empty file: the weights check only looks for one) so the
    # memory check is what refuses; the embedded backend so this host's missing SGLang is not
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((ROOT / "configs/models/qwen3-30b-a3b/config.json").read_text())
    (model / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(ROOT)
    rc = main(
        [
            "train",
            "configs/qwen3-30b-a3b.yaml",
            f"model.path={model}",
            "rollout.backend=embedded",
            "cluster.device_type=H100",
            "actor.optim.use_distributed_optimizer=false",
            f"trainer.output_dir={tmp_path / 'out'}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "does not fit in memory" in err[0] and "actor.optim.use_distributed_optimizer=true" in err[0]
    assert not (tmp_path / "out").exists()  # no run dir, no process


def test_devices_must_match_the_pools_and_name_a_known_device(capsys, monkeypatch):
    from megarl.cli import main

    monkeypatch.chdir(ROOT)
    path = str(ROOT / "configs" / "qwen3-30b-a3b.yaml")
    assert main(["plan", path, "--devices", "8xH100"]) == 2
    assert "cluster.num_actor_ranks" in capsys.readouterr().err
    assert main(["plan", path, "--devices", "16xV100"]) == 2
    assert "unknown device 'V100'" in capsys.readouterr().err
    assert main(["show-config", path, "cluster.device_type=TPU"]) == 2
    assert "cluster.device_type" in capsys.readouterr().err


def test_more_memory_never_hurts_and_recompute_shrinks_activations():
    from dataclasses import replace

    from megarl.perf.hardware import GPUS
    from megarl.perf.memory import train_memory
    from megarl.perf.plan import make_plan

    cfg, hf = _load("qwen3-30b-a3b", "actor.optim.use_distributed_optimizer=false")
    assert cfg.cluster.num_actor_ranks == 16
    small = make_plan(cfg, hf, GPUS["H100"])
    big = make_plan(cfg, hf, replace(GPUS["H100"], memory=1e13))
    assert not small.fits and big.fits
    assert small.time.total > 0 and small.time.generation > small.time.weight_sync
    if hasattr(cfg.actor, "recompute"):
        cfg.actor.recompute = "full"
        full = train_memory(cfg, hf, GPUS["H100"])
        cfg.actor.recompute = "none"
        none = train_memory(cfg, hf, GPUS["H100"])
        assert full.activations < none.activations / 4


def test_the_prm_and_the_critic_are_planned_beside_the_actor():
    """PRIME's implicit PRM is a second trained model on the actor's ranks: its whole state in a
    phase of its own (not counting its resident part twice), its resident part in every other
    phase, its offloaded part on the host, and a refusal that names its own knob."""
    from megarl.perf.hardware import GPUS
    from megarl.perf.memory import train_memory
    from megarl.perf.plan import make_plan, refusal

    h100 = GPUS["H100"]
    base_cfg, hf = _load("qwen3-30b-a3b")
    base = make_plan(base_cfg, hf, h100, timed=False)
    cfg, _ = _load("qwen3-30b-a3b", "algorithm.adv_estimator=prime")
    plan = make_plan(cfg, hf, h100, timed=False)
    prm = train_memory(cfg, hf, h100, "prm")
    own = plan.phases["prm train"]
    assert (own["prm params"], own["prm optimizer"], own["prm activations"]) == (
        prm.params,
        prm.optimizer,
        prm.activations,
    )
    assert own["prm logits"] > 0 and "prm resident" not in own  # a causal LM's head; its state once
    for phase in ("train", "generate", "sync"):
        assert plan.phases[phase]["prm resident"] == prm.resident(cfg.prm.offload)
        ref = plan.phases[phase]["reference params"]  # PRIME's reference: the PRM's baseline
        assert "reference params" not in base.phases[phase]
        assert plan.peak(phase) == pytest.approx(base.peak(phase) + prm.resident(cfg.prm.offload) + ref)
    assert "prm train" not in base.phases and "prm (offloaded)" not in plan.host
    why = refusal(cfg, hf, plan)
    assert why is not None and "(prm resident" in why and "start with prm.offload.grads" in why, why

    off, _ = _load(
        "qwen3-30b-a3b",
        "algorithm.adv_estimator=prime",
        *(f"prm.offload.{k}=true" for k in ("params", "grads", "optimizer")),
    )
    parked = make_plan(off, hf, h100, timed=False)
    assert parked.phases["train"]["prm resident"] == prm.reserve
    ranks = min(off.cluster.devices_per_node or off.cluster.num_actor_ranks, off.cluster.num_actor_ranks)
    assert parked.host["prm (offloaded)"] == pytest.approx(prm.static * ranks)

    gae, _ = _load("qwen3-30b-a3b", "algorithm.adv_estimator=gae", "critic.enabled=true")
    critic = make_plan(gae, hf, h100, timed=False).phases["critic train"]
    assert "critic resident" not in critic and critic["critic params"] > 0


def test_a_colocated_models_largest_item_names_that_models_knob():
    """When no single change fits, the knob for the largest item of a critic or PRM phase is that
    model's own, not the actor's or "more devices"."""
    from megarl.perf.plan import _fallback_knob

    cfg, _ = _load("qwen3-30b-a3b", "algorithm.adv_estimator=prime")  # the critic section is read as it stands
    assert _fallback_knob(cfg, "prm train", {"prm activations": 9.0, "prm params": 1.0}) == "prm.recompute"
    cfg.prm.recompute = "full"
    assert _fallback_knob(cfg, "prm train", {"prm activations": 9.0}) == "prm.micro_batch_size"
    assert _fallback_knob(cfg, "prm train", {"prm grads": 9.0}) == "prm.parallel.pp"
    cfg.critic.optim.use_distributed_optimizer = False
    assert _fallback_knob(cfg, "critic train", {"critic optimizer": 9.0}) == "critic.optim.use_distributed_optimizer"
    assert _fallback_knob(cfg, "train", {"critic resident": 9.0}) == "critic.offload.optimizer"  # 12 bytes unsharded
    assert _fallback_knob(cfg, "train", {"prm resident": 9.0}) == "prm.offload.grads"
