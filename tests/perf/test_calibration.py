"""The planner's calibration on benchmarks/published_runs.yaml: every run is priced or excluded
with its reason, the fit / held-out split is fixed by its rule, and `bench_plan.py --calibration`
ends with the held-out error line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def prepared():
    from _calibration import prepare

    return prepare()


def test_every_published_run_is_priced_or_excluded_with_its_reason(prepared):
    from _calibration import predict, timed_metrics
    from _published import load_runs

    from megarl.perf.steptime import GPU_EFFICIENCY

    priced, excluded, _ = prepared
    ids = [r["id"] for r in load_runs()]
    assert sorted([p.run["id"] for p in priced] + [r["id"] for r, _ in excluded]) == sorted(ids)
    assert all(why.strip() for _, why in excluded)
    for p in priced:
        metrics = timed_metrics(p.run)
        assert metrics, f"{p.run['id']}: no measured time the planner prices"
        predicted = predict(p, GPU_EFFICIENCY)
        assert all(predicted[m] > 0 and predicted[m] != p.run["measured"][m] for m in metrics)


def test_split_follows_its_rule_and_appending_runs_moves_nothing():
    from _published import check_only, entered_after_fit, load_runs, split

    runs = load_runs()
    halves = split(runs)
    for kind in ("rl_step", "train_step", "weight_sync"):
        order = [r["id"] for r in runs if r["kind"] == kind and not check_only(r)]
        assert [halves[i] for i in order] == ["fit" if n % 2 == 0 else "holdout" for n in range(len(order))]
        assert {"fit", "holdout"} <= {halves[r["id"]] for r in runs if r["kind"] == kind}
    assert [r["id"] for r in runs if check_only(r)] == [
        "slime-qwen3-30b-a3b-sync-8xH100-colocated",
        *(r["id"] for r in runs if entered_after_fit(r)),
    ]
    assert [r["id"] for r in runs if entered_after_fit(r)] == [
        "mbridge-dsv3-256xB300-mxfp8-pretrain",
        "mbridge-qwen3-30b-a3b-8xB300-mxfp8-pretrain",
        "mbridge-qwen3-235b-256xB300-mxfp8-pretrain",
    ]
    assert {halves[r["id"]] for r in runs if check_only(r)} == {"holdout"}
    extra = {**runs[0], "id": "appended-run"}
    assert {k: v for k, v in split([*runs, extra]).items() if k != "appended-run"} == halves


def test_framework_traits_come_from_the_notes():
    from _published import forced_balance, load_runs, overlaps_a2a

    runs = {r["id"]: r for r in load_runs()}
    forced = {i for i, r in runs.items() if forced_balance(r)}
    assert forced == {i for i in runs if i.startswith("mbridge-")} | {"mcore-qwen3-235b-256xH100-bf16-ep32"}
    overlapped = {i for i, r in runs.items() if overlaps_a2a(r)}
    assert overlapped == {
        "mbridge-qwen3-235b-256xH100-fp8-pretrain",
        "mbridge-dsv3-256xB200-mxfp8-pretrain",
        "mbridge-qwen3-30b-a3b-8xB200-mxfp8-pretrain",
        "mbridge-qwen3-235b-256xB200-mxfp8-pretrain",
        "mbridge-qwen3-30b-a3b-8xB300-mxfp8-pretrain",
        "mbridge-qwen3-235b-256xB300-mxfp8-pretrain",
    }  # the model zoo's EP32 row; the B300 DeepSeek-V3 recipe has no overlap is the one without its 1F1B overlap


def test_fp8_and_node_dispatch_come_from_the_runs_precision_notes_and_recipes():
    """FP8 from precision.train; node-level dispatch where the notes or table name DeepEP, never
    where they name the plain all-to-all dispatcher, else Megatron-Bridge's recipes (HybridEP)."""
    from _published import fp8_gemms, load_runs, node_dispatch

    runs = {r["id"]: r for r in load_runs()}
    assert {i for i, r in runs.items() if fp8_gemms(r)} == {i for i in runs if i.startswith("mbridge-")}
    node = {i for i, r in runs.items() if node_dispatch(r)}
    assert node == {i for i in runs if i.startswith("mbridge-")} | {
        "mcore-qwen3-235b-256xH100-bf16-ep32",  # notes: DeepEP dispatch
        "mcore-qwen3-235b-256xH100-bf16-tp4-norecompute",  # table: TP4 DeepEP row
    }
    assert "mcore-qwen3-235b-256xH100-bf16-pp32-a2a" not in node  # notes: plain all-to-all dispatcher


def test_host_memory_is_a_check_not_a_timed_metric(prepared):
    """verl's 1500 GB of host memory is compared with the plan's host memory per node (plan.host:
    the host optimizer's share and what colocation offload parks there) and stays out of the
    time error."""
    from _calibration import memory_gb, timed_metrics
    from _published import CHECK_ONLY, NOT_PRICED

    from megarl.perf.plan import make_plan

    priced, _, _ = prepared
    (p,) = [p for p in priced if p.run["id"] == "verl-dsv3-96xH20-grpo"]
    assert "cpu_memory_gb" in CHECK_ONLY and "cpu_memory_gb" not in NOT_PRICED
    assert "cpu_memory_gb" not in timed_metrics(p.run)
    host = make_plan(p.cfg, p.hf, p.device, timed=False).host
    assert host["actor host optimizer"] > 0  # the harness ran verl's CPU Adam on the host
    assert memory_gb(p, "cpu_memory_gb") == pytest.approx(sum(host.values()) / 1e9)
    assert memory_gb(p, "cpu_memory_gb") != pytest.approx(memory_gb(p, "gpu_memory_gb"), rel=0.1)


def test_the_fit_moves_constants_toward_the_fit_half_only(prepared):
    """A fit on one run pulls the decode bandwidth toward that run's generation time, whatever the
    held-out runs would say (they are not passed)."""
    from _calibration import fit, mean_abs

    from megarl.perf.steptime import Efficiency

    priced, _, _ = prepared
    one = [p for p in priced if p.run["id"] == "verl-qwen3-30b-a3b-sync-16to16xH20"]
    start = Efficiency()
    fitted = fit(one, start, rounds=2, n=9)
    assert mean_abs(one, fitted) < mean_abs(one, start)


def test_bench_plan_calibration_ends_with_the_held_out_error_line():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_plan.py"), "--calibration"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert re.fullmatch(r"calibration: mean abs error \d+% \(held-out, per run, \d+ runs\)", lines[-1]), lines[-1]
    assert lines[-2].startswith("fit half: mean abs error")
    late = r"of the held-out, entered after the fit: mean abs error \d+% over 3 runs"
    assert re.fullmatch(late, lines[-3]), lines[-3]
    assert "| published run | metric | split |" in done.stdout


def test_each_sync_is_priced_as_its_source_moved_the_weights(prepared):
    """verl's sync_s is one NCCL broadcast per tensor (each tensor its own request), its
    checkpoint-engine time bucketed; NeMo-RL's refit inside a step is priced as `reshard`, not as
    the config's `tensor` sync of its layout. Independent reference: sync_model.predict itself."""
    from _calibration import A2A_OVERLAP, predict
    from _published import efficiency_for

    from megarl.perf.steptime import GPU_EFFICIENCY, step_time
    from megarl.perf.sync_model import predict as predict_sync

    priced, _, _ = prepared
    (verl,) = [p for p in priced if p.run["id"] == "verl-qwen3-30b-a3b-sync-16to16xH20"]
    e = efficiency_for(verl, GPU_EFFICIENCY, A2A_OVERLAP)
    alone = predict_sync(verl.cfg, verl.hf, verl.device, verl.rollout_mem, e, alone=True)["distributed"].s
    bucketed = predict_sync(verl.cfg, verl.hf, verl.device, verl.rollout_mem, e)["distributed"].s
    assert alone > 1.5 * bucketed  # the two ways differ, so the checks below can tell them apart
    got = predict(verl, GPU_EFFICIENCY)
    assert got["sync_s"] == pytest.approx(alone) and got["sync_s_checkpoint_engine"] == pytest.approx(bucketed)

    (nemo,) = [p for p in priced if p.run["id"] == "nemorl-dsv3-256xH100-grpo"]
    e = efficiency_for(nemo, GPU_EFFICIENCY, A2A_OVERLAP)
    t = step_time(nemo.timing, nemo.hf, nemo.device, nemo.train_mem, nemo.rollout_mem, nemo.mean_response, e)
    reshard = predict_sync(nemo.cfg, nemo.hf, nemo.device, nemo.rollout_mem, e)["reshard"].s
    assert t.weight_sync > 10 * reshard  # the config's own transport would cost far more
    assert predict(nemo, GPU_EFFICIENCY)["step_s"] == pytest.approx(t.total - t.weight_sync + reshard)


def test_recompute_modules_are_priced_by_the_flops_they_recompute(prepared):
    """Selective recompute is priced as full only when its modules hold most of the forward's FLOPs:
    DeepSeek-V3's `mlp` covers its three dense layers (a few percent), Qwen3's `moe` its experts."""
    from _published import load_runs, recomputed_share

    priced, _, _ = prepared
    by_id = {p.run["id"]: p for p in priced}
    dsv3 = by_id["mbridge-dsv3-1024xH100-fp8-pretrain"]
    qwen = by_id["mcore-qwen3-235b-256xH100-bf16-seq16k"]
    assert [r["layout"]["recompute"] for r in load_runs() if r["id"] in (dsv3.run["id"], qwen.run["id"])] == [
        "selective:mla_up_proj,mlp",
        "selective:layernorm,moe",
    ]
    # independent count: three dense MLPs of 3 x hidden x intermediate over the active matmul weights
    # of the layers (flops.count_params, less the embedding and the output layer)
    from megarl.perf.flops import count_params

    h, vocab = dsv3.hf["hidden_size"], dsv3.hf["vocab_size"]
    dense = 3 * 3 * h * dsv3.hf["intermediate_size"]
    layers = count_params(dsv3.hf).matmul_active - 2 * vocab * h
    assert recomputed_share(dsv3.hf, ["mla_up_proj", "mlp"]) == pytest.approx(dense / layers, rel=0.02)
    assert recomputed_share(qwen.hf, ["layernorm", "moe"]) > 0.5
    assert (dsv3.cfg.actor.recompute, qwen.cfg.actor.recompute) == ("selective", "full")


def test_nemo_rl_responses_run_to_the_shared_cap_less_their_prompt(prepared):
    """NeMo-RL caps prompt + response together: the time model's longest response is max_seq_len
    less the mean prompt, while the memory plan keeps the 512-token prompt cap."""
    priced, _, _ = prepared
    (p,) = [p for p in priced if p.run["id"] == "nemorl-dsv3-256xH100-grpo"]
    w = p.run["workload"]
    assert p.timing.rollout.max_new_tokens == w["max_seq_len"] - w["mean_prompt_tokens"]
    assert p.cfg.rollout.max_new_tokens == w["max_seq_len"] - 512
    assert p.cfg.data.max_prompt_length == 512
