"""The algorithm's own keys: discounting, the critic and reference it needs, DAPO's dynamic sampling
and overlong shaping."""

from __future__ import annotations

from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig
from megarl.config.validate_ranges import get


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def check_algorithm(cfg: RunConfig) -> None:
    a = cfg.algorithm
    for key in ("algorithm.gamma", "algorithm.lam"):
        _require(0 <= get(cfg, key) <= 1, key, f"{key}={get(cfg, key)} must be in [0, 1]")
    _require(
        not (a.adv_estimator == "gae" and not cfg.critic.enabled),
        "critic.enabled",
        "critic.enabled=false but algorithm.adv_estimator=gae needs the critic: set critic.enabled=true",
    )
    _require(
        not (cfg.critic.enabled and a.adv_estimator != "gae"),
        "critic.enabled",
        f"critic.enabled=true trains a value function that only algorithm.adv_estimator=gae uses "
        f"(this run: {a.adv_estimator}); set algorithm.adv_estimator=gae (PPO) or critic.enabled=false",
    )
    _require(
        not (cfg.actor.use_kl_loss and cfg.ref.enabled is False),
        "ref.enabled",
        "ref.enabled=false but actor.use_kl_loss=true needs reference log-probs; "
        "set ref.enabled to null (auto) or true",
    )


def check_dapo(cfg: RunConfig) -> None:
    """Dynamic sampling (algorithm.filter_groups) and overlong shaping (reward.overlong_buffer)."""
    f, o = cfg.algorithm.filter_groups, cfg.reward.overlong_buffer
    _require(
        f.max_num_gen_batches >= 0,
        "algorithm.filter_groups.max_num_gen_batches",
        f"algorithm.filter_groups.max_num_gen_batches={f.max_num_gen_batches} must be >= 0 (0: no bound)",
    )
    _require(
        not f.enable or cfg.rollout.n >= 2,
        "algorithm.filter_groups.enable",
        "algorithm.filter_groups keeps groups whose responses scored differently: it needs rollout.n >= 2",
    )
    if o.enable:
        _require(
            0 < o.len <= cfg.rollout.max_new_tokens,
            "reward.overlong_buffer.len",
            f"reward.overlong_buffer.len={o.len} must be in (0, rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}]: the last tokens before the limit that are penalised",
        )
        _require(
            o.penalty_factor >= 0,
            "reward.overlong_buffer.penalty_factor",
            f"reward.overlong_buffer.penalty_factor={o.penalty_factor} must be >= 0",
        )
