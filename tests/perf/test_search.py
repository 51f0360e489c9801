"""`megarl plan --search`: the layouts it ranks are the ones `megarl plan` itself predicts (same step
time, every phase fitting), the published layouts sit in its space where the planner puts them, and
a space with no layout that fits is refused in one line naming what binds.

The independent reference for every number is `make_plan` on a config the full `validate`
accepted, built here from the candidate's layout, not the search's own decomposed sums.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, *overrides: str):
    from megarl.config.loader import load_config
    from megarl.config.validate import validate

    cfg = validate(load_config(str(ROOT / "configs" / f"{name}.yaml"), list(overrides)))
    hf = json.loads((ROOT / cfg.model.path / "config.json").read_text())
    return cfg, hf


def _published():
    """The first three published runs the planner was checked on, as configs (benchmarks/_published.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _published import BASE_CONFIGS, load_runs, overrides

    names = {
        "verl-dsv3-96xH20-grpo": "verl DeepSeek-V3 671B, 96 x H20",
        "nemorl-dsv3-256xH100-grpo": "NeMo-RL DeepSeek-V3, 256 x H100",
        "verl-qwen3-30b-a3b-8xH20-grpo": "verl Qwen3-30B-A3B, 8 x H20",
    }
    out = {}
    for run in load_runs():
        if run["id"] in names:
            hw = run["hardware"]
            out[names[run["id"]]] = (BASE_CONFIGS[run["model"]], overrides(run)[0], f"{hw['count']}x{hw['gpu']}")
    return out


PUBLISHED = _published()


@pytest.fixture(scope="module")
def deepseek_search():
    import contextlib
    import io

    from megarl.cli import main

    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["plan", str(ROOT / "configs/deepseek-v3-671b.yaml"), "--devices", "256xH100", "--search", "--json"])
    return rc, out.getvalue(), err.getvalue(), time.perf_counter() - start


def test_671b_search_lists_feasible_layouts_ranked_by_the_plans_own_step_time(deepseek_search, monkeypatch):
    from megarl.perf.hardware import GiB, parse_devices
    from megarl.perf.plan import make_plan
    from megarl.perf.search import apply, step_seconds

    monkeypatch.chdir(ROOT)
    rc, out, err, seconds = deepseek_search
    assert rc == 0, err
    assert seconds < 60, f"the 671B search took {seconds:.1f} s"
    doc = json.loads(out)
    assert set(doc) >= {"candidates", "shipped_step_s"}
    cands = doc["candidates"]
    assert len(cands) >= 3
    steps = [c["step_s"] for c in cands]
    assert steps == sorted(steps)
    assert steps[0] <= doc["shipped_step_s"]
    cfg, hf = _load("deepseek-v3-671b")
    _, device = parse_devices("256xH100")
    from megarl.config.validate import validate

    for c in cands:
        assert set(c) >= {"layout", "step_s", "fits", "memory_gib"} and c["fits"] is True
        assert all(v <= device.memory / GiB for v in c["memory_gib"].values())
        plan = make_plan(validate(apply(cfg, c["layout"]), hf), hf, device)
        assert plan.fits
        assert c["step_s"] == pytest.approx(step_seconds(cfg, plan.time), rel=1e-9)
        assert c["memory_gib"] == pytest.approx({k: plan.peak(k) / GiB for k in plan.phases}, rel=1e-9)
        # megarl's tensor transport refuses an engine over several hosts: such candidates sync otherwise
        layout = {**{"rollout.nnodes": cfg.rollout.nnodes, "bridge.transport": cfg.bridge.transport}, **c["layout"]}
        assert layout["rollout.nnodes"] == 1 or layout["bridge.transport"] != "tensor", layout
    assert any(c["layout"].get("rollout.nnodes", 1) > 1 for c in cands)  # the check above has work to do
    shipped = make_plan(cfg, hf, device)
    assert doc["shipped_step_s"] == pytest.approx(shipped.time.total, rel=1e-9)


def _in_space(name, without: str = ""):
    from megarl.perf.hardware import parse_devices
    from megarl.perf.plan import make_plan
    from megarl.perf.search import _changed, ranked_layouts, step_seconds

    base, overrides, devices = PUBLISHED[name]
    overrides = [o for o in overrides if not (without and o.startswith(without))]
    if "rollout.nnodes=1" not in overrides:  # engines over hosts sync as `distributed` (the search's rule)
        overrides = [*overrides, "bridge.transport=distributed"]
    cfg, hf = _load(base, *overrides)
    count, device = parse_devices(devices)
    plan = make_plan(cfg, hf, device)
    ranked, _, _ = ranked_layouts(cfg, hf, count, device)
    at = [i for i, (_, layout) in enumerate(ranked) if not _changed(cfg, layout)]
    return cfg, hf, plan, step_seconds(cfg, plan.time), ranked, at


@pytest.mark.slow  # ~20 s: 24k trainer x engine pairs fit 256 H100 at NeMo-RL's short sequences
def test_nemo_rl_deepseek_layout_is_in_the_space_where_the_plan_ranks_it():
    cfg, hf, plan, step, ranked, at = _in_space("NeMo-RL DeepSeek-V3, 256 x H100")
    assert plan.fits
    assert len(at) == 1, "the published layout is not (or more than once) in the search space"
    score, _ = ranked[at[0]]
    assert score == pytest.approx(step, rel=1e-9)
    assert all(s <= score for s, _ in ranked[: at[0]]) and all(s >= score for s, _ in ranked[at[0] :])
    assert ranked[0][0] <= step


@pytest.mark.parametrize(
    "name,largest,without",
    [
        ("verl DeepSeek-V3 671B, 96 x H20", "actor optimizer", "actor.offload.host_optimizer="),
        ("verl Qwen3-30B-A3B, 8 x H20", "actor activations", ""),
    ],
)
def test_verls_layouts_are_refused_by_the_plan_and_left_out_of_the_ranking(name, largest, without):
    """verl runs Adam on the host: without actor.offload.host_optimizer its DeepSeek-V3 layout's
    Adam state alone outgrows an H20; its Qwen3-30B-A3B layout trains 10k-token micro-batches
    without recompute, whose activations the model puts above the Adam state. Neither is ranked."""
    from megarl.perf.plan import refusal

    cfg, hf, plan, _, ranked, at = _in_space(name, without)
    assert not plan.fits and at == []
    train = plan.phases["train"]
    assert max(train, key=train.get) == largest
    assert f"({largest} " in refusal(cfg, hf, plan)
    assert all(score > 0 for score, _ in ranked)
    if without:  # with the host optimizer, as verl ran it, the same layout fits
        assert _in_space(name)[2].fits


def test_an_overfull_space_is_refused_in_one_line_naming_the_binding_constraint(capsys, monkeypatch):
    from megarl.cli import main

    monkeypatch.chdir(ROOT)
    rc = main(["plan", "configs/deepseek-v3-671b.yaml", "--devices", "8xH100", "--search"])
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert rc == 2 and out.out == ""
    assert len(err) == 1 and err[0].startswith("megarl: plan: does not fit: no layout fits 8 x H100"), err
    assert "train phase" in err[0] and "actor optimizer" in err[0] and "--devices" in err[0]


@pytest.mark.parametrize(
    "args,says", [(["--search"], "--devices"), (["--search", "--devices", "16xH100", "--top", "0"], "--top")]
)
def test_search_flags_are_checked(args, says, capsys, monkeypatch):
    from megarl.cli import main

    monkeypatch.chdir(ROOT)
    rc = main(["plan", "configs/qwen3-30b-a3b.yaml", *args])
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert rc == 2 and out.out == "" and len(err) == 1 and says in err[0]


def test_30b_search_prints_the_ranking_with_why_each_loses(capsys, monkeypatch):
    from megarl.cli import main

    monkeypatch.chdir(ROOT)
    rc = main(["plan", "configs/qwen3-30b-a3b.yaml", "--devices", "16xH100", "--search", "--top", "3"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if line[:2].strip().isdigit()]
    assert len(rows) == 3 and "(best)" in rows[0]
    why = ("generation +", "update +", "log prob +", "weight sync +", "(a tie at the step's resolution)")
    assert all(any(t in r for t in why) for r in rows[1:])


def test_pipeline_splits_are_the_most_balanced_megatron_accepts():
    from megarl.config.schema import ParallelConfig
    from megarl.config.validate_pipeline import stage_layers
    from megarl.perf.search_space import stage_splits

    assert (3, 2) in stage_splits(61, 16, 1)  # the shipped DeepSeek-V3 split
    assert (None, 6) in stage_splits(61, 12, 1)  # verl's
    assert (11, 11) in stage_splits(94, 8, 1)  # the shipped Qwen3-235B split
    assert stage_splits(48, 4, 1) == ((None, None),)
    assert stage_splits(61, 16, 2) == ()  # an odd depth has no split into pairs of virtual stages
    for first, last in stage_splits(61, 16, 1):
        sizes = stage_layers(ParallelConfig(pp=16, first_stage_layers=first, last_stage_layers=last), 61)
        assert max(sizes) == 4 and sum(sizes) == 61


def test_expert_traffic_is_priced_over_the_whole_expert_group():
    """ep=1 with etp=8 holds the same expert shards as ep=8 and moves the routed tokens over the
    same 8 ranks: the same update time, not one without the expert traffic (with the load forced
    balanced: the busiest expert rank of ep=8 is a term of its own, update_time.moe_imbalance)."""
    from dataclasses import replace

    from megarl.perf.hardware import parse_devices
    from megarl.perf.memory import train_memory
    from megarl.perf.steptime import GPU_EFFICIENCY, update_time

    _, device = parse_devices("16xH100")
    times = {}
    for ep, etp in ((8, 1), (1, 8)):
        cfg, hf = _load("qwen3-30b-a3b", "actor.parallel.tp=1", f"actor.parallel.ep={ep}", f"actor.parallel.etp={etp}")
        mem = train_memory(cfg, hf, device)
        balanced = replace(GPU_EFFICIENCY, routing_cv=0.0)
        times[ep, etp] = update_time(cfg, hf, device, mem, 8192, balanced, 8, 4)[0]
    assert times[1, 8] == pytest.approx(times[8, 1], rel=1e-9)


def test_dp_attention_and_context_parallel_pay_for_their_traffic(monkeypatch):
    """Terms the search ranks by: with DP attention an engine's MLP and experts still span its tp
    ranks (a gather and a scatter per layer, bytes over the links), and context parallel passes
    key/value chunks around its ring: with infinitely fast links each costs nothing, on real ones
    it costs time."""
    from dataclasses import replace

    from megarl.perf.hardware import parse_devices
    from megarl.perf.memory import rollout_memory, train_memory
    from megarl.perf.steptime import GPU_EFFICIENCY, generation_time, update_time

    _, device = parse_devices("256xH100")
    no_latency = replace(GPU_EFFICIENCY, collective_s=0.0)
    free = replace(no_latency, link=1e12)
    cfg, hf = _load("deepseek-v3-671b")  # engines of 32 over 4 nodes, DP attention 32
    assert cfg.rollout.dp == cfg.rollout.tp == 32
    mem = rollout_memory(cfg, hf, device)
    paid, unpaid = (generation_time(cfg, hf, device, mem, 4096, eff) for eff in (no_latency, free))
    assert paid > unpaid * 1.001

    cfg, hf = _load("qwen3-30b-a3b", "actor.parallel.cp=2")
    tm = train_memory(cfg, hf, device)
    with_ring = update_time(cfg, hf, device, tm, 8192, no_latency, 8, 4)[0]
    monkeypatch.setattr("megarl.perf.update_time._kv_elements", lambda hf: 0)  # a ring that moves nothing
    ring = with_ring - update_time(cfg, hf, device, tm, 8192, no_latency, 8, 4)[0]
    kv = 2 * hf["num_key_value_heads"] * hf["head_dim"]
    tokens = cfg.data.train_batch_size * cfg.rollout.n * (cfg.data.max_prompt_length + 8192) / 16  # per rank, tp=2
    expected = tokens * hf["num_hidden_layers"] * kv * 2 * 1 * 3 / (device.nvlink_bw * no_latency.link)
    assert ring == pytest.approx(expected, rel=1e-6)  # bf16 K and V, cp - 1 = 1 hop, 3 passes (recompute)
