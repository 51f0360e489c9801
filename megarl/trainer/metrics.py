"""Per-step metrics (train and sft): metrics.jsonl, a one-line console progress, the trackers of
trainer.loggers (trackers.py), and a curve summary."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

CONSOLE_KEYS = [
    ("sft/loss", "loss", "{:.4f}"),  # megarl sft
    ("val/sft/loss", "val_loss", "{:.4f}"),
    ("reward/mean", "reward", "{:.3f}"),
    ("reward/ground_truth_mean", "truth", "{:.3f}"),  # a model reward's run: the rule verifier beside it
    ("val/reward_mean", "val", "{:.3f}"),
    ("val/reward/ground_truth_mean", "val_truth", "{:.3f}"),
    ("response/length_mean", "len", "{:.2f}"),
    ("actor/kl", "kl", "{:.4f}"),
    ("actor/ppo_kl", "ppo_kl", "{:.4f}"),
    ("actor/entropy", "ent", "{:.3f}"),
    ("actor/grad_norm", "gnorm", "{:.3f}"),
    ("rollout/logprob_diff_max", "lpdiff", "{:.1e}"),  # async modes: off-policy rows' mismatch too
    ("parity/diff_max", "parity", "{:.1e}"),  # async modes: the engines re-scoring under the last sync
    ("perf/mfu/update", "mfu", "{:.1%}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
    ("perf/step_s", "s/step", "{:.2f}"),
]


def is_wall_clock(key: str) -> bool:
    """Metrics that measure time (perf/*, *_s): they differ between any two runs, so a resumed
    run's metrics.jsonl equals the uninterrupted run's in every key but these."""
    return key.startswith("perf/") or key.endswith("_s")


def compare_runs(a: Path, b: Path) -> tuple[int, list[str]]:
    """(steps compared, differences) of two metrics.jsonl files, wall-clock keys left out; every
    other value must be identical, float for float, and both files must have the same steps."""

    def load(path: Path) -> dict[int, dict]:
        return {r["step"]: r for r in map(json.loads, Path(path).read_text().splitlines())}

    ra, rb = load(a), load(b)
    diffs = [f"steps only in {a}: {sorted(set(ra) - set(rb))}"] if set(ra) - set(rb) else []
    diffs += [f"steps only in {b}: {sorted(set(rb) - set(ra))}"] if set(rb) - set(ra) else []
    for step in sorted(set(ra) & set(rb)):
        keys = {k for k in (*ra[step], *rb[step]) if not is_wall_clock(k)}
        diffs += [
            f"step {step} {k}: {ra[step].get(k)!r} vs {rb[step].get(k)!r}"
            for k in sorted(keys)
            if ra[step].get(k) != rb[step].get(k)
        ]
    return len(set(ra) & set(rb)), diffs


class MetricsLogger:
    def __init__(
        self,
        trackers: list | None,
        total_steps: int,
        log_every: int = 1,
        stream=sys.stdout,
        jsonl_path: str | Path | None = None,
        resume_step: int = 0,
        console: bool = True,
    ):
        """trackers: writers with log(step, metrics) and close() (trackers.make_trackers), each
        given every step's metrics. console=False: no step lines on `stream` (notes still go there).
        resume_step > 0: a run continuing after step `resume_step` of a checkpoint: the records
        of steps up to it are kept (metrics.jsonl, the curve summary), those a killed run wrote
        after it are dropped, as if it had never got there (each tracker does what it can:
        trackers.py)."""
        self.trackers = list(trackers or [])
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.jsonl = None
        if jsonl_path is not None:
            kept = self._kept_records(Path(jsonl_path), resume_step)
            for record in kept:
                for key, value in record.items():
                    if key != "step":
                        self.history.setdefault(key, []).append((record["step"], float(value)))
            # this run's steps only: a fresh run must not interleave with an old file
            self.jsonl = open(jsonl_path, "w")
            self.jsonl.writelines(json.dumps(r) + "\n" for r in kept)
            self.jsonl.flush()
        self.total_steps = total_steps
        self.log_every = max(1, log_every)
        self.stream = stream
        self.console = console
        self.start = time.perf_counter()

    @staticmethod
    def _kept_records(path: Path, resume_step: int) -> list[dict]:
        if not resume_step or not path.is_file():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # the last line of a run killed while writing it
                continue
            if record.get("step", resume_step + 1) <= resume_step:
                records.append(record)
        return records

    def log(self, step: int, metrics: dict[str, float]) -> None:
        metrics = {key: float(value) for key, value in metrics.items()}
        for key, value in metrics.items():
            self.history.setdefault(key, []).append((step, value))
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        for tracker in self.trackers:
            tracker.log(step, metrics)
        if self.console and (step % self.log_every == 0 or step == self.total_steps):
            self.stream.write(self.format_line(step, metrics) + "\n")
            self.stream.flush()

    def note(self, text: str) -> None:
        """One line of news (a checkpoint saved, a run resumed) between the step lines."""
        self.stream.write(f"megarl: {text}\n")
        self.stream.flush()

    def format_line(self, step: int, metrics: dict[str, float]) -> str:
        parts = [f"step {step}/{self.total_steps}"]
        for key, label, fmt in CONSOLE_KEYS:
            if key in metrics and math.isfinite(float(metrics[key])):
                parts.append(f"{label} {fmt.format(float(metrics[key]))}")
        parts.append(f"elapsed {time.perf_counter() - self.start:.0f}s")
        return " | ".join(parts)

    def values(self, key: str) -> list[float]:
        return [v for _, v in self.history.get(key, [])]

    def curve_summary(self, key: str = "reward/mean", window: int = 10) -> dict:
        vals = self.values(key)
        if not vals:
            return {}
        w = min(window, len(vals))
        first, last = sum(vals[:w]) / w, sum(vals[-w:]) / w
        return {
            "key": key,
            "steps": len(vals),
            "window": w,
            "first_mean": first,
            "last_mean": last,
            "ratio": last / first if first > 0 else math.inf,
            "max": max(vals),
        }

    def close(self, failed: bool = False) -> None:
        """failed: the run ends by an exception (trackers that record a run's outcome say so)."""
        try:
            for tracker in self.trackers:
                tracker.close(failed)
        finally:
            if self.jsonl is not None:
                self.jsonl.close()
