"""Per-step metrics: tensorboard events, a one-line console progress, and a curve summary."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

CONSOLE_KEYS = [
    ("reward/mean", "reward", "{:.3f}"),
    ("val/reward_mean", "val", "{:.3f}"),
    ("response/length_mean", "len", "{:.2f}"),
    ("actor/kl", "kl", "{:.4f}"),
    ("actor/ppo_kl", "ppo_kl", "{:.4f}"),
    ("actor/entropy", "ent", "{:.3f}"),
    ("actor/grad_norm", "gnorm", "{:.3f}"),
    ("rollout/logprob_diff_max", "lpdiff", "{:.1e}"),
    ("perf/step_s", "s/step", "{:.2f}"),
]


class MetricsLogger:
    def __init__(self, log_dir: str | Path | None, total_steps: int, log_every: int = 1,
                 stream=sys.stdout, jsonl_path: str | Path | None = None):
        self.writer = None
        # this run's steps only: without resume, a re-run must not interleave with an old file
        self.jsonl = open(jsonl_path, "w") if jsonl_path is not None else None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(log_dir))
        self.total_steps = total_steps
        self.log_every = max(1, log_every)
        self.stream = stream
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.start = time.perf_counter()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            value = float(value)
            self.history.setdefault(key, []).append((step, value))
            if self.writer is not None:
                self.writer.add_scalar(key, value, step)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
            self.jsonl.flush()
        if step % self.log_every == 0 or step == self.total_steps:
            self.stream.write(self.format_line(step, metrics) + "\n")
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
        return {"key": key, "steps": len(vals), "window": w, "first_mean": first,
                "last_mean": last, "ratio": last / first if first > 0 else math.inf,
                "max": max(vals)}

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
