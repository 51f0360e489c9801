"""The planner against what was measured: published RL runs, and two quickstart layouts on this host.

    .venv/bin/python benchmarks/bench_plan.py [--calibration [--fit]] [--cpu] [--steps 12] [--repeats 3]

--calibration: the planner's time model against the published runs of
benchmarks/published_runs.yaml (verl, NeMo-RL, Megatron-Bridge, the Megatron-Core MoE model zoo,
slime), each turned into a megarl config by benchmarks/_published.py and priced by the planner's
own functions (benchmarks/_calibration.py), with megarl/perf/steptime.py's GPU_EFFICIENCY. Prints
one row per measured metric (split, published, predicted, error), each run's error (the mean
|predicted / measured - 1| over its timed metrics) and its assumptions, the runs excluded and why,
the fit half's mean error, and last `calibration: mean abs error N%`: the mean over the held-out
runs of their run errors. The split, fixed before any held-out error was seen: within each kind
(rl_step, train_step, weight_sync) runs alternate fit, holdout, ... in file order; an entry whose
notes say to use it as a check and not to fit it is held out (the rows entered after the constants
were fitted are such checks: their own error line tests the frozen model). --fit refits the free constants
(calibration.FREE) on the fit half alone first (six starts, ~2 min) and prints them.

--cpu: runs the quickstart for --steps steps in two layouts (tp1/pp1/ep2, and pp2), --repeats times
interleaved, and compares the medians of its logged phase times (steps 3..N; then the median over
runs, with the range) and the ranks' measured memory
(perf/memory/*: parameters, gradients and optimizer state in bytes, peak RSS) with the plan's.
The CPU constants in megarl/perf/steptime.py were set from earlier runs of the first layout; the
second layout is the out-of-sample check.
Prints markdown for benchmarks/RESULTS.md.

--smoke: the calibration, and --cpu for the out-of-sample layout only: one run of 3 steps (the
first 2 are left out, as always), to check the script and the planner against a real run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def calibration(refit: bool = False) -> None:
    """The per-run table over benchmarks/published_runs.yaml, the fit half's error, and last the
    held-out error line. refit: fit the free constants on the fit half first and use them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _calibration import FREE, mean_abs, predict, prepare, run_errors, timed_metrics
    from _calibration import fit_multistart as fit_constants
    from _published import CHECK_ONLY, NOT_PRICED, entered_after_fit

    from megarl.perf.steptime import GPU_EFFICIENCY

    priced, excluded, halves = prepare()
    eff = GPU_EFFICIENCY
    if refit:
        eff = fit_constants([p for p in priced if halves[p.run["id"]] == "fit"], GPU_EFFICIENCY)
    print("constants: " + ", ".join(f"{k}={getattr(eff, k):.4g}" for k in FREE) + (" (refitted)" if refit else ""))
    print()
    print("| published run | metric | split | published | predicted | error |")
    print("|---|---|---|---:|---:|---:|")
    for p in priced:
        run, half = p.run, halves[p.run["id"]]
        pred, counted = predict(p, eff), timed_metrics(p.run)
        errors = run_errors(p, eff)
        for metric, value in run["measured"].items():
            if metric in NOT_PRICED:
                shown, err = "not priced: " + NOT_PRICED[metric], ""
            elif metric in CHECK_ONLY:
                from _calibration import memory_gb

                planned = memory_gb(p, metric)
                shown = f"{planned:.3g}"
                err = f"{planned / value - 1:+.0%} (check: {CHECK_ONLY[metric]})"
            else:
                shown = f"{pred[metric]:.3g}"
                err = f"{pred[metric] / value - 1:+.0%}" + ("" if metric in counted else " (not counted: implied)")
            print(f"| {run['id']} | {metric} | {half} | {value:.3g} | {shown} | {err} |")
        run_err = sum(abs(x) for x in errors.values()) / len(errors)
        notes = "; ".join(p.assumptions) or "-"
        print(f"| | (run error) | {half} | | {run_err:.0%} | assumed: {notes} |")
    for run, why in excluded:
        print(f"| {run['id']} | excluded | {halves[run['id']]} | | | {why} |")
    fit_half = [p for p in priced if halves[p.run["id"]] == "fit"]
    held = [p for p in priced if halves[p.run["id"]] == "holdout"]
    late = [p for p in held if entered_after_fit(p.run)]
    print()
    if late:  # a test of the frozen constants: these runs were entered after the fit, priced once
        print(f"of the held-out, entered after the fit: mean abs error {mean_abs(late, eff):.0%} over {len(late)} runs")
    print(f"fit half: mean abs error {mean_abs(fit_half, eff):.0%} over {len(fit_half)} runs")
    print(f"calibration: mean abs error {mean_abs(held, eff) * 100:.0f}% (held-out, per run, {len(held)} runs)")


def _run_quickstart(out: Path, steps: int, overrides: list[str]) -> list[dict]:
    """The quickstart's metrics rows; its output goes to a log whose tail a failure quotes."""
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "train",
        str(ROOT / "configs" / "quickstart.yaml"),
        f"trainer.total_steps={steps}",
        "trainer.val_every=0",
        "trainer.export_hf=false",
        f"trainer.output_dir={out}",
        "trainer.loggers=[console,jsonl]",
        *overrides,
    ]
    log = out / "train.log"
    with open(log, "w") as f:
        done = subprocess.run(
            cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"bench_plan: the quickstart run exited {done.returncode}; its log's last lines:\n{tail}")
    return [json.loads(line) for line in (out / "quickstart" / "metrics.jsonl").read_text().splitlines()]


LAYOUTS = {
    "tp1 pp1 ep2 (default; its earlier runs set the CPU constants)": [],
    "pp2 ep1 (out of sample)": ["actor.parallel.pp=2", "actor.parallel.ep=1"],
}


def cpu(steps: int, repeats: int, layouts: dict, extra: list[str]) -> None:
    from megarl.cli import _model_config
    from megarl.config.loader import load_config
    from megarl.config.validate import validate
    from megarl.perf.hardware import MiB, cpu_device
    from megarl.perf.plan import make_plan

    times = {
        "generation s": ["perf/gen_s"],
        "log-probs s": ["perf/old_log_prob_s", "perf/ref_s"],
        "update s": ["perf/update_s"],
        "weight sync s (+ release/resume)": ["perf/sync_s", "perf/release_s", "perf/resume_s", "perf/resume_kv_s"],
        "step s": ["perf/step_s"],
        "params MiB (largest rank)": ["perf/memory/actor_params_gib"],
        "grads MiB": ["perf/memory/actor_grads_gib"],
        "optimizer MiB": ["perf/memory/actor_optimizer_gib"],
        "rank peak RSS MiB vs the plan's trainer peak": ["perf/memory/actor_peak_gib"],
    }
    runs: dict[str, list[dict]] = {name: [] for name in layouts}
    for _ in range(repeats):  # layouts interleaved, so machine noise hits both alike
        for name, overrides in layouts.items():
            with tempfile.TemporaryDirectory() as tmp:
                rows = _run_quickstart(Path(tmp), steps, overrides + extra)[2:]
            runs[name].append(
                {
                    q: statistics.median(sum(r.get(k, 0.0) for k in keys) for r in rows) * (1024 if "MiB" in q else 1)
                    for q, keys in times.items()
                }
            )
    print(f"| layout | quantity | measured (median of {repeats} runs; range) | predicted | error |")
    print("|---|---|---:|---:|---:|")
    for name, overrides in layouts.items():
        cfg = validate(load_config(str(ROOT / "configs" / "quickstart.yaml"), overrides))
        plan = make_plan(cfg, _model_config(cfg), cpu_device(2))
        t = plan.time
        predicted = {
            "generation s": t.generation,
            "log-probs s": t.log_prob,
            "update s": t.update,
            "weight sync s (+ release/resume)": t.weight_sync,
            "step s": t.total,
            "params MiB (largest rank)": plan.train.params / MiB,
            "grads MiB": plan.train.grads / MiB,
            "optimizer MiB": plan.train.optimizer / MiB,
            "rank peak RSS MiB vs the plan's trainer peak": plan.train.peak / MiB,
        }
        for q in times:
            values = [run[q] for run in runs[name]]
            m, p = statistics.median(values), predicted[q]
            # a phase the loop did not run (e.g. old log-probs under actor.old_log_prob=rollout) logs nothing
            error = f"{(p - m) / m:+.0%}" if m else "not run"
            print(f"| {name} | {q} | {m:.3g} ({min(values):.3g}-{max(values):.3g}) | {p:.3g} | {error} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--fit", action="store_true", help="--calibration: refit the free constants on the fit half first")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="--cpu: model.path of the runs (default: the quickstart's, built)")
    ap.add_argument("--smoke", action="store_true", help="calibration + one 3-step run (checks the script)")
    args = ap.parse_args(argv)
    layouts = LAYOUTS
    if args.smoke:  # smoke sizes replace the defaults only: flags given explicitly still win
        args.steps = 3 if args.steps == ap.get_default("steps") else args.steps
        args.repeats = 1 if args.repeats == ap.get_default("repeats") else args.repeats
        layouts = {k: v for k, v in LAYOUTS.items() if "out of sample" in k}
    if args.steps < 3:
        ap.error("--steps must be >= 3 (the first 2 steps are left out)")
    if args.calibration or not args.cpu:
        calibration(args.fit)
    if args.cpu or not (args.calibration or args.fit):
        print()
        cpu(args.steps, args.repeats, layouts, [f"model.path={args.model}"] if args.model else [])


if __name__ == "__main__":
    main()
