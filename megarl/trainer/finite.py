"""Nothing non-finite passes: the loop's guard on what a step computed, before the weights move.

    check_rows(rows, ROLLOUT_AND_OLD, "old/ref log-probs and values", step, version)   after those passes
    check_rows(rows, ADVANTAGES, "advantages", step, version)                           after the estimator
    check_ranks(per_rank, "actor update", step, version)                                after the update

A NaN or infinite value on a response token (padding may hold anything), or in a rank's loss or
gradient norm, raises NonFiniteError with one line: what went non-finite, where (the stage, the
row or the rank), the step and the weight version. The policy is to stop: the error comes before
the sync, so the engines keep the last good weights, and before any save, so the last checkpoint
is the way back (trainer.resume=auto). A non-finite update has already been applied on the ranks
that computed it, so skipping the batch there would train on from corrupted weights.
"""

from __future__ import annotations

import math

from megarl.data.batch import Batch

ROLLOUT_AND_OLD = ("rollout_log_probs", "old_log_probs", "ref_log_probs", "values")
ADVANTAGES = ("advantages", "returns")
WHAT = {
    "rollout_log_probs": "the rollout engine's log-probs",
    "old_log_probs": "the old log-probs",
    "ref_log_probs": "the reference's log-probs",
    "values": "the critic's values",
    "advantages": "the advantages",
    "returns": "the returns",
}


class NonFiniteError(RuntimeError):
    """A value the step computed is NaN or infinite; the step stops before the weights move."""


def check_rows(rows: Batch, keys: tuple[str, ...], stage: str, step: int, version: int) -> None:
    """Every response token of `keys` (those the rows have) is finite."""
    mask = rows["response_mask"].bool()
    for key in keys:
        if key not in rows:
            continue
        values = rows[key]  # [B, R], as the mask
        bad = ~values.isfinite() & mask
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            served = rows["rollout_weight_version"][row] if "rollout_weight_version" in rows.non_tensors else None
            raise NonFiniteError(
                f"step {step}, weight version {version}: {WHAT.get(key, key)} ({key}, {stage}) are "
                f"non-finite at {int(bad.sum())} response tokens in {int(bad.any(1).sum())} rows; first: "
                f"row {row} ({values[row][bad[row]][0].item()}), served with weight_version {served!r}"
            )


def check_ranks(per_rank: list[dict], stage: str, step: int, version: int) -> None:
    """Every rank's losses and gradient norms (keys ending in `loss` or `grad_norm`) are finite.
    Losses are looked at first, on every rank: a NaN loss makes every rank's gradient NaN (the
    gradients are all-reduced), and the rank whose loss it was is the one to name."""
    for suffix in ("loss", "grad_norm"):
        for rank, metrics in enumerate(per_rank):
            for key, value in sorted((metrics or {}).items()):
                if key.endswith(suffix) and not math.isfinite(value):
                    raise NonFiniteError(
                        f"step {step}, weight version {version}: {key} is {value} on rank {rank} ({stage}); "
                        "the update is not synced to the engines; the last checkpoint is the way back"
                    )
