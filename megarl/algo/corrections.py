"""Corrections for the mismatch between the rollout engine and the trainer.

The rollout engine (SGLang or the embedded server) samples with its own kernels, and for MoE
models possibly other experts, so its log-probs of the sampled tokens (`rollout_log_probs`) are
not the trainer's (`old_log_probs`) even with the same weights. The policy gradient is taken
under the trainer's policy, so the samples are off-policy by that ratio. Truncated importance
sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training") reweights each token's loss by the ratio, truncated at `threshold` to bound variance:

  token     w_t = min(exp(old_logp_t - rollout_logp_t), threshold)
  sequence  w_i = min(exp(sum_t (old_logp_t - rollout_logp_t)), threshold), the same at every
            token of the row

The weights are constants to the loss (detached). mismatch_metrics is what to log whether or not
the correction is on. parity_stats measures the same disagreement as the weight sync's check (the
two agree to ~1e-6 with the same weights and fp32 on both sides: trainer/parity.py).
"""

from __future__ import annotations

import math

import torch

from megarl.algo.losses import masked_mean

ROLLOUT_IS_LEVELS = ("token", "sequence")


def mismatch_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """rollout/mismatch_kl: mean over response tokens of rollout_logp - old_logp, the k1 estimate
    of KL(rollout || trainer) on tokens the rollout engine sampled (0 when the engines agree)."""
    return {"rollout/mismatch_kl": masked_mean(rollout_log_prob - old_log_prob, response_mask).detach()}


def version_span_metrics(versions: torch.Tensor, response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """rollout/version_span_mean: mean over rows of (newest - oldest) weight version among a row's
    response tokens (`versions` per token, -1 unknown: left out). 0 when every row came from one
    version; a fully_async row whose generation a weight update interrupted spans 1 or more."""
    known = (response_mask > 0) & (versions >= 0)
    high = torch.where(known, versions, torch.full_like(versions, -1)).amax(dim=1)
    low = torch.where(known, versions, torch.full_like(versions, 2**62)).amin(dim=1)
    span = torch.where(known.any(dim=1), high - low, torch.zeros_like(high)).to(torch.float64)
    return {"rollout/version_span_mean": span.mean() if len(span) else torch.zeros((), dtype=torch.float64)}


def rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    threshold: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights (batch, response_len), detached, zero off the response.

    Metrics: rollout_is/mean, rollout_is/clipfrac (fraction truncated) and rollout_is/spread (mean
    |w - 1|: the mean is ~1 by construction under the behaviour policy, the spread is not) over
    response tokens (token level) or over rows with a response (sequence level).
    """
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is level {level!r} is not one of {ROLLOUT_IS_LEVELS}")
    if threshold <= 0:
        raise ValueError(f"rollout_is threshold={threshold} must be > 0")
    mask = response_mask.to(old_log_prob.dtype)
    log_ratio = (old_log_prob - rollout_log_prob).detach() * mask
    log_threshold = math.log(threshold)
    if level == "token":
        log_w = log_ratio
        unit_mask = mask
    else:
        log_w = log_ratio.sum(-1, keepdim=True)
        unit_mask = (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)
    # exp(min(log w, log threshold)) = min(w, threshold), without overflowing exp first
    truncated = log_w > log_threshold
    w = torch.exp(log_w.clamp(max=log_threshold))
    metrics = {
        "rollout_is/mean": masked_mean(w, unit_mask),
        "rollout_is/clipfrac": masked_mean(truncated.to(w.dtype), unit_mask),
        # how far off-policy: 0 where the engine sampled with the trainer's weights
        "rollout_is/spread": masked_mean((w - 1).abs(), unit_mask),
    }
    return (w * mask).detach(), metrics


def parity_stats(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, atol: float) -> dict:
    """Sums over response tokens of |trainer - rollout| log-probs ([B, R] each): the pieces that
    add up across ranks (merge_parity_stats) before trainer/parity.py judges them. A non-finite
    log-prob on either side is a difference of inf (off, and the worst): never a silent pass."""
    mask = mask.bool()
    per_token = (trainer - rollout.to(trainer.dtype)).abs()
    per_token = torch.where(per_token.isfinite(), per_token, torch.inf)
    per_token = torch.where(mask, per_token, 0.0)  # padding holds anything, NaN included
    diff = per_token[mask]
    return {
        "diff_max": float(diff.max()) if diff.numel() else 0.0,
        "diff_sum": float(diff.sum()),
        "tokens": float(diff.numel()),
        "rows_off": float((per_token > atol).any(1).sum()),
        "rows": float(len(trainer)),
        "nonfinite": float(diff.isinf().sum()),
    }


def merge_parity_stats(parts: list[dict]) -> dict:
    out = {k: sum(p.get(k, 0.0) for p in parts) for k in ("diff_sum", "tokens", "rows_off", "rows", "nonfinite")}
    out["diff_max"] = max((p["diff_max"] for p in parts), default=0.0)
    return out
