"""Ranges of single keys: what must be positive, non-negative, a fraction, a port, non-empty."""

from __future__ import annotations

from typing import Any

from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig

_POSITIVE = [
    "data.num_train",
    "data.max_prompt_length",
    "data.train_batch_size",
    "actor.parallel.tp",
    "actor.parallel.pp",
    "actor.parallel.ep",
    "actor.parallel.etp",
    "actor.parallel.cp",
    "actor.parallel.vpp",
    "actor.ppo_mini_batch_size",
    "actor.micro_batch_size",
    "actor.ppo_epochs",
    "actor.optim.lr",
    "actor.optim.adam_eps",
    "algorithm.epsilon",
    "rollout.n",
    "rollout.max_new_tokens",
    "rollout.num_servers",
    "rollout.max_batch_size",
    "rollout.torch_threads",
    "rollout.request_timeout_s",
    "bridge.bucket_size_mb",
    "bridge.parity_atol",
    "trainer.total_steps",
    "trainer.log_every",
    "trainer.max_checkpoints",
    "trainer.stop_grace_s",
    "cluster.num_actor_ranks",
    "critic.parallel.tp",
    "critic.parallel.pp",
    "critic.parallel.ep",
    "critic.parallel.etp",
    "critic.parallel.cp",
    "critic.ppo_mini_batch_size",
    "critic.micro_batch_size",
    "critic.ppo_epochs",
    "critic.optim.lr",
    "critic.optim.adam_eps",
    "critic.cliprange_value",
    "reward.math_timeout_s",
    "reward.math_workers",
]
_NON_NEGATIVE = [
    "data.num_val",
    "actor.optim.weight_decay",
    "actor.optim.clip_grad",
    "actor.clip_ratio_low",
    "actor.clip_ratio_high",
    "actor.kl_loss_coef",
    "actor.entropy_coeff",
    "rollout.temperature",
    "rollout.val_temperature",
    "rollout.max_retries",
    "trainer.val_every",
    "trainer.save_every",
    "critic.optim.weight_decay",
    "critic.optim.clip_grad",
]


def get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def check_ranges(cfg: RunConfig) -> None:
    for key in _POSITIVE:
        _require(get(cfg, key) > 0, key, f"{key}={get(cfg, key)!r} must be > 0")
    for key in _NON_NEGATIVE:
        _require(get(cfg, key) >= 0, key, f"{key}={get(cfg, key)!r} must be >= 0")
    budget = cfg.actor.max_tokens_per_micro_batch
    _require(
        budget is None or budget > 0,
        "actor.max_tokens_per_micro_batch",
        f"actor.max_tokens_per_micro_batch={budget!r} must be > 0 (or null: micro-batches by "
        "actor.micro_batch_size rows)",
    )
    frac = cfg.bridge.parity_rows_off
    _require(
        0 <= frac < 1,
        "bridge.parity_rows_off",
        f"bridge.parity_rows_off={frac!r} must be in [0, 1): the fraction of checked rows allowed "
        "a token beyond bridge.parity_atol (0 = strict)",
    )
    _require(
        cfg.bridge.parity_row_max >= cfg.bridge.parity_atol,
        "bridge.parity_row_max",
        f"bridge.parity_row_max={cfg.bridge.parity_row_max!r} must be >= bridge.parity_atol="
        f"{cfg.bridge.parity_atol!r}: it bounds how far a row beyond parity_atol may be off",
    )
    _require(
        cfg.bridge.parity_probe_rows >= 0,
        "bridge.parity_probe_rows",
        f"bridge.parity_probe_rows={cfg.bridge.parity_probe_rows!r} must be >= 0 (0: no probe after a sync in "
        "the asynchronous loops)",
    )
    low = cfg.actor.clip_ratio_low
    _require(
        low < 1,
        "actor.clip_ratio_low",
        f"actor.clip_ratio_low={low} must be < 1 (the ratio is clipped to [1 - low, 1 + high])",
    )
    for key in (
        "actor.optim.adam_beta1",
        "actor.optim.adam_beta2",
        "critic.optim.adam_beta1",
        "critic.optim.adam_beta2",
    ):
        _require(0 <= get(cfg, key) < 1, key, f"{key}={get(cfg, key)} must be in [0, 1)")
    top_p = cfg.rollout.top_p
    _require(0 < top_p <= 1, "rollout.top_p", f"rollout.top_p={top_p} must be in (0, 1]")
    top_k = cfg.rollout.top_k
    _require(top_k == -1 or top_k >= 1, "rollout.top_k", f"rollout.top_k={top_k} must be -1 (off) or >= 1")
    port = cfg.rollout.port
    _require(0 <= port <= 65535, "rollout.port", f"rollout.port={port} must be in 0..65535 (0 picks a free port)")
    cpus = cfg.cluster.num_cpus
    _require(
        cpus is None or cpus >= 1, "cluster.num_cpus", f"cluster.num_cpus={cpus} must be >= 1 or null (Ray's default)"
    )
    for key in ("trainer.output_dir", "trainer.experiment_name", "rollout.host"):
        _require(bool(get(cfg, key).strip()), key, f"{key} must not be empty")
    _require(
        cfg.cluster.address is None or bool(cfg.cluster.address.strip()),
        "cluster.address",
        "cluster.address must be null (start a local Ray cluster), 'auto' or an address",
    )
