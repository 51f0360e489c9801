"""Advantage estimators: pure tensor functions on per-row scores and response masks.

GRPO (group relative policy optimisation) scores every response against the other responses
to the same prompt: advantage = (score - group mean) / (group std + eps). Rows are grouped by
`group_ids` (the per-prompt `uid` that the dataset assigns and `repeat_interleave` copies), so
the function needs no assumption about row order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def _group_index(group_ids: Sequence | np.ndarray, num_rows: int) -> torch.Tensor:
    """Map arbitrary hashable group ids to dense integers 0..G-1 (row order preserved)."""
    ids = list(group_ids)
    if len(ids) != num_rows:
        raise ValueError(f"group_ids has {len(ids)} entries but there are {num_rows} rows; "
                         "pass one uid per row (repeat_interleave the prompt uids)")
    dense: dict = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in ids], dtype=torch.long)


def row_scores(rewards: torch.Tensor, response_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row scalar score: rewards as given if 1-D, else the masked sum over response tokens."""
    if rewards.dim() == 1:
        return rewards
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (batch,) or (batch, response_len), got {tuple(rewards.shape)}")
    mask = torch.ones_like(rewards) if response_mask is None else response_mask.to(rewards.dtype)
    return (rewards * mask).sum(dim=-1)


def group_normalized_scores(scores: torch.Tensor, group_ids: Sequence | np.ndarray,
                            norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """(score - group mean) [/ (group std + eps)] per row; rows alone in their group get 0.

    The std is the unbiased (Bessel-corrected) sample std, the usual GRPO choice. A group whose
    scores are all equal has std 0 and therefore advantage 0: it carries no learning signal.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (one per row), got shape {tuple(scores.shape)}")
    index = _group_index(group_ids, scores.shape[0]).to(scores.device)
    num_groups = int(index.max()) + 1 if index.numel() else 0
    values = scores.detach().to(torch.float64)
    counts = torch.zeros(num_groups, dtype=torch.float64, device=scores.device).index_add_(
        0, index, torch.ones_like(values))
    sums = torch.zeros_like(counts).index_add_(0, index, values)
    means = sums / counts
    centered = values - means[index]
    sq = torch.zeros_like(counts).index_add_(0, index, centered * centered)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    adv = centered / (std[index] + eps) if norm_by_std else centered
    adv = torch.where(counts[index] > 1, adv, torch.zeros_like(adv))
    return adv.to(scores.dtype if scores.is_floating_point() else torch.float32)


def grpo_advantages(rewards: torch.Tensor, response_mask: torch.Tensor,
                    group_ids: Sequence | np.ndarray, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages broadcast over response tokens, zero where response_mask is 0.

    rewards: (batch,) per-row scores or (batch, response_len) token-level rewards (summed).
    Returns a (batch, response_len) float tensor; the same tensor serves as returns.
    """
    if response_mask.dim() != 2 or response_mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"response_mask must be (batch, response_len) with batch={rewards.shape[0]}, "
                         f"got {tuple(response_mask.shape)}")
    scores = row_scores(rewards.float(), response_mask)
    adv = group_normalized_scores(scores, group_ids, norm_by_std=norm_by_std, eps=eps)
    return adv.unsqueeze(-1) * response_mask.to(adv.dtype)
