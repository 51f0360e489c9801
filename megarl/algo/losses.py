"""Policy-gradient loss pieces: loss aggregation, the clipped PPO/GRPO surrogate, entropy."""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

# exp() of a log-ratio above ~88 overflows float32; a ratio of e^20 is already fully clipped.
_MAX_LOG_RATIO = 20.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where mask is 1 (0 if the mask is empty, instead of NaN)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def agg_loss(values: torch.Tensor, mask: torch.Tensor, mode: str,
             global_denominator: float | torch.Tensor | None = None) -> torch.Tensor:
    """Reduce a (batch, response_len) per-token loss to a scalar.

    token-mean:          sum(values*mask) / sum(mask)           (every token weighs the same)
    seq-mean-token-sum:  mean over rows of sum(values*mask)     (every sequence weighs the same)
    seq-mean-token-mean: mean over rows of row-wise token means
    global_denominator replaces the local count (tokens for token-mean, rows otherwise) so that
    micro-batches and data-parallel ranks can sum their losses into the global mean.
    """
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        denom = mask.sum().clamp(min=1.0) if global_denominator is None else global_denominator
        return (values * mask).sum() / denom
    if mode == "seq-mean-token-sum":
        per_row = (values * mask).sum(dim=-1)
    elif mode == "seq-mean-token-mean":
        per_row = (values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    else:
        raise ValueError(f"loss_agg_mode={mode!r} is not one of {LOSS_AGG_MODES}")
    denom = max(per_row.shape[0], 1) if global_denominator is None else global_denominator
    return per_row.sum() / denom


def policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, clip_ratio_low: float = 0.2,
                clip_ratio_high: float = 0.2, loss_agg_mode: str = "token-mean",
                global_denominator: float | torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate: max(-A*r, -A*clip(r, 1-low, 1+high)) with r = exp(log_prob - old).

    Returns (loss, metrics); metrics are detached scalars: pg_loss, pg_clipfrac (fraction of
    response tokens where the clipped branch is active), ppo_kl (mean old - new log-prob).
    """
    if not (log_prob.shape == old_log_prob.shape == advantages.shape == response_mask.shape):
        raise ValueError("log_prob, old_log_prob, advantages and response_mask must share a shape; got "
                         f"{tuple(log_prob.shape)}, {tuple(old_log_prob.shape)}, "
                         f"{tuple(advantages.shape)}, {tuple(response_mask.shape)}")
    log_ratio = (log_prob - old_log_prob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = agg_loss(per_token, response_mask, loss_agg_mode, global_denominator)
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": masked_mean((clipped > unclipped).to(per_token.dtype), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits) over the last dim, computed stably."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str,
                 global_denominator: float | torch.Tensor | None = None) -> torch.Tensor:
    """Aggregated entropy of the response tokens (subtract coeff * this to encourage exploration)."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode, global_denominator)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               response_mask: torch.Tensor, cliprange_value: float, loss_agg_mode: str = "token-mean",
               global_denominator: float | torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss: 1/2 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2).

    The clipped branch keeps one update from moving the value estimate more than `cliprange_value`
    from the estimate the batch was collected with. Returns (loss, metrics): vf_clipfrac (fraction
    of response tokens where the clipped branch is the larger) and vpred_mean.
    """
    if not (values.shape == old_values.shape == returns.shape == response_mask.shape):
        raise ValueError("values, old_values, returns and response_mask must share a shape; got "
                         f"{tuple(values.shape)}, {tuple(old_values.shape)}, "
                         f"{tuple(returns.shape)}, {tuple(response_mask.shape)}")
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    loss = agg_loss(per_token, response_mask, loss_agg_mode, global_denominator)
    metrics = {
        "vf_clipfrac": masked_mean((clipped_loss > unclipped_loss).to(values.dtype), response_mask).detach(),
        "vpred_mean": masked_mean(values.detach(), response_mask),
    }
    return loss, metrics
