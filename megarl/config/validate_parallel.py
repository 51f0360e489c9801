"""The parallel layouts of the actor and the critic, their fit to the model, and the batch sizes
they must divide.

Parallel layout rules (Megatron-core's, for world = cluster.num_actor_ranks):
  * tp*pp*cp divides world; data-parallel size dp = world / (tp*pp*cp)
  * ep*etp divides world/pp (experts are laid out over the ranks of one pipeline stage)
  * tp divides num_attention_heads and num_key_value_heads; pp divides num_hidden_layers;
    ep divides num_experts; MoE with tp > 1 needs sequence parallel
  * vpp > 1 (interleaved 1F1B) needs pp > 1, and pp*vpp divides num_hidden_layers (every virtual
    stage holds the same number of layers); uneven first/last stages: validate_pipeline.py
  * with cluster.devices_per_node, tensor (and context) parallel groups stay inside one node
    (validate_cluster.py)
  * actor/critic.recompute needs no check beyond its Literal: Megatron's one layout rule for it
    (1 <= recompute_num_layers <= layers per pipeline rank; "full" uses 1) holds for every split
    stage_layers accepts, and what else Megatron refuses with recompute (its own cpu_offloading,
    distribute_saved_activations under SP, MoE comm overlap, fp8 recipes) megarl never turns on
"""

from __future__ import annotations

import json
from pathlib import Path

from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig
from megarl.config.validate_cluster import check_nodes
from megarl.config.validate_pipeline import check_stage_options, check_virtual_pipeline, stage_layers

# estimators whose baseline is the other samples of the same prompt
_GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "opo", "reinforce_plus_plus_baseline", "sppo", "prime")


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


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


def resolve_sequence_parallel(cfg: RunConfig) -> None:
    """sequence_parallel null (auto): on exactly when tp > 1 (actor, critic and PRM)."""
    for p in (cfg.actor.parallel, cfg.critic.parallel, cfg.prm.parallel):
        if p.sequence_parallel is None:
            p.sequence_parallel = p.tp > 1


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
