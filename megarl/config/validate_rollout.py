"""Validation of the rollout side and the resource pools it is placed on (pure, no processes).

Device arithmetic, for K = rollout.num_servers engines of T = rollout.tp ranks over N =
rollout.nnodes nodes each (T / N ranks on every node of an engine):
  * colocated: the K * T engine devices come out of the actor pool (cluster.num_actor_ranks);
  * disaggregated: they come out of the rollout pool (cluster.num_rollout_devices, auto = K * T);
  * with cluster.devices_per_node D, every node of an engine must hold its T / N ranks whole,
    so T / N divides D (an engine node never straddles two machines).
The embedded engine shards attention heads, key-value heads, the MLP / expert intermediate size
and the vocabulary over its T ranks, so T must divide each of them.
"""

from __future__ import annotations

from megarl.config import agent_names
from megarl.config.loader import ConfigError
from megarl.config.schema import RunConfig


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def engine_devices(cfg: RunConfig) -> int:
    return cfg.rollout.num_servers * cfg.rollout.tp


def check_rollout(cfg: RunConfig, model_config: dict | None) -> None:
    r = cfg.rollout
    for key in ("tp", "nnodes", "ep", "dp", "startup_timeout_s"):
        value = getattr(r, key)
        _require(value > 0, f"rollout.{key}", f"rollout.{key}={value!r} must be > 0")
    frac = r.mem_fraction_static
    _require(
        frac is None or 0.0 < frac < 1.0,
        "rollout.mem_fraction_static",
        f"rollout.mem_fraction_static={frac!r} must be in (0, 1) (or null: SGLang's default)",
    )
    _require(
        frac is None or r.backend == "sglang",
        "rollout.mem_fraction_static",
        "rollout.mem_fraction_static is SGLang's; the embedded engine allocates what its batch "
        "needs: set it to null, or rollout.backend=sglang",
    )
    _require(
        r.max_engine_restarts >= 0,
        "rollout.max_engine_restarts",
        f"rollout.max_engine_restarts={r.max_engine_restarts} must be >= 0",
    )
    _require(
        r.tp % r.nnodes == 0,
        "rollout.nnodes",
        f"rollout.nnodes={r.nnodes} does not divide rollout.tp={r.tp}: every node of an engine holds tp/nnodes ranks",
    )
    if r.backend == "embedded":
        for key in ("ep", "dp"):
            _require(
                getattr(r, key) == 1,
                f"rollout.{key}",
                f"rollout.{key}={getattr(r, key)}: the embedded engine shards experts by tensor "
                f"parallel (rollout.tp) and has no {key.upper()} of its own; use 1, or "
                "rollout.backend=sglang",
            )
        if model_config is not None:
            _check_engine_fits_model(r.tp, model_config)
    else:
        _require(
            cfg.bridge.transport != "reshard",
            "bridge.transport",
            "bridge.transport=reshard needs rollout.backend=embedded: stock SGLang has no receiver that "
            "takes per-rank shards from many senders (docs/bridge.md says what it would need); use "
            "bridge.transport=distributed with SGLang",
        )
        _require(
            r.tp % r.ep == 0,
            "rollout.ep",
            f"rollout.ep={r.ep} must divide rollout.tp={r.tp} "
            "(SGLang lays expert parallel over the tensor-parallel ranks)",
        )
        _require(r.tp % r.dp == 0, "rollout.dp", f"rollout.dp={r.dp} must divide rollout.tp={r.tp}")
        if model_config is not None:
            _check_sglang_fits_model(r, model_config)
    _require(
        r.router_policy != "power_of_two" or r.num_servers >= 2,
        "rollout.router_policy",
        f"rollout.router_policy=power_of_two needs rollout.num_servers >= 2 (sglang-router refuses "
        f"to start it with fewer workers), got {r.num_servers}; use round_robin",
    )
    _check_pools(cfg)
    _check_agent(cfg)


def _check_agent(cfg: RunConfig) -> None:
    """rollout.agent_loop and rollout.agent.* (megarl/rollout/agent/; the names: agent_names.py)."""
    r = cfg.rollout
    if r.agent_loop is None:
        return
    _require(
        r.agent_loop in agent_names.AGENT_LOOP_NAMES,
        "rollout.agent_loop",
        f"rollout.agent_loop={r.agent_loop!r} is not a registered agent loop; known: "
        f"{sorted(agent_names.AGENT_LOOP_NAMES)} (or null for single-turn rollouts)",
    )
    a, s = r.agent, r.agent.sandbox
    for key, value in (("max_turns", a.max_turns), ("max_tool_calls_per_turn", a.max_tool_calls_per_turn)):
        _require(value >= 1, f"rollout.agent.{key}", f"rollout.agent.{key}={value} must be >= 1")
    unknown = [t for t in a.tools if t not in agent_names.TOOL_NAMES]
    _require(
        not unknown,
        "rollout.agent.tools",
        f"rollout.agent.tools names unregistered tools {unknown}; registered: {sorted(agent_names.TOOL_NAMES)}",
    )
    for key in ("timeout_s", "cpu_s", "memory_mb", "max_output_bytes", "file_mb", "max_concurrency"):
        _require(
            getattr(s, key) > 0,
            f"rollout.agent.sandbox.{key}",
            f"rollout.agent.sandbox.{key}={getattr(s, key)} must be > 0",
        )
    _require(
        not cfg.actor.moe.routing_replay,
        "actor.moe.routing_replay",
        "actor.moe.routing_replay needs one routing record per row; an agent trajectory spans several "
        "generate calls whose records are not joined: set actor.moe.routing_replay=false or rollout.agent_loop=null",
    )


def _check_engine_fits_model(tp: int, mc: dict) -> None:
    heads = mc.get("num_attention_heads")
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": mc.get("num_key_value_heads") or heads,
        "intermediate_size": mc.get("intermediate_size"),
        "moe_intermediate_size": mc.get("moe_intermediate_size"),
        "vocab_size": mc.get("vocab_size"),
    }
    for name, value in sizes.items():
        if value:
            _require(
                value % tp == 0,
                "rollout.tp",
                f"rollout.tp={tp} does not divide model.{name}={value}: each engine rank holds "
                "an equal shard; choose a divisor",
            )


def _check_sglang_fits_model(r, mc: dict) -> None:
    """SGLang's start-up assertions on the model: attention heads split over the tp/dp ranks of
    an attention group (key-value heads may instead be replicated: then the ranks are a multiple
    of them), routed experts over rollout.ep."""
    attn_tp = r.tp // r.dp
    heads = mc.get("num_attention_heads")
    kv = mc.get("num_key_value_heads") or heads
    if heads:
        _require(
            heads % attn_tp == 0,
            "rollout.tp",
            f"rollout.tp/rollout.dp={r.tp}/{r.dp}={attn_tp} attention ranks do not divide "
            f"model.num_attention_heads={heads}; choose tp (or raise rollout.dp) so they do",
        )
    if kv:
        _require(
            kv % attn_tp == 0 or attn_tp % kv == 0,
            "rollout.tp",
            f"rollout.tp/rollout.dp={attn_tp} attention ranks and model.num_key_value_heads={kv}: "
            "one must divide the other (SGLang splits or replicates key-value heads)",
        )
    experts = next((int(mc[k]) for k in ("num_experts", "num_local_experts", "n_routed_experts") if mc.get(k)), 0)
    if r.ep > 1:
        _require(
            experts > 0 and experts % r.ep == 0,
            "rollout.ep",
            f"rollout.ep={r.ep} does not divide the model's {experts} routed experts; choose a divisor",
        )


def _check_pools(cfg: RunConfig) -> None:
    r, c = cfg.rollout, cfg.cluster
    need = engine_devices(cfg)
    if c.placement == "colocated":
        _require(
            c.num_rollout_devices is None,
            "cluster.num_rollout_devices",
            "cluster.num_rollout_devices is for cluster.placement=disaggregated; colocated "
            "engines share the actor pool (cluster.num_actor_ranks); set it to null",
        )
        _require(
            need <= c.num_actor_ranks,
            "rollout.num_servers",
            f"rollout.num_servers*rollout.tp={r.num_servers}*{r.tp}={need} devices do not fit the "
            f"colocated pool of cluster.num_actor_ranks={c.num_actor_ranks} devices; lower them, "
            "raise cluster.num_actor_ranks, or use cluster.placement=disaggregated",
        )
    else:
        _require(
            r.release_memory is not True,
            "rollout.release_memory",
            "rollout.release_memory=true is for colocated engines, which share devices with "
            "the trainer; disaggregated engines keep their memory (set it to null or false)",
        )
        pool = c.num_rollout_devices if c.num_rollout_devices is not None else need
        _require(pool >= 1, "cluster.num_rollout_devices", f"cluster.num_rollout_devices={pool} must be >= 1")
        _require(
            need <= pool,
            "cluster.num_rollout_devices",
            f"rollout.num_servers*rollout.tp={r.num_servers}*{r.tp}={need} devices do not fit the "
            f"rollout pool of cluster.num_rollout_devices={pool}; raise it or lower the engines",
        )
    per_node = c.devices_per_node
    if per_node is not None:
        _require(per_node >= 1, "cluster.devices_per_node", f"cluster.devices_per_node={per_node} must be >= 1 or null")
        ranks_per_node = r.tp // r.nnodes
        _require(
            per_node % ranks_per_node == 0,
            "rollout.nnodes",
            f"an engine node holds rollout.tp/rollout.nnodes={r.tp}/{r.nnodes}={ranks_per_node} "
            f"devices, which must divide cluster.devices_per_node={per_node} so no engine node "
            f"straddles two machines; set rollout.nnodes={max(1, r.tp // per_node)} or change tp",
        )


def resolve_rollout(cfg: RunConfig) -> None:
    """Decide the auto fields in place: router, memory release, the rollout pool's size."""
    r, c = cfg.rollout, cfg.cluster
    if r.router is None:
        r.router = r.num_servers > 1
    if r.release_memory is None:
        r.release_memory = c.placement == "colocated" and not local_cpu_only(cfg)
    if c.placement == "disaggregated" and c.num_rollout_devices is None:
        c.num_rollout_devices = engine_devices(cfg)


def local_cpu_only(cfg: RunConfig) -> bool:
    """The run starts its own Ray cluster on a machine without CUDA: its "devices" are shares of
    host memory, so colocated engines have no device memory to give the trainer back while it
    runs, and releasing and resuming it would cost three round trips a step for nothing (~22 ms
    of the CPU quickstart's ~0.4 s step, benchmarks/profile_step.py). A cluster joined by address
    may have GPUs this host does not see: there the release stays on."""
    import torch

    return cfg.cluster.address is None and not torch.cuda.is_available()
