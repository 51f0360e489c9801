"""Policy-gradient losses as a registry, plus loss aggregation, entropy and the value loss.

A policy loss maps per-token log-probs (with gradient) to one scalar:

    fn(log_prob, old_log_prob, advantages, response_mask, cfg: PolicyLossConfig,
       loss_agg_mode, global_denominator, weights) -> (loss, metrics)

`weights` is an optional per-token multiplier applied, detached, to the per-token loss before
aggregation (the rollout/training mismatch correction of megarl/algo/corrections.py). metrics are
detached scalars: pg_loss, pg_clipfrac (fraction of response tokens whose clipped branch is
active), ppo_kl (mean old - new log-prob), and what a loss adds. Register a new loss with
`@register_policy_loss("name")` and add the name to `actor.policy_loss`'s Literal in the schema;
tests/algo/test_policy_losses.py runs its contract over every registered entry.

  vanilla  PPO clip, max(-A*r, -A*clip(r, 1-low, 1+high)), r = exp(logp - old_logp); asymmetric
           bounds are DAPO's clip-higher. Dual-clip (Ye et al. 2020, `clip_ratio_c` > 1): for
           A < 0 the per-token loss is further bounded by -A*clip_ratio_c, so a huge ratio on a
           bad token cannot blow up the update.
  gspo     GSPO (Zheng et al. 2025): the sequence ratio s_i = exp(mean_t(logp - old_logp)) over
           the response, clipped to [1 - gspo_low, 1 + gspo_high] (tiny ranges: 3e-4 / 4e-4), in
           the paper's token form r_t = sg(s_i) * exp(logp_t - sg(logp_t)): the value is s_i at
           every token, d r_t / d logp_t = s_i. With seq-mean-token-mean aggregation (the
           paper's) the gradient equals sequence-level GSPO's.
  cispo    CISPO (MiniMax-M1): -sg(clip(r, 1-cispo_low, 1+cispo_high)) * A * logp. The weight is
           clipped, never the token: every token keeps its gradient. cispo_low = 1 (the default)
           means no lower bound, as in the paper, which tuned only the upper one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

# exp() of a log-ratio above ~88 overflows float32; a ratio of e^20 is already fully clipped.
_MAX_LOG_RATIO = 20.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where mask is 1 (0 if the mask is empty, instead of NaN)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def agg_loss(
    values: torch.Tensor, mask: torch.Tensor, mode: str, global_denominator: float | torch.Tensor | None = None
) -> torch.Tensor:
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


@dataclass(frozen=True)
class PolicyLossConfig:
    """The options every registered loss reads (each reads its own; see the module docstring)."""

    clip_ratio_low: float = 0.2  # vanilla: r clipped to [1 - low, 1 + high]
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = None  # vanilla: dual-clip bound (> 1) for A < 0; None = off
    gspo_clip_ratio_low: float = 3e-4  # gspo: s_i clipped to [1 - low, 1 + high]
    gspo_clip_ratio_high: float = 4e-4
    cispo_clip_ratio_low: float = 1.0  # cispo: weight clipped to [1 - low, 1 + high]
    cispo_clip_ratio_high: float = 0.28


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: make `fn` selectable as actor.policy_loss=name."""

    def wrap(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered ({POLICY_LOSSES[name].__name__})")
        POLICY_LOSSES[name] = fn
        return fn

    return wrap


def get_policy_loss(name: str) -> PolicyLossFn:
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy loss {name!r} is not registered; known: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def _check_shapes(log_prob, old_log_prob, advantages, response_mask, weights) -> None:
    shapes = [log_prob.shape, old_log_prob.shape, advantages.shape, response_mask.shape]
    if weights is not None:
        shapes.append(weights.shape)
    if any(s != shapes[0] for s in shapes):
        raise ValueError(
            "log_prob, old_log_prob, advantages and response_mask (and weights) must "
            f"share a shape; got {[tuple(s) for s in shapes]}"
        )


def _finish(
    per_token: torch.Tensor,
    clipped_mask: torch.Tensor,
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    global_denominator,
    weights,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weight (detached), aggregate, and the metrics every loss reports."""
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = agg_loss(per_token, response_mask, loss_agg_mode, global_denominator)
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": masked_mean(clipped_mask.to(per_token.dtype), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return loss, metrics


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: PolicyLossConfig = PolicyLossConfig(),
    loss_agg_mode: str = "token-mean",
    global_denominator: float | torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clip, asymmetric bounds, optional dual-clip; adds pg_clipfrac_lower when dual-clip is on
    (fraction of response tokens where the -A*clip_ratio_c bound is the active one)."""
    _check_shapes(log_prob, old_log_prob, advantages, response_mask, weights)
    log_ratio = (log_prob - old_log_prob).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    lower = None
    if cfg.clip_ratio_c is not None:
        bound = -advantages * cfg.clip_ratio_c
        negative = advantages < 0
        lower = negative & (per_token > bound)
        per_token = torch.where(negative, torch.minimum(per_token, bound), per_token)
    loss, metrics = _finish(
        per_token, clipped > unclipped, log_ratio, response_mask, loss_agg_mode, global_denominator, weights
    )
    if lower is not None:
        metrics["pg_clipfrac_lower"] = masked_mean(lower.to(per_token.dtype), response_mask).detach()
    return loss, metrics


@register_policy_loss("gspo")
def gspo_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: PolicyLossConfig = PolicyLossConfig(),
    loss_agg_mode: str = "token-mean",
    global_denominator: float | torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's sequence-level ratio in token form; pg_clipfrac counts tokens of clipped sequences."""
    _check_shapes(log_prob, old_log_prob, advantages, response_mask, weights)
    mask = response_mask.to(log_prob.dtype)
    token_log_ratio = log_prob - old_log_prob
    seq_log_ratio = ((token_log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).detach()
    seq_log_ratio = seq_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).unsqueeze(-1)
    # value exp(seq_log_ratio) at every token; gradient s_i with respect to each token's log-prob
    ratio = torch.exp(seq_log_ratio + (log_prob - log_prob.detach()))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.gspo_clip_ratio_low, 1.0 + cfg.gspo_clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    log_ratio = token_log_ratio.detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return _finish(per_token, clipped > unclipped, log_ratio, response_mask, loss_agg_mode, global_denominator, weights)


@register_policy_loss("cispo")
def cispo_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: PolicyLossConfig = PolicyLossConfig(),
    loss_agg_mode: str = "token-mean",
    global_denominator: float | torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO; pg_clipfrac counts tokens whose importance weight was clipped (either bound)."""
    _check_shapes(log_prob, old_log_prob, advantages, response_mask, weights)
    log_ratio = (log_prob - old_log_prob).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - cfg.cispo_clip_ratio_low, 1.0 + cfg.cispo_clip_ratio_high
    is_weight = torch.clamp(ratio, low, high)
    per_token = -advantages * is_weight * log_prob
    return _finish(
        per_token, (ratio < low) | (ratio > high), log_ratio, response_mask, loss_agg_mode, global_denominator, weights
    )


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    global_denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The vanilla clipped surrogate with its bounds as arguments (for callers outside the actor)."""
    return vanilla_policy_loss(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        PolicyLossConfig(clip_ratio_low, clip_ratio_high),
        loss_agg_mode,
        global_denominator,
    )


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits) over the last dim, computed stably."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def entropy_loss(
    logits: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    global_denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregated entropy of the response tokens (subtract coeff * this to encourage exploration)."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode, global_denominator)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss: 1/2 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2).

    The clipped branch keeps one update from moving the value estimate more than `cliprange_value`
    from the estimate the batch was collected with. Returns (loss, metrics): vf_clipfrac (fraction
    of response tokens where the clipped branch is the larger) and vpred_mean.
    """
    if not (values.shape == old_values.shape == returns.shape == response_mask.shape):
        raise ValueError(
            "values, old_values, returns and response_mask must share a shape; got "
            f"{tuple(values.shape)}, {tuple(old_values.shape)}, "
            f"{tuple(returns.shape)}, {tuple(response_mask.shape)}"
        )
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
