"""Validation of the recipes (SPIN, SPPO, PRIME) and of a reference refreshed from the actor."""

from __future__ import annotations

from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig

SEQUENCE_LOSSES = ("spin", "sppo")  # actor.policy_loss values that are sequence losses against the reference


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def check_recipes(cfg: RunConfig, model_config: dict | None = None, vision: bool = False) -> None:
    """`model_config`: the (language) model's HF config; `vision`: the model is a vision-language one."""
    a, loss, est = cfg.actor, cfg.actor.policy_loss, cfg.algorithm.adv_estimator
    recipe = loss if loss in SEQUENCE_LOSSES else est if est in ("sppo", "prime") else None
    _require(
        recipe is None or not vision,
        "actor.policy_loss" if loss in SEQUENCE_LOSSES else "algorithm.adv_estimator",
        f"{recipe} does not run with a vision-language model yet (its extra rows and models carry no images)",
    )
    if est == "prime":
        _check_prime(cfg, model_config)
    _require(
        cfg.ref.update_every >= 0,
        "ref.update_every",
        f"ref.update_every={cfg.ref.update_every} must be >= 0 (0: never)",
    )
    _require(
        not (cfg.ref.update_every and cfg.ref.enabled is False),
        "ref.update_every",
        "ref.update_every refreshes the reference policy, but ref.enabled=false; set ref.enabled to null (auto)",
    )
    _require(
        not (cfg.ref.update_every and a.lora.rank),
        "ref.update_every",
        "ref.update_every with actor.lora: the LoRA reference is the frozen base (the actor with its "
        "adapters off) and cannot take the actor's weights; set ref.update_every=0",
    )
    _require(
        (loss == "sppo") == (est == "sppo"),
        "actor.policy_loss" if est == "sppo" else "algorithm.adv_estimator",
        f"actor.policy_loss={loss} with algorithm.adv_estimator={est}: SPPO is both, the estimator gives "
        "the loss its targets (win probabilities); set both to sppo, or neither",
    )
    if loss not in SEQUENCE_LOSSES:
        return
    _require(
        cfg.ref.enabled is not False,
        "ref.enabled",
        f"actor.policy_loss={loss} trains against the reference policy; set ref.enabled to null (auto) or true",
    )
    for key, off, why in (
        ("actor.use_kl_loss", not a.use_kl_loss, "the loss is a log-ratio to the reference already"),
        ("actor.entropy_coeff", not a.entropy_coeff, "a sequence loss takes no token bonus"),
        ("algorithm.use_kl_in_reward", not cfg.algorithm.use_kl_in_reward, "the loss reads no reward"),
        ("actor.rollout_is.level", a.rollout_is.level in (None, "auto"), "the loss has no importance ratio"),
    ):
        _require(off, key, f"{key} has no meaning with actor.policy_loss={loss} ({why}); turn it off")
    _require(
        cfg.trainer.mode == "sync",
        "trainer.mode",
        f"actor.policy_loss={loss} runs in trainer.mode=sync (its reference is the previous round's policy)",
    )
    if loss == "spin":
        _check_spin(cfg)


def _check_spin(cfg: RunConfig) -> None:
    from megarl.config.validate_parallel import data_parallel_size

    dp = data_parallel_size(cfg)
    _require(
        cfg.data.train_batch_size % dp == 0,
        "data.train_batch_size",
        f"data.train_batch_size={cfg.data.train_batch_size} must be divisible by the data-parallel size {dp} "
        "under actor.policy_loss=spin: each rank trains whole prompts (their chosen row and samples)",
    )
    _require(
        cfg.algorithm.spin.beta > 0, "algorithm.spin.beta", f"algorithm.spin.beta={cfg.algorithm.spin.beta} must be > 0"
    )
    for key, off in (
        ("actor.moe.routing_replay", not cfg.actor.moe.routing_replay),
        ("rollout.agent_loop", cfg.rollout.agent_loop is None),
        ("algorithm.filter_groups.enable", not cfg.algorithm.filter_groups.enable),
    ):
        _require(off, key, f"{key} is not supported with actor.policy_loss=spin (the chosen rows are not generated)")
    _require(
        cfg.actor.old_log_prob != "rollout",
        "actor.old_log_prob",
        "actor.old_log_prob=rollout: the chosen rows have no rollout log-probs; use recompute (or auto)",
    )


def _check_prime(cfg: RunConfig, model_config: dict | None) -> None:
    from megarl.config.validate_parallel import check_layout

    p = cfg.algorithm.prime
    _require(p.beta > 0, "algorithm.prime.beta", f"algorithm.prime.beta={p.beta} must be > 0")
    _require(
        cfg.ref.enabled is not False and not cfg.ref.update_every,
        "ref.enabled" if cfg.ref.enabled is False else "ref.update_every",
        "algorithm.adv_estimator=prime scores tokens against the initial policy (the reference): set "
        "ref.enabled to null (auto) and ref.update_every=0",
    )
    _require(cfg.trainer.mode == "sync", "trainer.mode", "algorithm.adv_estimator=prime runs in trainer.mode=sync")
    band = p.accuracy_band
    if band is not None:
        _require(
            len(band) == 2 and 0 <= band[0] <= band[1] <= 1,
            "algorithm.prime.accuracy_band",
            f"algorithm.prime.accuracy_band={band} must be [low, high] with 0 <= low <= high <= 1 (the paper's [0.2, 0.8])",
        )
        _require(
            not cfg.algorithm.filter_groups.enable,
            "algorithm.filter_groups.enable",
            "algorithm.prime.accuracy_band is PRIME's group filter; turn algorithm.filter_groups off (one filter a step)",
        )
    check_layout("prm", cfg.prm.parallel, cfg.cluster.num_actor_ranks, model_config)
    rows, mini = cfg.data.train_batch_size * cfg.rollout.n, cfg.prm.mini_batch_size
    q = cfg.prm.parallel
    dp = max(cfg.cluster.num_actor_ranks // (q.tp * q.pp * q.cp), 1)
    _require(
        rows % mini == 0 and mini % dp == 0,
        "prm.mini_batch_size",
        f"prm.mini_batch_size={mini} must divide the rows per step data.train_batch_size*rollout.n={rows} "
        f"and be divisible by the PRM's data-parallel size {dp}",
    )
    _require(cfg.prm.epochs >= 1, "prm.epochs", f"prm.epochs={cfg.prm.epochs} must be >= 1")
