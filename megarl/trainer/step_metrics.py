"""One step's metrics assembled: stage timers, the ranks' metrics merged, the rows summarised."""

from __future__ import annotations

import time

import numpy as np

from megarl.algo.losses import masked_mean
from megarl.data.batch import Batch
from megarl.trainer import status


class timer:
    """Adds the seconds of its block to out["perf/<name>_s"] (a phase run several times in a step,
    as generation rounds are, adds up); on a terminal the status line names the phase meanwhile."""

    def __init__(self, out: dict, name: str):
        self.out, self.name = out, name

    def __enter__(self):
        self.phase = status.enter(self.name)
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        key = f"perf/{self.name}_s"
        self.out[key] = self.out.get(key, 0.0) + time.perf_counter() - self.t
        status.leave(self.phase)


def average(dicts: list[dict]) -> dict:
    """The ranks' metrics as one dict: perf/memory/* the largest rank's (the one that decides
    whether a layout fits), every other key the mean over the ranks that report it."""
    dicts = [d for d in dicts if d]
    keys = {k for d in dicts for k in d}
    return {
        k: (
            max(d[k] for d in dicts if k in d)
            if k.startswith("perf/memory/")
            else sum(d[k] for d in dicts if k in d) / sum(k in d for d in dicts)
        )
        for k in keys
    }


def rollout_metrics(rows: Batch, overlong_buffer: bool) -> dict:
    """The step's rows summarised: rewards, response lengths, entropy, advantages, KL to the reference."""
    mask = rows["response_mask"]
    lengths = mask.sum(-1)
    out = {
        "reward/mean": float(rows["scores"].mean()),
        "reward/max": float(rows["scores"].max()),
        "reward/min": float(rows["scores"].min()),
        "response/length_mean": float(lengths.mean()),
        "response/clip_ratio": float(np.mean(rows["finish_reason"] == "length")),
    }
    if "entropy" in rows:  # the old-log-prob pass's; else the update's first mini-batch's
        out["rollout/entropy"] = float(masked_mean(rows["entropy"], mask))
    if overlong_buffer:
        out["reward/raw_mean"] = float(rows["raw_scores"].mean())
        out["reward/overlong_penalized_frac"] = float((rows["scores"] < rows["raw_scores"]).float().mean())
    if "advantages" in rows:  # over response tokens: all zero means no gradient from the PG loss
        adv = rows["advantages"][mask.bool()]
        out.update({"adv/mean": float(adv.mean()), "adv/max": float(adv.max()), "adv/min": float(adv.min())})
    if "ref_log_probs" in rows:
        out["actor/kl"] = float(masked_mean(rows["old_log_probs"] - rows["ref_log_probs"], mask))
    return out
