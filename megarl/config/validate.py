"""Cross-field validation of a RunConfig, run before any process starts.

`validate(cfg, model_config)` raises the first ConfigError it finds (one line, naming the
dotted key and the value) and otherwise returns a copy with every "auto" (None) field resolved.

Parallel layout rules (Megatron-core's, for world = cluster.num_actor_ranks):
  * tp*pp*cp divides world; data-parallel size dp = world / (tp*pp*cp)
  * ep*etp divides world/pp (experts are laid out over the ranks of one pipeline stage)
  * tp divides num_attention_heads and num_key_value_heads; pp divides num_hidden_layers;
    ep divides num_experts; MoE with tp > 1 needs sequence parallel
  * vpp > 1 (interleaved 1F1B) needs pp > 1, and pp*vpp divides num_hidden_layers (every virtual
    stage holds the same number of layers); uneven first/last stages: validate_pipeline.py
  * with cluster.devices_per_node, tensor (and context) parallel groups stay inside one node
  * actor/critic.recompute needs no check beyond its Literal: Megatron's one layout rule for it
    (1 <= recompute_num_layers <= layers per pipeline rank; "full" uses 1) holds for every split
    stage_layers accepts, and what else Megatron refuses with recompute (its own cpu_offloading,
    distribute_saved_activations under SP, MoE comm overlap, fp8 recipes) megarl never turns on
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

from megarl.config.loader import ConfigError, check_types
from megarl.config.schema import RunConfig
from megarl.config.validate_data import check_data
from megarl.config.validate_losses import check_losses, resolve_ref
from megarl.config.validate_pipeline import check_stage_options, check_virtual_pipeline, stage_layers
from megarl.config.validate_reward import check_reward_model, resolve_reward
from megarl.config.validate_rollout import check_rollout, resolve_rollout
from megarl.config.validate_trainer import check_loop_mode, reuses_rollout_log_probs

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
    "rollout.request_timeout_s",
    "bridge.bucket_size_mb",
    "bridge.parity_atol",
    "trainer.total_steps",
    "trainer.log_every",
    "trainer.max_checkpoints",
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
# estimators whose baseline is the other samples of the same prompt
_GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "opo", "reinforce_plus_plus_baseline")
_FUNCTION_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


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


def check_batch_sizes(cfg: RunConfig) -> None:
    n, est = cfg.rollout.n, cfg.algorithm.adv_estimator
    if est in _GROUP_ESTIMATORS:
        _require(
            n >= 2,
            "rollout.n",
            f"rollout.n={n} must be >= 2 for {est}: advantages compare "
            "responses to the same prompt, so a group of 1 learns nothing",
        )
    rows = cfg.data.train_batch_size * n
    mini = cfg.actor.ppo_mini_batch_size
    _require(
        rows % mini == 0,
        "actor.ppo_mini_batch_size",
        f"actor.ppo_mini_batch_size={mini} must divide the rows per step data.train_batch_size*rollout.n={rows}",
    )
    dp = data_parallel_size(cfg)
    _require(
        mini % dp == 0,
        "actor.ppo_mini_batch_size",
        f"actor.ppo_mini_batch_size={mini} must be divisible by the data-parallel size "
        f"{dp} (cluster.num_actor_ranks / (tp*pp*cp)) so every rank gets equal rows",
    )
    if cfg.data.train_files is None:
        _require(
            cfg.data.num_train >= cfg.data.train_batch_size,
            "data.num_train",
            f"data.num_train={cfg.data.num_train} is smaller than data.train_batch_size="
            f"{cfg.data.train_batch_size}; an epoch would have no full batch",
        )
    if cfg.trainer.val_every > 0 and cfg.data.val_files is None:
        _require(
            cfg.data.num_val >= 1,
            "data.num_val",
            "data.num_val=0 but trainer.val_every > 0; generate at least one val prompt",
        )


def check_task(cfg: RunConfig) -> None:
    """data.task: a built-in procedural task or rg:<a reasoning-gym dataset> (used when a file is null)."""
    task = cfg.data.task
    if task in ("digits", "arith", "arith_tool"):
        return
    _require(
        task.startswith("rg:") and len(task) > 3,
        "data.task",
        f"data.task={task!r} must be digits, arith, arith_tool or rg:<reasoning-gym dataset> "
        "(e.g. rg:basic_arithmetic)",
    )
    if cfg.data.train_files is None or (cfg.data.val_files is None and cfg.data.num_val > 0):
        try:
            from reasoning_gym.factory import DATASETS
        except ImportError as err:
            raise ConfigError(
                "data.task",
                f"data.task={task!r} needs the reasoning-gym package ({err}); scripts/setup_env.sh installs it",
            ) from err
        _require(
            task[3:] in DATASETS,
            "data.task",
            f"data.task={task!r}: reasoning-gym has no dataset {task[3:]!r}; known: {', '.join(sorted(DATASETS))}",
        )


def data_parallel_size(cfg: RunConfig) -> int:
    p = cfg.actor.parallel
    return max(cfg.cluster.num_actor_ranks // (p.tp * p.pp * p.cp), 1)


def num_experts(model_config: dict | None) -> int:
    """Routed experts of an HF config (Qwen-MoE, Mixtral and DeepSeek spell it differently)."""
    if not model_config:
        return 0
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if model_config.get(key):
            return int(model_config[key])
    return 0


def check_device_type(cfg: RunConfig) -> None:
    from megarl.perf.hardware import GPUS, canonical_device

    kind = cfg.cluster.device_type
    _require(
        kind is None or canonical_device(kind) is not None,
        "cluster.device_type",
        f"cluster.device_type={kind!r} is not a device the planner knows; use one of "
        f"{', '.join(list(GPUS) + ['CPU'])} (or null: this machine's)",
    )


def check_parallel(cfg: RunConfig, model_config: dict | None) -> None:
    check_layout("actor", cfg.actor.parallel, cfg.cluster.num_actor_ranks, model_config)
    check_nodes(cfg)
    if model_config is not None:
        check_model_fit(cfg, model_config)
        _require(
            not cfg.actor.moe.routing_replay or num_experts(model_config) > 0,
            "actor.moe.routing_replay",
            "actor.moe.routing_replay=true but the model is dense (no routed experts to replay); set it to false",
        )


def check_nodes(cfg: RunConfig) -> None:
    """Megatron numbers ranks tp fastest (order tp-cp-ep-dp-pp) and placement fills one node after
    another, so a tensor-parallel group stays inside a node exactly when tp divides the node's
    devices; across nodes its per-layer all-reduces would leave NVLink for the network."""
    per_node = cfg.cluster.devices_per_node
    if per_node is None or per_node < 1:
        return  # validate_rollout names a bad value
    sections = [("actor", cfg.actor.parallel)] + ([("critic", cfg.critic.parallel)] if cfg.critic.enabled else [])
    for section, p in sections:
        _require(
            per_node % p.tp == 0,
            f"{section}.parallel.tp",
            f"{section}.parallel.tp={p.tp} does not divide cluster.devices_per_node={per_node}: "
            "a tensor-parallel group would span nodes; lower tp (raise pp or ep instead)",
        )


def check_layout(section: str, p, world: int, model_config: dict | None) -> None:
    """`{section}.parallel` = p on `world` ranks: Megatron's divisibility rules and the model's."""
    key = f"{section}.parallel"
    model_parallel = p.tp * p.pp * p.cp
    _require(
        world % model_parallel == 0,
        key,
        f"{key} tp*pp*cp={p.tp}*{p.pp}*{p.cp}={model_parallel} does not divide cluster.num_actor_ranks={world}",
    )
    per_stage = world // p.pp
    _require(
        per_stage % (p.ep * p.etp) == 0,
        f"{key}.ep",
        f"{key}.ep={p.ep} times etp={p.etp} does not divide the ranks of one "
        f"pipeline stage cluster.num_actor_ranks/pp={per_stage}",
    )
    _require(
        not (p.sequence_parallel and p.tp == 1),
        f"{key}.sequence_parallel",
        f"{key}.sequence_parallel=true needs {key}.tp > 1; set it to null (auto) or raise tp",
    )
    check_virtual_pipeline(p, None, key)
    check_stage_options(p, key)
    is_moe = num_experts(model_config) > 0 or (model_config is None and p.ep > 1)
    _require(
        not (is_moe and p.tp > 1 and p.sequence_parallel is False),
        f"{key}.sequence_parallel",
        f"{key}.sequence_parallel=false with tp={p.tp} on an MoE model; Megatron "
        "needs sequence parallel for MoE with tp > 1 (set it to null or true)",
    )
    if model_config is not None:
        check_layout_fits_model(key, p, model_config)


def check_layout_fits_model(key: str, p, mc: dict) -> None:
    heads = mc.get("num_attention_heads")
    kv_heads = mc.get("num_key_value_heads") or heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if value:
            _require(
                value % p.tp == 0,
                f"{key}.tp",
                f"{key}.tp={p.tp} does not divide model.{name}={value}; choose a divisor",
            )
    layers = mc.get("num_hidden_layers")
    if layers:
        stage_layers(p, layers, key)
    experts = num_experts(mc)
    if p.ep > 1:
        _require(experts > 0, f"{key}.ep", f"{key}.ep={p.ep} but the model has no experts; use ep=1")
        _require(experts % p.ep == 0, f"{key}.ep", f"{key}.ep={p.ep} does not divide model.num_experts={experts}")


def check_model_fit(cfg: RunConfig, mc: dict) -> None:
    max_pos = mc.get("max_position_embeddings")
    total = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    if max_pos:
        _require(
            total <= max_pos,
            "data.max_prompt_length",
            f"data.max_prompt_length + rollout.max_new_tokens = {total} exceeds "
            f"model.max_position_embeddings={max_pos}",
        )


def check_critic(cfg: RunConfig, model_config: dict | None) -> None:
    """The critic group: colocated with the actor ranks, so the same world, its own layout and
    batch sizes; its own checkpoint (critic.model.path) must share the actor's vocabulary."""
    c = cfg.critic
    if not c.enabled:
        return
    critic_model = model_config
    if c.model.path is not None:
        critic_model = json.loads((Path(c.model.path) / "config.json").read_text())
        actor_vocab = (model_config or {}).get("vocab_size")
        _require(
            actor_vocab is None or critic_model.get("vocab_size") == actor_vocab,
            "critic.model.path",
            f"critic.model.path={c.model.path!r} has vocab_size={critic_model.get('vocab_size')} "
            f"but the actor's model has {actor_vocab}; the critic scores the actor's tokens, "
            "so it needs the same tokenizer",
        )
    check_layout("critic", c.parallel, cfg.cluster.num_actor_ranks, critic_model)
    rows = cfg.data.train_batch_size * cfg.rollout.n
    mini = c.ppo_mini_batch_size
    _require(
        rows % mini == 0,
        "critic.ppo_mini_batch_size",
        f"critic.ppo_mini_batch_size={mini} must divide the rows per step data.train_batch_size*rollout.n={rows}",
    )
    p = c.parallel
    dp = max(cfg.cluster.num_actor_ranks // (p.tp * p.pp * p.cp), 1)
    _require(
        mini % dp == 0,
        "critic.ppo_mini_batch_size",
        f"critic.ppo_mini_batch_size={mini} must be divisible by the critic's data-parallel "
        f"size {dp} (cluster.num_actor_ranks / (critic tp*pp*cp)) so every rank gets equal rows",
    )


def check_paths(cfg: RunConfig) -> None:
    check_data(cfg)  # data files (one or a list), the mix, data.custom_cls, validation options
    _require(
        cfg.model.path is None or cfg.model.num_hidden_layers is None,
        "model.num_hidden_layers",
        f"model.num_hidden_layers={cfg.model.num_hidden_layers} overrides a preset's depth, but "
        f"model.path={cfg.model.path!r} is set (its config.json decides); remove one of them",
    )
    _require(
        cfg.model.num_hidden_layers is None or cfg.model.preset.startswith("tiny-"),
        "model.num_hidden_layers",
        f"model.num_hidden_layers overrides the depth of a tiny preset built from scratch; "
        f"model.preset={cfg.model.preset!r} is pretrained, so its depth is fixed; remove it",
    )
    _require(
        cfg.model.num_hidden_layers is None or cfg.model.num_hidden_layers >= 1,
        "model.num_hidden_layers",
        f"model.num_hidden_layers={cfg.model.num_hidden_layers} must be >= 1 or null (the preset's)",
    )
    if cfg.model.path is not None:
        _require(
            (Path(cfg.model.path) / "config.json").is_file(),
            "model.path",
            f"model.path={cfg.model.path!r} is not a Hugging Face checkpoint directory "
            "(no config.json); set it to null to build model.preset",
        )
    critic_path = cfg.critic.model.path
    if critic_path is not None:
        _require(
            (Path(critic_path) / "config.json").is_file(),
            "critic.model.path",
            f"critic.model.path={critic_path!r} is not a Hugging Face checkpoint directory "
            "(no config.json); set it to null to start the critic from the actor's model",
        )
    fn = cfg.reward.custom_function
    if fn is not None and ".py:" in fn:
        path = fn.rpartition(":")[0]
        _require(
            Path(path).is_file(), "reward.custom_function", f"reward.custom_function={fn!r}: file {path} does not exist"
        )
    else:
        _require(
            fn is None or bool(_FUNCTION_REF.match(fn)),
            "reward.custom_function",
            f"reward.custom_function={fn!r} must look like 'package.module:function' or 'path/to/file.py:function'",
        )


def check_resume(cfg: RunConfig) -> None:
    """trainer.resume: auto, never, or a complete checkpoint of a run (its marker is read)."""
    resume = cfg.trainer.resume
    if resume in ("auto", "never"):
        return
    from megarl.trainer.checkpoints import CheckpointNotFound, read_run_checkpoint

    try:
        read_run_checkpoint(Path(resume))
    except CheckpointNotFound as err:
        raise ConfigError(
            "trainer.resume",
            f"trainer.resume={resume!r}: {err}; use 'auto' (the newest "
            "complete checkpoint of the run dir), 'never', or a checkpoint directory",
        ) from None


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


def read_model_config(cfg: RunConfig) -> dict | None:
    """config.json of model.path, or None (a preset's caller passes its dict explicitly)."""
    if cfg.model.path is None:
        return None
    return json.loads((Path(cfg.model.path) / "config.json").read_text())


def resolve(cfg: RunConfig) -> RunConfig:
    """A copy with auto fields decided: sequence parallel on iff tp > 1; ref iff a KL needs it;
    actor.old_log_prob (validate_trainer.reuses_rollout_log_probs)."""
    out = copy.deepcopy(cfg)
    for p in (out.actor.parallel, out.critic.parallel):
        if p.sequence_parallel is None:
            p.sequence_parallel = p.tp > 1
    resolve_ref(out)
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
    check_paths(cfg)
    if model_config is None:
        model_config = read_model_config(cfg)
    check_parallel(cfg, model_config)
    check_device_type(cfg)
    check_batch_sizes(cfg)
    check_task(cfg)
    check_critic(cfg, model_config)
    check_rollout(cfg, model_config)
    check_algorithm(cfg)
    check_dapo(cfg)
    check_reward_model(cfg)
    check_losses(cfg)
    check_resume(cfg)
    check_loop_mode(cfg)
    return resolve(cfg)
