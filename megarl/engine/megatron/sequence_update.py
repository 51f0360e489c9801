"""The actor's update under a sequence loss (algo/sequence_losses.py: spin, sppo; the PRM's prime_ce).

A row-wise sequence loss is computed in each micro-batch from the rows' log-ratios to the
reference. A coupled one (SPIN: a group's ground-truth row against its samples) cannot be: its
rows may fall into different micro-batches. For it every mini-batch first gets each row's weight

    w_i = d loss / d log_ratio_i      at the mini-batch's current weights

from a forward pass over the mini-batch (the first mini-batch of an update uses the step's old
log-probs, computed on those same weights), and the micro-batches then minimise
sum_i w_i * sum_t log pi(y_it): the same gradient, in any micro-batch split. A coupled loss's
groups stay whole: on one data-parallel rank (the trainer orders and balances groups) and in
one mini-batch (`group_mini_batches`).
"""

from __future__ import annotations

import torch

from megarl.algo.losses import masked_mean
from megarl.algo.sequence_losses import SequenceLoss, SequenceLossConfig, sequence_log_ratio
from megarl.data.batch import Batch

WEIGHTS = "sequence_weights"  # the column a coupled loss's row weights travel in


def columns_of(loss: SequenceLoss, mb: Batch) -> dict[str, torch.Tensor]:
    missing = [c for c in loss.columns if c not in mb]
    if missing:
        raise ValueError(f"sequence loss {loss.name!r} needs the columns {missing}, which the update batch lacks")
    return {c: mb[c] for c in loss.columns}


def micro_batch_loss(loss: SequenceLoss, cfg: SequenceLossConfig, log_prob, mb: Batch):
    """(loss summed over units, units, metrics) of one micro-batch (engine.LossFn's contract)."""
    mask = mb["response_mask"]
    if loss.coupled:  # the row weights of the mini-batch (with_row_weights); units: rows
        summed = (log_prob.to(torch.float64) * mask.to(torch.float64)).sum(-1)
        value = (mb[WEIGHTS].to(torch.float64) * summed).sum()
        return value.to(log_prob.dtype), torch.tensor(float(len(mb))), {}
    log_ratio = sequence_log_ratio(log_prob, mb["ref_log_probs"], mask)
    value, units, metrics = loss.fn(log_ratio, cfg=cfg, **columns_of(loss, mb))
    return value.to(log_prob.dtype), units, metrics


def row_weights(loss: SequenceLoss, cfg: SequenceLossConfig, log_prob, mini: Batch) -> tuple[torch.Tensor, dict]:
    """Each row's d loss / d log_ratio at `log_prob` (the current weights'), scaled by rows / units
    so that the micro-batches' row-counted mean is the loss's own mean over its units; and the
    loss's metrics (its value per unit as actor/pg_loss)."""
    log_ratio = sequence_log_ratio(log_prob, mini["ref_log_probs"], mini["response_mask"]).requires_grad_(True)
    value, units, metrics = loss.fn(log_ratio, cfg=cfg, **columns_of(loss, mini))
    (grad,) = torch.autograd.grad(value, log_ratio)
    n_units = max(float(units), 1.0)
    return (grad * len(mini) / n_units).to(torch.float32), {**metrics, "actor/pg_loss": float(value) / n_units}


def group_mini_batches(batch: Batch, n_mini: int, gen: torch.Generator) -> list[Batch]:
    """`batch`'s groups (`group_index`) in a random order, cut into `n_mini` mini-batches of whole
    groups (as even in groups as they divide)."""
    groups = list(dict.fromkeys(batch["group_index"].tolist()))
    order = [groups[i] for i in torch.randperm(len(groups), generator=gen).tolist()]
    rows_of: dict[int, list[int]] = {}
    for i, g in enumerate(batch["group_index"].tolist()):
        rows_of.setdefault(g, []).append(i)
    n_mini = max(1, min(n_mini, len(order)))
    bounds = [round(k * len(order) / n_mini) for k in range(n_mini + 1)]
    return [
        batch[torch.tensor([i for g in order[a:b] for i in rows_of[g]], dtype=torch.long)]
        for a, b in zip(bounds, bounds[1:])
    ]


def entropy_metric(entropy, mask) -> dict:
    return {"actor/entropy": float(masked_mean(entropy.detach(), mask))}
