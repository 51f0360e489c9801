"""The planner's time model against benchmarks/published_runs.yaml: predictions per measured metric,
the least-squares fit of the free efficiency constants on the fit half, and the errors.

Prediction: each run (benchmarks/_published.py) is priced by the planner's own functions with its
Efficiency (the constants, plus its framework's traits): an RL step by steptime.step_time on the
config at the run's mean prompt and response lengths; a pre-training step by
steptime.trainer_time's update alone; a weight sync by megarl/perf/sync_model.py, per transport
as the source moved the weights (published.py).

Error of a metric: predicted / measured - 1. Error of a run: the mean of |error| over its timed
metrics (a run publishing both a step time and the tokens/s it implies counts once, not twice).
The reported error of a half: the mean over its runs.

Fit: the free constants (FREE) minimise the sum over the fit half's runs of the mean squared
log-ratio log(predicted / measured) of each run's timed metrics, by coordinate descent over a
log-spaced grid within each constant's bounds (5 rounds, the grid narrowing around the best),
from several starts (the given constants, each bound's geometric middle, and seeded random points
within the bounds; coordinate descent alone stops in the first valley it finds), keeping the
lowest fit-half loss. Held-out runs never enter it.
"""

from __future__ import annotations

import math
from dataclasses import replace

from _published import (
    CHECK_ONLY,
    NOT_PRICED,
    REFIT_AS,
    SYNC_PER_TENSOR,
    Priced,
    efficiency_for,
    load_runs,
    price,
    split,
)

# the free constants and their bounds; (lo, hi, log-spaced)
FREE = {
    "gemm": (0.1, 0.9, True),
    "gemm_fp8": (0.1, 0.9, True),  # moves only the FP8 runs: fitted on the fit half's FP8 runs alone
    "prefill": (0.1, 0.9, True),
    "decode_bw": (0.1, 0.95, True),
    "link": (0.1, 0.95, True),
    "step_overhead_s": (0.001, 0.2, True),
    "tensor_s": (1e-4, 1e-2, True),
    "dp_overlap": (0.0, 1.0, False),
    "routing_cv": (0.0, 1.0, False),  # above 1 most experts would sit idle: not a balanced router
}
# stated, not fitted: no fit-half run overlaps its all-to-all; half of it hidden
A2A_OVERLAP = 0.5


def prepare() -> tuple[list[Priced], list[tuple[dict, str]], dict[str, str]]:
    """(priced runs, [(run, why) excluded], id -> fit | holdout)."""
    from megarl.config.loader import ConfigError
    from megarl.perf.memory import rollout_memory, train_memory

    runs = load_runs()
    halves = split(runs)
    priced, excluded = [], []
    for run in runs:
        try:
            p = price(run)
        except (ConfigError, ValueError) as e:
            excluded.append((run, f"megarl's validation refuses its layout: {e}"))
            continue
        p.train_mem = train_memory(p.cfg, p.hf, p.device)
        p.rollout_mem = rollout_memory(p.cfg, p.hf, p.device)
        priced.append(p)
    return priced, excluded, halves


def memory_gb(p: Priced, metric: str = "gpu_memory_gb") -> float:
    """The planned memory a CHECK_ONLY metric measures: a device's peak while training
    (gpu_memory_gb; a host optimizer's share is off the device, memory.py), or the host memory
    per node the trainer's state takes (cpu_memory_gb: plan.host, beyond the processes' own)."""
    from megarl.perf.plan import make_plan

    plan = make_plan(p.cfg, p.hf, p.device, timed=False)
    if metric == "cpu_memory_gb":
        return sum(plan.host.values()) / 1e9
    return plan.peak("train") / 1e9


def predict(p: Priced, eff) -> dict[str, float]:
    """metric -> predicted value, for every metric of the run the planner prices."""
    from megarl.perf.steptime import step_time, trainer_time
    from megarl.perf.sync_model import predict as predict_sync

    run, kind = p.run, p.run["kind"]
    e = efficiency_for(p, eff, A2A_OVERLAP)
    world = p.cfg.cluster.num_actor_ranks
    transport = p.cfg.bridge.transport
    if kind == "weight_sync":
        out = {}
        for metric in ("sync_s", "sync_s_checkpoint_engine"):
            alone = run["id"] in SYNC_PER_TENSOR.get(metric, ())
            out[metric] = predict_sync(p.cfg, p.hf, p.device, p.rollout_mem, e, alone=alone)[transport].s
        return out
    peak = p.device.peak_flops("bf16")
    if kind == "train_step":
        w = run["workload"]
        out = {}
        for metric, ee in (("", e), ("_forced_balance", replace(e, routing_cv=0.0))):
            _, upd, flops, _ = trainer_time(p.timing, p.hf, p.device, p.train_mem, p.mean_response, ee)
            out |= {f"step_s{metric}": upd, f"tflops_per_gpu{metric}": flops / upd / p.count / 1e12}
            out[f"tokens_per_s_per_gpu{metric}"] = w["global_batch"] * w["seq_len"] / upd / p.count
        return out
    t = step_time(p.timing, p.hf, p.device, p.train_mem, p.rollout_mem, p.mean_response, e)
    if run["framework"] in REFIT_AS:
        sync = predict_sync(p.cfg, p.hf, p.device, p.rollout_mem, e)[REFIT_AS[run["framework"]]].s
        t = replace(t, weight_sync=sync)
    passes = 1 + bool(p.cfg.ref.enabled) + bool(p.cfg.critic.enabled)
    rows = p.cfg.data.train_batch_size * p.cfg.rollout.n
    return {
        "step_s": t.total,
        "generation_s": t.generation,
        "old_log_prob_s": t.log_prob / passes,
        "ref_log_prob_s": t.log_prob / passes,
        "update_s": t.update,
        "mfu": t.train_flops / (t.update * world * peak),
        "tokens_per_s_per_gpu": rows * (p.mean_prompt + p.mean_response) / t.total / p.count,
    }


def timed_metrics(run: dict) -> list[str]:
    """The run's measured metrics that enter its error. A throughput the same source derives from a
    step time it also publishes (tokens/s/GPU, TFLOP/s/GPU), or TFLOP/s next to tokens/s (the same
    time over a FLOP count), is shown but not counted again."""
    out = [m for m in run["measured"] if m not in NOT_PRICED and m not in CHECK_ONLY]
    implied = {"step_s": ("tokens_per_s_per_gpu", "tflops_per_gpu"), "tokens_per_s_per_gpu": ("tflops_per_gpu",)}
    for first, rest in implied.items():
        if first in out:
            out = [m for m in out if m not in rest]
    return out


def run_errors(p: Priced, eff) -> dict[str, float]:
    pred = predict(p, eff)
    return {m: pred[m] / p.run["measured"][m] - 1 for m in timed_metrics(p.run)}


def mean_abs(priced: list[Priced], eff) -> float:
    per_run = [sum(abs(x) for x in errs.values()) / len(errs) for errs in (run_errors(p, eff) for p in priced)]
    return sum(per_run) / len(per_run)


def _loss(priced: list[Priced], eff) -> float:
    total = 0.0
    for p in priced:
        errs = run_errors(p, eff)
        total += sum(math.log1p(x) ** 2 for x in errs.values()) / len(errs)
    return total


def _grid(lo: float, hi: float, log: bool, n: int) -> list[float]:
    if log:
        return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def starts(start, count: int, seed: int = 0) -> list:
    """The given constants, the middle of every bound, and count - 2 seeded random points."""
    import random

    rng = random.Random(seed)

    def point(pick):
        return replace(start, **{k: pick(lo, hi, log) for k, (lo, hi, log) in FREE.items()})

    def middle(lo, hi, log):
        return math.sqrt(lo * hi) if log else (lo + hi) / 2

    def uniform(lo, hi, log):
        return math.exp(rng.uniform(math.log(lo), math.log(hi))) if log else rng.uniform(lo, hi)

    return [start, point(middle)] + [point(uniform) for _ in range(max(count - 2, 0))]


def fit_multistart(priced: list[Priced], start, count: int = 6):
    """fit() from each of starts(start, count); the result with the lowest loss on `priced`."""
    fits = [fit(priced, s) for s in starts(start, count)]
    return min(fits, key=lambda e: _loss(priced, e))


def fit(priced: list[Priced], start, rounds: int = 5, n: int = 13):
    """The Efficiency fitted on `priced` (the fit half only), starting from `start`."""
    values = {k: getattr(start, k) for k in FREE}
    bounds = dict(FREE)
    best = _loss(priced, replace(start, **values))
    for _ in range(rounds):
        for k, (lo, hi, log) in bounds.items():
            for x in _grid(lo, hi, log, n):
                trial = {**values, k: x}
                loss = _loss(priced, replace(start, **trial))
                if loss < best - 1e-12:
                    best, values = loss, trial
        for k, (lo, hi, log) in FREE.items():  # narrow every range around the best so far
            blo, bhi, _ = bounds[k]
            x = values[k]
            if log:
                r = (bhi / blo) ** 0.25
                bounds[k] = (max(lo, x / r), min(hi, x * r), True)
            else:
                w = (bhi - blo) / 4
                bounds[k] = (max(lo, x - w), min(hi, x + w), False)
    return replace(start, **values)
