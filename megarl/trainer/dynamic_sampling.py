"""DAPO's dynamic sampling: train only on groups whose responses disagree.

A group (the rollout.n responses to one prompt) whose scores are all equal has zero advantage under
every group-relative estimator: it costs log-prob and update passes and teaches nothing. With
`algorithm.filter_groups.enable`, the trainer drops such groups and generates more prompts' groups
(the next batches of the data order) until it has data.train_batch_size informative groups, at
most `max_num_gen_batches` generation rounds per step (0: no bound), then trains on exactly that
many groups. A policy that solves nearly every prompt leaves few informative groups; when the
rounds run out the batch is topped up with uninformative groups (`on_exhausted: pad`, counted)
or the step fails (`error`). The groups are judged on the task's own score, before any shaping (the overlong
penalty varies with length, so it would make nearly every group look informative).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from megarl.data.batch import Batch


class FilterGroupsError(RuntimeError):
    """Too few informative groups within the allowed generation rounds."""


def informative_groups(scores: torch.Tensor, uids) -> np.ndarray:
    """Row mask: True for rows whose group's scores are not all equal."""
    uids = np.asarray(list(uids), dtype=object)
    keep = np.zeros(len(uids), dtype=bool)
    values = scores.detach().double().cpu().numpy()
    for uid in dict.fromkeys(uids):  # first-seen order
        rows = np.flatnonzero(uids == uid)
        keep[rows] = len(rows) > 1 and values[rows].max() > values[rows].min()
    return keep


def _concat(parts: list[Batch]) -> Batch:
    """Rows of several generation rounds: their token columns are right-padded with zeros (as the
    rollout pads them) to the widest round first; routed_experts [rows, T, ids] with -1 (no record)."""
    if len(parts) == 1:
        return parts[0]
    widths = {k: max(p.tensors[k].shape[1] for p in parts) for k, v in parts[0].tensors.items() if v.dim() >= 2}

    def pad(k: str, v: torch.Tensor) -> torch.Tensor:
        if k not in widths:
            return v
        return torch.nn.functional.pad(
            v.movedim(1, -1), (0, widths[k] - v.shape[1]), value=-1 if k == "routed_experts" else 0
        ).movedim(-1, 1)

    padded = []
    for part in parts:
        tensors = {k: pad(k, v) for k, v in part.tensors.items()}
        padded.append(Batch(tensors, part.non_tensors, part.meta))
    return Batch.concat(padded)


def fill_informative(
    generate: Callable[[int], Batch],
    groups_wanted: int,
    max_rounds: int,
    raw_key: str = "raw_scores",
    pad: bool = True,
    keep: Callable[[torch.Tensor, list], np.ndarray] = informative_groups,
) -> tuple[Batch, dict]:
    """Call generate(k) for rounds k = 0, 1, ... (each a scored batch of groups with `raw_key` and
    `uid`) until `groups_wanted` informative groups are in; the first `groups_wanted` of them, in
    order, are returned with the metrics. When max_rounds (> 0) do not suffice: with `pad`, the
    batch is topped up with uninformative groups (zero advantage: they add no gradient, the step
    keeps its shape; counted in rollout/groups_padded), else FilterGroupsError. `keep(scores,
    uids)`: the row mask of the groups to keep (default: groups whose scores differ; PRIME's
    accuracy band, trainer/prime.py)."""
    kept: list[Batch] = []
    spare: list[Batch] = []
    have = generated = 0
    k = 0
    while have < groups_wanted:
        if max_rounds and k >= max_rounds:
            if pad:
                break
            raise FilterGroupsError(
                f"dynamic sampling: {have} of the {groups_wanted} groups a step needs passed the group "
                f"filter (responses with different scores, or algorithm.prime.accuracy_band) after {k} "
                f"generation rounds ({generated} groups generated). Raise "
                "algorithm.filter_groups.max_num_gen_batches (0: no bound), or set "
                "algorithm.filter_groups.on_exhausted=pad"
            )
        rows = generate(k)
        uids = list(rows["uid"])
        generated += len(dict.fromkeys(uids))
        mask = keep(rows[raw_key], uids)
        if mask.any():
            part = rows[torch.from_numpy(np.flatnonzero(mask))]
            kept.append(part)
            have += len(dict.fromkeys(part["uid"]))
        if pad and not mask.all():
            spare.append(rows[torch.from_numpy(np.flatnonzero(~mask))])
        k += 1
    padded = max(0, groups_wanted - have)
    rows = _concat(kept + spare)  # informative groups first, then the spares in generation order
    uids = list(rows["uid"])
    chosen = set(list(dict.fromkeys(uids))[:groups_wanted])
    rows = rows[torch.tensor([i for i, u in enumerate(uids) if u in chosen])]
    return rows, {
        "rollout/gen_batches": float(k),
        "rollout/groups_generated": float(generated),
        "rollout/groups_kept_frac": have / max(generated, 1),
        "rollout/groups_padded": float(padded),
    }
