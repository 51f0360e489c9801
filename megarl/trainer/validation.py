"""Validation: every val prompt sampled trainer.val_n times, scored, summarised per data_source.

With k = trainer.val_n and a sample "solved" when its reward >= trainer.val_pass_threshold:

    val/reward_mean                  mean reward over every val sample of every source (with k = 1,
                                     the metric the reference curves and earlier runs log)
    val/<data_source>/reward_mean    mean reward over that source's samples
    val/<data_source>/mean@k         fraction of that source's samples solved: accuracy averaged
                                     over the k samples of each prompt (pass@1 estimated from k
                                     samples a prompt); equals reward_mean when rewards are 0/1
                                     and the threshold is 1
    val/<data_source>/pass@k         fraction of that source's prompts with at least one solved
                                     sample among its k

k appears as a number in the names (pass@4). Every prompt has exactly k samples, so pass@k is the
plain fraction (no unbiased n-choose-k estimator is needed). Several val files are one val set
whose rows keep their data_source; the val prompts are generated in one request batch, with
rollout.val_temperature (validate refuses val_n > 1 with greedy decoding: k identical samples).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from megarl.data.batch import Batch
from megarl.data.dataset import PromptBatches
from megarl.trainer import status


def validation_metrics(
    scores: Sequence[float] | torch.Tensor, uids: Sequence[str], data_sources: Sequence[str], k: int, threshold: float
) -> dict[str, float]:
    """The val/* metrics of scored samples: row i is a sample of prompt uids[i] from
    data_sources[i]; every prompt must have exactly k samples."""
    values = np.asarray(scores.tolist() if isinstance(scores, torch.Tensor) else scores, dtype=np.float64)
    if not (len(values) == len(uids) == len(data_sources)) or len(values) == 0:
        raise ValueError(
            f"validation got {len(values)} scores, {len(uids)} uids and "
            f"{len(data_sources)} data sources; expected the same number > 0"
        )
    groups: dict[str, list[int]] = {}
    for i, uid in enumerate(uids):
        groups.setdefault(str(uid), []).append(i)
    wrong = {uid: len(rows) for uid, rows in groups.items() if len(rows) != k}
    if wrong:
        raise ValueError(
            f"validation expects {k} samples per prompt (trainer.val_n); got {dict(list(wrong.items())[:3])}"
        )
    solved = values >= threshold
    out = {"val/reward_mean": float(values.mean())}
    for source in sorted(set(map(str, data_sources))):
        rows = np.array([str(s) == source for s in data_sources])
        prompts = [idx for idx in groups.values() if rows[idx[0]]]
        out[f"val/{source}/reward_mean"] = float(values[rows].mean())
        out[f"val/{source}/mean@{k}"] = float(solved[rows].mean())
        out[f"val/{source}/pass@{k}"] = float(np.mean([solved[idx].any() for idx in prompts]))
    return out


def run_validation(
    val_data, generate: Callable[[Batch], Batch], score: Callable[[Batch], torch.Tensor], k: int, threshold: float
) -> dict[str, float]:
    """Generate k samples for every prompt of `val_data` (one batch, in file order), score them
    and summarise. `generate(prompts)` returns the rows prompt-major with the prompts' columns
    (RolloutManager.generate with n = k); `score(rows)` one reward per row."""
    prompts = PromptBatches(val_data, len(val_data), shuffle=False).batch_at(0)
    with status.phase("validation"):
        rows = generate(prompts)
        if len(rows) != k * len(prompts):
            raise ValueError(f"validation asked for {k} samples of {len(prompts)} prompts and got {len(rows)} rows")
        return validation_metrics(score(rows), rows["uid"], rows["data_source"], k, threshold)
