"""KL estimators between the policy and the reference policy, per token.

All take log-probs of the sampled tokens, so they are single-sample Monte-Carlo estimators of
KL(policy || ref) (Schulman, "Approximating KL divergence"):
  k1          log p - log q                       unbiased, high variance, can be negative
  k2          0.5 * (log p - log q)^2             biased, low variance, >= 0
  k3          q/p - log(q/p) - 1                  unbiased, low variance, >= 0
  low_var_kl  k3 with the log-ratio and the result clamped, robust to rare huge ratios
"""

from __future__ import annotations

import torch

from megarl.algo.losses import agg_loss

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")

_LOG_RATIO_CLAMP = 20.0   # keep exp() finite in float32
_LOW_VAR_KL_CLAMP = 10.0  # a single token should not dominate the penalty


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate; `kind` is one of KL_KINDS."""
    if kind == "k1":
        return log_prob - ref_log_prob
    if kind == "k2":
        return 0.5 * (log_prob - ref_log_prob).square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = ref_log_prob - log_prob  # log(q/p)
        if kind == "low_var_kl":
            log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        kl = torch.exp(log_ratio) - log_ratio - 1.0
        if kind == "low_var_kl":
            kl = kl.clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)
        return kl
    raise ValueError(f"kl kind {kind!r} is not one of {KL_KINDS}")


def kl_loss(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor,
            kind: str, loss_agg_mode: str = "token-mean",
            global_denominator: float | torch.Tensor | None = None) -> torch.Tensor:
    """KL penalty aggregated over response tokens like the policy loss (add coef * this)."""
    return agg_loss(kl_penalty(log_prob, ref_log_prob, kind), response_mask, loss_agg_mode,
                    global_denominator)
