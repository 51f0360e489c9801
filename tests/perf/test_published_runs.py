"""benchmarks/published_runs.yaml: the published runs the planner is calibrated and checked on.

Each entry must say where its numbers come from, which model and hardware ran, its whole
parallel layout, and at least one measured number; the layout must add up to the GPUs it ran on
(the arithmetic Megatron itself enforces), and a published tokens/s must agree with the published
step time and batch. The set must be wide enough to fit on half and test on the other half.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from megarl.perf.hardware import parse_devices

ROOT = Path(__file__).resolve().parents[2]
RUNS = yaml.safe_load((ROOT / "benchmarks" / "published_runs.yaml").read_text())["runs"]
KINDS = {"rl_step", "train_step", "weight_sync"}
LAYOUT_KEYS = ("tp", "pp", "vpp", "cp", "ep", "etp", "dp", "recompute", "offload", "colocated", "rollout")
# HF model id -> the planner's copy of its config.json under configs/models/
MODEL_CONFIGS = {
    "deepseek-ai/DeepSeek-V3": "deepseek-v3",
    "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
}


def _ids(runs):
    return [r["id"] for r in runs]


def training_gpus(run) -> int:
    """GPUs holding the trainer: all of them, unless the rollout pool has devices of its own."""
    layout, count = run["layout"], run["hardware"]["count"]
    if layout["colocated"] or layout["rollout"] is None:
        return count
    return count - layout["rollout"]["gpus"]


def test_the_set_is_wide_enough_to_fit_on_half_and_test_on_the_other():
    assert len(RUNS) >= 6
    assert len({r["framework"] for r in RUNS}) >= 3
    assert {r["kind"] for r in RUNS} == KINDS, "the update, the whole RL step and the sync each need data"
    assert len(set(_ids(RUNS))) == len(RUNS), "ids must be unique"


@pytest.mark.parametrize("run", RUNS, ids=_ids(RUNS))
def test_entry_names_its_source_model_and_hardware(run):
    assert run["kind"] in KINDS
    src = run["source"]
    has_commit = src.get("repo") and src.get("path") and re.fullmatch(r"[0-9a-f]{40}", src.get("commit", ""))
    assert has_commit or str(src.get("url", "")).startswith("https://"), f"{run['id']}: no citable source"
    assert run["model"] in MODEL_CONFIGS, f"{run['id']}: the planner has no config for {run['model']}"
    assert (ROOT / "configs" / "models" / MODEL_CONFIGS[run["model"]] / "config.json").is_file()
    hw = run["hardware"]
    count, _ = parse_devices(f"{hw['count']}x{hw['gpu']}")  # a device the planner knows
    assert count > 0 and count % hw["gpus_per_node"] in (0, count)
    assert run["notes"].strip()


@pytest.mark.parametrize("run", RUNS, ids=_ids(RUNS))
def test_layout_is_complete_and_adds_up_to_the_gpus(run):
    layout = run["layout"]
    missing = [k for k in LAYOUT_KEYS if k not in layout]
    assert not missing, f"{run['id']}: layout lacks {missing}"
    unset = [k for k in LAYOUT_KEYS if layout[k] is None and k not in ("vpp", "rollout")]
    assert not unset, f"{run['id']}: layout leaves {unset} unset"
    tp, pp, cp, dp, ep, etp = (layout[k] for k in ("tp", "pp", "cp", "dp", "ep", "etp"))
    assert tp * pp * cp * dp == training_gpus(run), f"{run['id']}: tp*pp*cp*dp != training GPUs"
    # Megatron folds tp*cp*dp into etp*ep*edp for the experts
    assert (tp * cp * dp) % (ep * etp) == 0, f"{run['id']}: ep*etp does not divide tp*cp*dp"
    if "edp" in layout:
        assert layout["edp"] == tp * cp * dp // (ep * etp)
    if run["kind"] == "train_step":
        assert layout["rollout"] is None
        return
    rollout = layout["rollout"]
    assert rollout["engine"] in ("vllm", "sglang") and rollout["tp"] >= 1
    rollout_gpus = run["hardware"]["count"] if layout["colocated"] else rollout["gpus"]
    assert rollout["tp"] * rollout["dp"] == rollout_gpus, f"{run['id']}: rollout tp*dp != its GPUs"


@pytest.mark.parametrize("run", RUNS, ids=_ids(RUNS))
def test_at_least_one_measured_number_and_assumptions_name_real_fields(run):
    measured = run["measured"]
    assert measured and all(isinstance(v, (int, float)) and v > 0 for v in measured.values())
    if "mfu" in measured:
        assert measured["mfu"] < 1, "mfu is a fraction"
    for path in run["assumed"]:
        node = run
        for part in path.split("."):
            assert part in node, f"{run['id']}: assumed {path!r} is not a field of the entry"
            node = node[part]


def tokens_per_step(workload) -> float | None:
    if "rollouts_per_step" in workload and "mean_prompt_tokens" in workload:
        return workload["rollouts_per_step"] * (workload["mean_prompt_tokens"] + workload["mean_response_tokens"])
    if "seq_len" in workload and "global_batch" in workload:
        return workload["global_batch"] * workload["seq_len"]
    return None


WITH_BOTH = [r for r in RUNS if {"step_s", "tokens_per_s_per_gpu"} <= set(r["measured"])]


@pytest.mark.parametrize("run", WITH_BOTH, ids=_ids(WITH_BOTH))
def test_published_throughput_agrees_with_published_step_time_and_batch(run):
    """Catches a digit copied wrong: tokens/s/GPU * step * GPUs must be the step's tokens (2%:
    the sources average over steps, and the prompt length is inferred to the token)."""
    m = run["measured"]
    tokens = tokens_per_step(run["workload"])
    assert tokens is not None, f"{run['id']}: publishes both, so give the batch that links them"
    implied = m["tokens_per_s_per_gpu"] * m["step_s"] * run["hardware"]["count"]
    assert implied == pytest.approx(tokens, rel=0.02)
