"""KL estimators between the policy and the reference policy, per token.

All take log-probs of the sampled tokens, so they are single-sample Monte-Carlo estimators of
KL(policy || ref) (Schulman, "Approximating KL divergence"):
  k1          log p - log q                       unbiased, high variance, can be negative
  k2          0.5 * (log p - log q)^2             biased, low variance, >= 0
  k3          q/p - log(q/p) - 1                  unbiased, low variance, >= 0
  low_var_kl  k3 with the log-ratio and the result clamped, robust to rare huge ratios

Two ways to use them: as a loss term (kl_loss, actor.use_kl_loss), or subtracted from the reward
before advantages (apply_kl_penalty, algorithm.use_kl_in_reward) with a coefficient that a
controller keeps fixed or adapts towards a target KL (Ziegler et al. 2019, "Fine-tuning language
models from human preferences", as verl and trl do).
"""

from __future__ import annotations

import torch

from megarl.algo.losses import agg_loss

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
KL_CONTROLLERS = ("fixed", "adaptive")

_LOG_RATIO_CLAMP = 20.0  # keep exp() finite in float32
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


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str,
    loss_agg_mode: str = "token-mean",
    global_denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """KL penalty aggregated over response tokens like the policy loss (add coef * this)."""
    return agg_loss(kl_penalty(log_prob, ref_log_prob, kind), response_mask, loss_agg_mode, global_denominator)


class FixedKLController:
    """A constant KL-in-reward coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


class AdaptiveKLController:
    """Ziegler et al.'s proportional controller: after each batch of n_steps samples,
    value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon,
    so the coefficient grows while the KL is above target and shrinks while it is below, by at
    most 20% of n_steps / horizon per update."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs target_kl > 0 and horizon > 0, got "
                f"target_kl={target_kl}, horizon={horizon}"
            )
        self.value = init_kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


def make_kl_controller(
    kind: str,
    kl_coef: float,
    target_kl: float,
    horizon: int,
) -> FixedKLController | AdaptiveKLController:
    """The controller of algorithm.kl_ctrl (type, kl_coef, target_kl, horizon)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"kl controller {kind!r} is not one of {KL_CONTROLLERS}")


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-row scores (batch,) placed on each row's last response token (batch, response_len);
    rows without a response get nothing."""
    mask = response_mask.to(torch.long)
    out = torch.zeros(
        mask.shape, dtype=scores.dtype if scores.is_floating_point() else torch.float32, device=scores.device
    )
    lengths = mask.sum(-1)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    # the last response token: the highest position where the mask is 1
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = (positions * mask).argmax(-1)
    out[rows, last[rows]] = scores[rows].to(out.dtype)
    return out


def apply_kl_penalty(
    token_rewards: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    kind: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """token_rewards - coef * KL(old || ref) per response token (zero elsewhere).

    Returns (rewards, metrics): kl_reward/kl is the batch mean of each row's mean per-token KL,
    the value to feed the controller's update; kl_reward/coef the coefficient used.
    """
    if not (token_rewards.shape == old_log_prob.shape == ref_log_prob.shape == response_mask.shape):
        raise ValueError(
            "token_rewards, old_log_prob, ref_log_prob and response_mask must share a "
            f"shape; got {tuple(token_rewards.shape)}, {tuple(old_log_prob.shape)}, "
            f"{tuple(ref_log_prob.shape)}, {tuple(response_mask.shape)}"
        )
    mask = response_mask.to(token_rewards.dtype)
    kl = kl_penalty(old_log_prob, ref_log_prob, kind) * mask
    rewards = token_rewards - coef * kl
    per_row = kl.sum(-1) / mask.sum(-1).clamp(min=1.0)
    has_response = mask.sum(-1) > 0
    current = float(per_row[has_response].mean()) if bool(has_response.any()) else 0.0
    return rewards, {"kl_reward/kl": current, "kl_reward/coef": float(coef)}
