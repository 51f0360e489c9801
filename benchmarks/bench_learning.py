"""Learning per sample: how many trained samples each loop mode needs to reach a trailing reward.

    .venv/bin/python benchmarks/bench_learning.py [--steps 200] [--modes sync,one_step_off,fully_async]
        [--config configs/disaggregated.yaml] [--target 0.9] [--window 10] [--out DIR] [override ...]
    .venv/bin/python benchmarks/bench_learning.py --runs RUN_DIR [RUN_DIR ...]   # analyse finished runs

Each mode is a real `megarl train CONFIG trainer.mode=MODE` run (the CLI, one after another, start-up
not counted), on the quickstart's digits task (configs/disaggregated.yaml: the async loops need
engines on devices of their own), with the off-policy correction as the modes resolve it
(actor.rollout_is.level auto: token-level TIS in one_step_off and fully_async, off in sync).
Samples consumed are counted from each step's trained rows (data.train_batch_size x rollout.n:
every mode trains the same number per step; fully_async drops stale groups before training and
counts them apart). Reported per mode: the first step whose trailing --window-step mean reward
reaches --target, the samples consumed by then, their ratio to the sync loop's (the goal: <= 1.25
for the async modes), the first and last window's reward, and the run's wall time.

--smoke: the analysis on curves built in code (no run): checks the script end to end in a second.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def samples_to_target(metrics: list[dict], target: float, window: int) -> tuple[int | None, int | None]:
    """(step, samples consumed through it) where the trailing `window`-step mean of reward/mean
    first reaches `target`; (None, None) when it never does."""
    samples, rewards = 0, []
    for m in metrics:
        samples += m["_rows"]
        rewards.append(m["reward/mean"])
        if len(rewards) >= window and sum(rewards[-window:]) / window >= target:
            return m["step"], samples
    return None, None


def read_run(run_dir: Path, rows_per_step: int | None = None) -> list[dict]:
    """The run's metrics.jsonl, each step with the rows it trained (`_rows`)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(x) for x in lines if x.strip()]
    if rows_per_step is None:
        config = (Path(run_dir) / "config.yaml").read_text()
        rows_per_step = _config_int(config, "train_batch_size") * _config_int(config, "n")
    for m in metrics:
        m["_rows"] = rows_per_step
    return metrics


def _config_int(config: str, key: str) -> int:
    for line in config.splitlines():
        name, _, value = line.strip().partition(":")
        if name == key and value.strip().split("#")[0].strip().isdigit():
            return int(value.strip().split("#")[0])
    raise ValueError(f"no integer {key} in the run's config.yaml")


def report(runs: dict[str, list[dict]], walls: dict[str, float], target: float, window: int) -> str:
    lines = [
        f"| mode | steps | step where the {window}-step mean reaches {target} | samples by then | vs sync "
        f"| reward, first {window} -> last {window} | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    base = samples_to_target(runs["sync"], target, window)[1] if "sync" in runs else None
    for mode, metrics in runs.items():
        step, samples = samples_to_target(metrics, target, window)
        r = [m["reward/mean"] for m in metrics]
        first, last = sum(r[:window]) / min(window, len(r)), sum(r[-window:]) / min(window, len(r))
        ratio = f"{samples / base:.2f}x" if samples and base else "-"
        wall = f"{walls[mode]:.0f}" if mode in walls else "-"
        lines.append(
            f"| {mode} | {len(metrics)} | {step if step else 'not reached'} | {samples or '-'} | {ratio} "
            f"| {first:.3f} -> {last:.3f} | {wall} |"
        )
    return "\n".join(lines)


def run_mode(mode: str, args, out: Path) -> tuple[Path, float]:
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "train",
        args.config,
        f"trainer.mode={mode}",
        f"trainer.total_steps={args.steps}",
        f"trainer.output_dir={out / mode}",
        "trainer.loggers=[console,jsonl]",
        *args.overrides,
    ]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"{mode}: megarl train exited {done.returncode}:\n{done.stdout[-4000:]}")
    run_dir = next((out / mode).iterdir())
    return run_dir, wall


def _smoke_runs(tmp: Path) -> list[Path]:
    """Two finished-looking runs with known curves (0 before step `rise`, 1 from it): with a window
    of 2, sync's trailing mean reaches 0.9 at step 11, fully_async's at 13."""
    dirs = []
    for name, rise in (("sync", 10), ("fully_async", 12)):
        run = tmp / name / "disaggregated"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text("data:\n  train_batch_size: 16\nrollout:\n  n: 16\n")
        curve = [0.0 if step < rise else 1.0 for step in range(1, 21)]
        lines = [json.dumps({"step": s, "reward/mean": r}) for s, r in enumerate(curve, 1)]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        dirs.append(run)
    return dirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--modes", default="sync,one_step_off,fully_async")
    parser.add_argument("--config", default="configs/disaggregated.yaml")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--runs", type=Path, nargs="+", default=None, help="analyse these run dirs (mode = parent name)"
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("overrides", nargs="*", help="section.key=value for every run")
    args = parser.parse_args()
    runs, walls = {}, {}
    if args.smoke:
        args.runs, args.window = _smoke_runs(Path(tempfile.mkdtemp(prefix="bench_learning_"))), 2
    if args.runs:
        for run in args.runs:
            runs[run.parent.name] = read_run(run)
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix="bench_learning_"))
        for mode in args.modes.split(","):
            run_dir, walls[mode] = run_mode(mode, args, out)
            runs[mode] = read_run(run_dir)
            print(f"{mode}: {run_dir} ({walls[mode]:.0f} s)", flush=True)
    print(report(runs, walls, args.target, args.window))


if __name__ == "__main__":
    main()
