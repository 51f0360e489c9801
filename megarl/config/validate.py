"""Cross-field validation of a RunConfig, run before any process starts.

`validate(cfg, model_config)` raises the first ConfigError it finds (one line, naming the
dotted key and the value) and otherwise returns a copy with every "auto" (None) field resolved.

One module per concern, each a set of check_* functions (and resolve_* for its auto fields):
  validate_ranges    single keys: positive, non-negative, fractions, ports, non-empty
  validate_data      data files, the train mix, data.custom_cls, data.task, validation options
  validate_model     model.path / critic.model.path, a tiny preset's depth
  validate_reward    reward.custom_function, the model reward
  validate_offload   actor.offload.host_optimizer: its range and what Megatron runs it with
  validate_parallel  actor and critic layouts, their fit to the model, the batch sizes
  validate_pipeline  how a pipeline splits the layers (also used by the engine)
  validate_cluster   tensor-parallel groups inside a node, cluster.device_type
  validate_rollout   the engines, their pools, the agent loop
  validate_algorithm discounting, the critic and reference it needs, DAPO's options
  validate_losses    the policy loss, the rollout-mismatch correction, KL
  validate_trainer   the loop mode (trainer.mode) and what it can run with
  validate_trackers  trainer.loggers: jsonl kept, every tracker named installed
  validate_sft       `megarl sft`'s own entry point: the sections an SFT run reads
trainer.resume is checked where the checkpoint is read: megarl/trainer/checkpoints.py.
"""

from __future__ import annotations

import copy

from megarl.config.loader import check_types
from megarl.config.schema import RunConfig
from megarl.config.validate_algorithm import check_algorithm, check_dapo
from megarl.config.validate_cluster import check_device_type
from megarl.config.validate_data import check_data, check_task
from megarl.config.validate_lora import check_lora
from megarl.config.validate_losses import check_losses, resolve_ref
from megarl.config.validate_model import check_model_paths, read_model_config
from megarl.config.validate_offload import check_offload
from megarl.config.validate_parallel import (
    check_batch_sizes,
    check_critic,
    check_parallel,
    data_parallel_size,
    resolve_sequence_parallel,
)
from megarl.config.validate_pipeline import stage_layers
from megarl.config.validate_ranges import check_ranges
from megarl.config.validate_recipes import check_recipes
from megarl.config.validate_reward import check_reward_function, check_reward_model, resolve_reward
from megarl.config.validate_rollout import check_rollout, resolve_rollout
from megarl.config.validate_trackers import check_loggers
from megarl.config.validate_trainer import check_loop_mode, resolved_rollout_is, reuses_rollout_log_probs
from megarl.config.validate_vision import check_vision, is_vision_language, text_view

# importable from here as before: the package, the CLI and the engine use them
__all__ = ["data_parallel_size", "read_model_config", "resolve", "stage_layers", "validate"]


def resolve(cfg: RunConfig) -> RunConfig:
    """A copy with auto fields decided: sequence parallel on iff tp > 1; ref iff a KL needs it;
    actor.rollout_is.level and actor.old_log_prob (validate_trainer)."""
    out = copy.deepcopy(cfg)
    resolve_sequence_parallel(out)
    resolve_ref(out)
    out.actor.rollout_is.level = resolved_rollout_is(out)
    out.actor.old_log_prob = "rollout" if reuses_rollout_log_probs(out) else "recompute"
    resolve_rollout(out)
    resolve_reward(out)
    return out


def validate(cfg: RunConfig, model_config: dict | None = None) -> RunConfig:
    """Check `cfg` (and its fit to `model_config`, an HF config dict) and resolve auto fields.

    When model_config is None and model.path is set, the checkpoint's config.json is read.
    """
    check_types(cfg)
    check_ranges(cfg)
    check_data(cfg)  # data files (one or a list), the mix, data.custom_cls, validation options
    check_model_paths(cfg)
    check_reward_function(cfg)
    if model_config is None:
        model_config = read_model_config(cfg)
    check_vision(cfg, model_config)
    vision = is_vision_language(model_config)
    model_config = text_view(model_config)  # a vision-language model's text sizes, at the top
    check_parallel(cfg, model_config)
    check_offload(cfg)
    check_lora(cfg, model_config)
    check_device_type(cfg)
    check_batch_sizes(cfg)
    check_task(cfg)
    check_critic(cfg, model_config)
    check_rollout(cfg, model_config)
    check_algorithm(cfg)
    check_dapo(cfg)
    check_reward_model(cfg)
    check_losses(cfg)
    check_recipes(cfg, model_config, vision)
    check_loop_mode(cfg)
    check_loggers(cfg)
    return resolve(cfg)
