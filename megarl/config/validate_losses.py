"""Validation of the policy loss, the rollout-mismatch correction and KL in the reward."""

from __future__ import annotations

from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def check_losses(cfg: RunConfig) -> None:
    a = cfg.actor
    c = a.clip_ratio_c
    _require(
        c is None or c > 1,
        "actor.clip_ratio_c",
        f"actor.clip_ratio_c={c} must be > 1 (dual-clip bounds the loss of a negative-advantage "
        "token at -A * clip_ratio_c; 3 is usual), or null (off)",
    )
    for name in ("gspo", "cispo"):
        low, high = getattr(a, f"{name}_clip_ratio_low"), getattr(a, f"{name}_clip_ratio_high")
        _require(
            0 <= low <= 1,
            f"actor.{name}_clip_ratio_low",
            f"actor.{name}_clip_ratio_low={low} must be in [0, 1] (the lower bound is 1 - low)",
        )
        _require(
            high >= 0,
            f"actor.{name}_clip_ratio_high",
            f"actor.{name}_clip_ratio_high={high} must be >= 0 (the upper bound is 1 + high)",
        )
    threshold = a.rollout_is.threshold
    _require(
        threshold > 0,
        "actor.rollout_is.threshold",
        f"actor.rollout_is.threshold={threshold} must be > 0 (weights are truncated at it; 2 is usual)",
    )
    k = cfg.algorithm.kl_ctrl
    _require(k.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", f"algorithm.kl_ctrl.kl_coef={k.kl_coef} must be >= 0")
    _require(k.target_kl > 0, "algorithm.kl_ctrl.target_kl", f"algorithm.kl_ctrl.target_kl={k.target_kl} must be > 0")
    _require(k.horizon > 0, "algorithm.kl_ctrl.horizon", f"algorithm.kl_ctrl.horizon={k.horizon} must be > 0")
    _require(
        not (cfg.algorithm.use_kl_in_reward and cfg.ref.enabled is False),
        "ref.enabled",
        "ref.enabled=false but algorithm.use_kl_in_reward=true needs reference log-probs; "
        "set ref.enabled to null (auto) or true",
    )


def resolve_ref(cfg: RunConfig) -> None:
    """ref.enabled auto: on exactly when something reads reference log-probs (a KL in the loss or
    the reward, a sequence loss) or the reference is refreshed."""
    if cfg.ref.enabled is None:
        cfg.ref.enabled = (
            cfg.actor.use_kl_loss
            or cfg.algorithm.use_kl_in_reward
            or cfg.actor.policy_loss in ("spin", "sppo")  # sequence losses against the reference
            or cfg.algorithm.adv_estimator == "prime"  # the implicit PRM's reference
            or cfg.ref.update_every > 0
        )
