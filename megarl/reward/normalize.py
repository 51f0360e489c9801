"""Normalising a model reward's scores before the loss sees them (reward.model.normalize).

A Bradley-Terry reward model is trained only on differences r(chosen) - r(rejected): its offset is
arbitrary and its scale is whatever the training reached, and neither says anything about how
good a response is. What the policy should see is where a response stands among the policy's own
responses, on a scale that does not depend on the model that scored it.

- `none`: the score as the model gives it (remote endpoints and the generative judge already
  score on a fixed scale; their default).
- `batch`: each training batch whitened to mean 0, std 1 over its rows. Adapts at once, but the
  same response gets a different reward in different steps, and reward/mean is 0 every step, so
  the reward curve no longer shows learning.
- `running` (the classifier's default): the mean and std of every training row scored so far
  (Chan et al.'s parallel update of count, mean and sum of squares, batch by batch, including the
  batch being normalised). The scale settles after a few steps and then moves slowly, so rewards
  stay comparable from step to step and reward/mean still rises as the policy improves, while
  the arbitrary offset and scale are gone; combined with a rule reward (combine=add) the model's
  part stays near unit scale. Its state is saved in run checkpoints.

Both use the population std (ddof 0) and divide by std + EPS. Failed rows (reward.model.on_failure
fallback) are neither counted nor normalised: they get fallback_score afterwards. Only training
batches update the statistics; validation and ReMax's greedy baselines are normalised with the
statistics as they are (`batch`: the last training batch's), or with their own batch's before
any training batch was seen.
"""

from __future__ import annotations

import math
import threading

import numpy as np

EPS = 1e-6
MODES = ("none", "batch", "running")


class ScoreNormalizer:
    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"normalize must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self._lock = threading.Lock()  # fully_async's producer and validation may score at once
        self.count, self.mean, self.m2 = 0, 0.0, 0.0  # running: every training row so far
        self.batch_stats: tuple[float, float] | None = None  # batch: the last training batch's

    def __call__(self, values: np.ndarray, train: bool) -> np.ndarray:
        """`values` (float64 in, float64 out) normalised; a training batch updates the statistics
        first (module doc)."""
        values = np.asarray(values, dtype=np.float64)
        if self.mode == "none" or values.size == 0:
            return values
        with self._lock:
            if train:
                self._update(values)
            stats = self._stats() or _mean_std(values)
        mean, std = stats
        return (values - mean) / (std + EPS)

    def _update(self, values: np.ndarray) -> None:
        if self.mode == "batch":
            self.batch_stats = _mean_std(values)
            return
        n, mean = values.size, float(values.mean())
        m2 = float(((values - mean) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.m2 += m2 + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.count = total

    def _stats(self) -> tuple[float, float] | None:
        if self.mode == "batch":
            return self.batch_stats
        if self.count == 0:
            return None
        return self.mean, math.sqrt(self.m2 / self.count)

    def metrics(self) -> dict[str, float]:
        """The mean and std training batches are normalised with now (none: {})."""
        with self._lock:
            stats = self._stats() if self.mode != "none" else None
        return {} if stats is None else {"reward/model_norm_mean": stats[0], "reward/model_norm_std": stats[1]}

    def state_dict(self) -> dict:
        with self._lock:
            return {"mode": self.mode, "count": self.count, "mean": self.mean, "m2": self.m2, "batch": self.batch_stats}

    def load_state_dict(self, state: dict) -> None:
        if state["mode"] != self.mode:
            raise ValueError(
                f"the checkpoint's reward statistics are for reward.model.normalize={state['mode']}, "
                f"this run's is {self.mode}"
            )
        with self._lock:
            self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])
            self.batch_stats = tuple(state["batch"]) if state["batch"] is not None else None


def _mean_std(values: np.ndarray) -> tuple[float, float]:
    return float(values.mean()), float(values.std())
