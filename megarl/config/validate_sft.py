"""Validation of a `megarl sft` run: the sections it reads (schema_sft.py lists them), checked
before any process starts. The RL-only sections (rollout, algorithm, reward, bridge, critic, data)
are not checked beyond their types: an SFT run never uses them."""

from __future__ import annotations

import copy

from megarl.config.loader import ConfigError, check_types
from megarl.config.schema import RunConfig
from megarl.config.validate_cluster import check_device_type
from megarl.config.validate_data import check_files
from megarl.config.validate_lora import check_lora
from megarl.config.validate_model import check_model_paths, read_model_config
from megarl.config.validate_offload import check_offload
from megarl.config.validate_parallel import check_layout, check_nodes, data_parallel_size, resolve_sequence_parallel
from megarl.config.validate_ranges import check_ranges
from megarl.config.validate_trackers import check_loggers
from megarl.config.validate_vision import is_vision_language


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def validate_sft(cfg: RunConfig, model_config: dict | None = None) -> RunConfig:
    """Check an SFT run's config (and its fit to `model_config`, an HF config dict; read from
    model.path when None) and return a copy with sequence parallel resolved."""
    check_types(cfg)
    check_ranges(cfg)
    check_model_paths(cfg)
    if model_config is None:
        model_config = read_model_config(cfg)
    _require(
        not is_vision_language(model_config),
        "model.path",
        "megarl sft trains text models; a vision-language model's SFT (rows with images) is not supported yet",
    )
    check_layout("actor", cfg.actor.parallel, cfg.cluster.num_actor_ranks, model_config)
    check_nodes(cfg)
    check_device_type(cfg)
    check_offload(cfg)
    check_lora(cfg, model_config)
    check_sft(cfg, model_config)
    check_loggers(cfg)
    out = copy.deepcopy(cfg)
    resolve_sequence_parallel(out)
    return out


def check_sft(cfg: RunConfig, model_config: dict | None) -> None:
    s = cfg.sft
    _require(
        s.train_files is not None or s.task is not None,
        "sft.train_files",
        "sft.train_files is null, but megarl sft trains on .parquet or .jsonl files of chat rows (a "
        "'messages' list of {role, content} per row); e.g. sft.train_files=configs/data/sft-arith-tool-train.jsonl, "
        "or generates them: sft.task=arith_tool",
    )
    _require(
        s.train_files is None or s.task is None,
        "sft.task",
        f"sft.task={s.task!r} generates the train rows, but sft.train_files={s.train_files!r} names them too; "
        "set one and leave the other null",
    )
    _require(s.num_train >= 1, "sft.num_train", f"sft.num_train={s.num_train} must be >= 1")
    _require(s.num_val >= 0, "sft.num_val", f"sft.num_val={s.num_val} must be >= 0")
    check_files("sft.train_files", s.train_files, custom=False)
    check_files("sft.val_files", s.val_files, custom=False)
    _require(bool(s.messages_key.strip()), "sft.messages_key", "sft.messages_key must not be empty")
    for key, value in (("sft.max_length", s.max_length), ("sft.batch_size", s.batch_size)):
        _require(value > 0, key, f"{key}={value} must be > 0")
    for key, value in (("sft.epochs", s.epochs), ("sft.total_steps", s.total_steps)):
        _require(value is None or value > 0, key, f"{key}={value} must be > 0 or null")
    _require(
        s.epochs is None or s.total_steps is None,
        "sft.epochs",
        f"sft.epochs={s.epochs} and sft.total_steps={s.total_steps} both set the run's length; set one "
        "and leave the other null",
    )
    dp = data_parallel_size(cfg)
    _require(
        s.batch_size % dp == 0,
        "sft.batch_size",
        f"sft.batch_size={s.batch_size} must be divisible by the data-parallel size {dp} "
        "(cluster.num_actor_ranks / (tp*pp*cp)) so every rank gets equal rows",
    )
    _require(
        cfg.trainer.val_every == 0 or s.val_files is not None or (s.task is not None and s.num_val > 0),
        "trainer.val_every",
        f"trainer.val_every={cfg.trainer.val_every} but sft.val_files is null (and no sft.task with "
        "sft.num_val > 0): there is nothing to validate on; set sft.val_files or trainer.val_every=0",
    )
    _require(
        not cfg.actor.moe.routing_replay,
        "actor.moe.routing_replay",
        "actor.moe.routing_replay replays a rollout's expert choices; an SFT run has no rollout: set it to false",
    )
    max_pos = (model_config or {}).get("max_position_embeddings")
    _require(
        not max_pos or s.max_length <= max_pos,
        "sft.max_length",
        f"sft.max_length={s.max_length} exceeds the model's max_position_embeddings={max_pos}; lower it",
    )
