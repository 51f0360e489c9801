"""The loop mode's rules (trainer.mode): what one_step_off and fully_async can run with."""

from __future__ import annotations

from megarl.config.loader import ConfigError


def resolved_rollout_is(cfg) -> str | None:
    """actor.rollout_is.level resolved. auto: token-level truncated importance sampling (threshold
    actor.rollout_is.threshold, 2 by default) in one_step_off and fully_async, whose rows come from
    older weights than the actor's: decoupled PPO, the ratio against the recomputed old (proximal)
    log-probs and the truncated weight old / behaviour on each token (TIS, as verl's rollout_is and
    slime's --use-tis; token level keeps the variance of long responses bounded where a sequence's
    product of ratios would not). Off in sync, where the engine sampled with the actor's weights
    (parity holds) and the weight would be 1 up to rounding."""
    level = cfg.actor.rollout_is.level
    if level != "auto":
        return level
    return "token" if cfg.trainer.mode != "sync" else None


def reuses_rollout_log_probs(cfg) -> bool:
    """actor.old_log_prob resolved: whether the rollout's log-probs serve as old_log_probs (see
    the schema): explicitly, or by auto where they equal the trainer's up to fp32 rounding."""
    a = cfg.actor
    if a.old_log_prob != "auto":
        return a.old_log_prob == "rollout"
    return (
        cfg.trainer.mode == "sync"
        and cfg.rollout.backend == "embedded"
        and a.precision == "fp32"
        and a.rollout_is.level is None
        and cfg.rollout.agent_loop is None
        and cfg.bridge.check_parity
        and a.policy_loss != "spin"  # its chosen rows were not sampled: no rollout log-probs
    )


def check_loop_mode(cfg) -> None:
    t = cfg.trainer
    if cfg.actor.old_log_prob == "rollout" and t.mode != "sync":
        raise ConfigError(
            "actor.old_log_prob",
            (
                f"actor.old_log_prob=rollout takes the rollout engine's log-probs as the old policy's, "
                f"but with trainer.mode={t.mode} the engines sample with older weights than the actor "
                "holds. Use actor.old_log_prob=recompute (or auto), or trainer.mode=sync"
            ),
        )
    if t.mode == "sync":
        return
    if cfg.cluster.placement != "disaggregated":
        raise ConfigError(
            "trainer.mode",
            (
                f"trainer.mode={t.mode} overlaps generation with training, which needs the rollout "
                "engines on devices of their own; cluster.placement=colocated shares them with the "
                "actor (engines release memory while it trains). Set cluster.placement=disaggregated "
                "(configs/disaggregated.yaml), or trainer.mode=sync"
            ),
        )
    if t.mode != "fully_async":
        return
    if t.max_staleness < 0:
        raise ConfigError(
            "trainer.max_staleness",
            f"trainer.max_staleness={t.max_staleness} must be >= 0 "
            "(0: every sample started with the weights it is trained at)",
        )
    if t.deterministic:
        raise ConfigError(
            "trainer.deterministic",
            (
                "trainer.deterministic=true cannot hold with trainer.mode=fully_async: which weights "
                "generate which tokens depends on timing. Use trainer.mode=sync or one_step_off for "
                "reproducible runs"
            ),
        )
    if cfg.algorithm.filter_groups.enable:
        raise ConfigError(
            "algorithm.filter_groups.enable",
            (
                "algorithm.filter_groups (DAPO dynamic sampling) regenerates from the next prompt batches "
                "inside a step; with trainer.mode=fully_async the buffer already holds more than a step "
                "needs. Use trainer.mode=one_step_off or sync with it, or turn it off"
            ),
        )
    if cfg.rollout.agent_loop is not None:
        raise ConfigError(
            "rollout.agent_loop",
            (
                f"rollout.agent_loop={cfg.rollout.agent_loop} runs multi-turn trajectories through the "
                "rollout manager; trainer.mode=fully_async's producer sends single-turn requests only. "
                "Use trainer.mode=one_step_off or sync with an agent loop"
            ),
        )
