"""Sequence-level losses: objectives of each row's whole-response log-ratio to a reference model.

A sequence loss sees, per row, the log-ratio of the response under the trained model to a
reference model

    log_ratio_i = sum_t mask_it * (log pi(y_it) - log pi_ref(y_it))        (float64, with gradient)

and the row's own columns (targets, labels, group ids), as keywords with the config as `cfg`; it
returns (loss summed over its units,
number of units, metrics). Megatron sums the micro-batches' losses and units over data-parallel
ranks and divides: the optimiser steps on the mean over units.

    spin      SPIN (Chen et al. 2024, arXiv 2401.01335): rows of one prompt are one ground-truth
              response (`chosen` = 1) and the model's own samples; every (chosen, sample) pair adds
              softplus(-beta * (log_ratio_chosen - log_ratio_sample)), the logistic loss against
              the previous round's model. Units: pairs. Couples the rows of a group (`coupled`).
    sppo      SPPO (Wu et al. 2024, arXiv 2405.00675): (log_ratio_i - target_i)^2 per row, the
              target eta * (P(y_i beats the policy) - 1/2) (the sppo estimator's advantages,
              algo/self_play.py), the reference the previous iterate. Units: rows.
    prime_ce  PRIME's implicit PRM (Cui et al. 2025, arXiv 2502.01456): the outcome label's
              cross-entropy with the sequence's implicit reward beta * log_ratio as the logit.
              Units: rows.

Register a new loss with `@register_sequence_loss(name, columns=..., coupled=...)`; a coupled loss
is trained through `row_weights` (its gradient with respect to each row's log-ratio at the current
weights, taken on a forward pass before the mini-batch's, engine/megatron/actor.py), so its rows
may land in any micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SequenceLossConfig:
    spin_beta: float = 0.1  # SPIN: the logistic loss's scale (the paper's lambda)
    prm_beta: float = 0.05  # PRIME: the implicit reward's scale (beta)


@dataclass(frozen=True)
class SequenceLoss:
    name: str
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor, dict[str, float]]]
    columns: tuple[str, ...]  # per-row tensors it reads besides the log-ratio
    coupled: bool  # a row's loss depends on other rows (of its group)


SEQUENCE_LOSSES: dict[str, SequenceLoss] = {}


def register_sequence_loss(name: str, columns: tuple[str, ...] = (), coupled: bool = False) -> Callable:
    def add(fn: Callable) -> Callable:
        if name in SEQUENCE_LOSSES:
            raise ValueError(f"sequence loss {name!r} is already registered")
        SEQUENCE_LOSSES[name] = SequenceLoss(name, fn, tuple(columns), coupled)
        return fn

    return add


def get_sequence_loss(name: str) -> SequenceLoss:
    if name not in SEQUENCE_LOSSES:
        raise ValueError(f"sequence loss {name!r} is not registered; known: {sorted(SEQUENCE_LOSSES)}")
    return SEQUENCE_LOSSES[name]


def sequence_log_ratio(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sum over each row's response tokens of log_prob - ref_log_prob, in float64."""
    mask = response_mask.to(torch.float64)
    return ((log_prob.to(torch.float64) - ref_log_prob.to(torch.float64)) * mask).sum(-1)


def row_value(per_token: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) a per-row value broadcast over the response (an estimator's output): its masked mean."""
    mask = response_mask.to(torch.float64)
    return (per_token.to(torch.float64) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def _pairs(group_index: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen row, sample row) index pairs: each group's chosen row against every other row of it."""
    chosen_rows = torch.nonzero(chosen > 0).flatten()
    samples = torch.nonzero(chosen <= 0).flatten()
    by_group = {int(group_index[c]): int(c) for c in chosen_rows}
    if len(by_group) != len(chosen_rows):
        raise ValueError("spin: a group has more than one chosen (ground-truth) row")
    missing = sorted({int(group_index[s]) for s in samples} - set(by_group))
    if missing:
        raise ValueError(f"spin: groups {missing[:5]} have samples but no chosen row in this mini-batch")
    first = torch.tensor([by_group[int(group_index[s])] for s in samples], dtype=torch.long)
    return first, samples


@register_sequence_loss("spin", columns=("group_index", "chosen"), coupled=True)
def spin_loss(log_ratio: torch.Tensor, group_index: torch.Tensor, chosen: torch.Tensor, cfg: SequenceLossConfig):
    c, s = _pairs(group_index, chosen)
    margin = log_ratio[c] - log_ratio[s]
    loss = F.softplus(-cfg.spin_beta * margin).sum()
    n = max(len(s), 1)
    metrics = {
        "spin/margin": float(margin.detach().sum()) / n,
        "spin/chosen_log_ratio": float(log_ratio.detach()[chosen > 0].mean()) if (chosen > 0).any() else 0.0,
        "spin/rejected_log_ratio": float(log_ratio.detach()[s].mean()) if len(s) else 0.0,
        "spin/pair_accuracy": float((margin.detach() > 0).double().sum()) / n,
    }
    return loss, torch.tensor(float(len(s))), metrics


@register_sequence_loss("sppo", columns=("advantages", "response_mask"))
def sppo_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, cfg: SequenceLossConfig):
    """The target of each row: its advantages' value, eta * (P_hat - 1/2) (the sppo estimator)."""
    targets = row_value(advantages, response_mask)
    err = log_ratio - targets
    metrics = {
        "sppo/log_ratio": float(log_ratio.detach().mean()),
        # the targets average 0 over a prompt's samples; their size is the win rates' spread
        "sppo/target_abs": float(targets.abs().mean()),
        "sppo/abs_error": float(err.detach().abs().mean()),
    }
    return (err * err).sum(), torch.tensor(float(len(log_ratio))), metrics


@register_sequence_loss("prime_ce", columns=("prm_labels",))
def prime_ce_loss(log_ratio: torch.Tensor, prm_labels: torch.Tensor, cfg: SequenceLossConfig):
    """Binary cross-entropy of the outcome labels (1 correct) with logits beta * log_ratio."""
    logits = cfg.prm_beta * log_ratio
    y = prm_labels.to(torch.float64)
    loss = F.binary_cross_entropy_with_logits(logits, y, reduction="sum")
    predicted = (logits.detach() > 0).to(torch.float64)
    metrics = {
        "prm/accuracy": float((predicted == y).double().mean()),
        "prm/implicit_reward": float(logits.detach().mean()),
    }
    return loss, torch.tensor(float(len(log_ratio))), metrics
