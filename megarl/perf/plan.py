"""`megarl plan`: memory per device in every phase of a step, the step's time, and a verdict.

A step's phases on one device:
- colocated: `train` (the actor's peak next to whatever else stays resident: the reference's
  parameters, the critic's and PRIME's PRM's state unless offloaded, the released engine's
  runtime), `critic train` / `prm train` (that model's peak next to the same), `generate` (the engine's
  weights + KV cache pool and runtime next to what the trainer keeps resident: its offload
  settings decide), `sync` (the engine's weights resumed next to the trainer's parameters and two
  buckets in flight);
- disaggregated: `train` on the actor pool, `generate` on the rollout pool.
A plan fits when every phase fits the device. When it does not, `refusal` names the one knob to
change: it tries single changes in a fixed order (the cheapest first) and names the first with
which the whole plan fits, or else the knob of the largest item in the phase that overflows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from megarl.perf.hardware import Device, GiB
from megarl.perf.memory import TrainMemory, reference_params_bytes, rollout_memory, train_memory
from megarl.perf.steptime import StepTime, _dtype, efficiency_of, step_time
from megarl.perf.sync_model import TransportTime, format_sync, predict


@dataclass
class Plan:
    devices: int
    device: Device
    phases: dict[str, dict[str, float]]  # phase -> item -> bytes per device
    train: TrainMemory
    time: StepTime | None
    kv_capacity: int
    kv_needed: int
    mean_response: float
    notes: list[str] = field(default_factory=list)
    weight_sync: dict[str, TransportTime] = field(default_factory=dict)  # every transport, when timed
    host: dict[str, float] = field(default_factory=dict)  # item -> host bytes per node (host_memory)

    def peak(self, phase: str) -> float:
        return sum(self.phases[phase].values())

    def overflows(self) -> list[str]:
        return [name for name in self.phases if self.peak(name) > self.device.memory]

    @property
    def fits(self) -> bool:
        return not self.overflows() and self.kv_capacity > 0


def pool_sizes(cfg) -> tuple[int, int]:
    """(actor devices, rollout devices of their own: 0 when colocated)."""
    c = cfg.cluster
    rollout = 0 if c.placement == "colocated" else (c.num_rollout_devices or cfg.rollout.num_servers * cfg.rollout.tp)
    return c.num_actor_ranks, rollout


def make_plan(
    cfg,
    hf: dict,
    device: Device,
    mean_response: float | None = None,
    timed: bool = True,
    mean_prompt: float | None = None,
) -> Plan:
    """The plan of a validated config `cfg` for model `hf` on `device` (cfg.cluster's pools);
    timed=False leaves the step time out (memory only: what `megarl train` checks). Memory is
    planned at the length limits; time at the mean lengths (default: the limits too)."""
    actor = train_memory(cfg, hf, device)
    rollout = rollout_memory(cfg, hf, device)
    resident = {}
    if cfg.ref.enabled and not cfg.ref.offload:
        resident["reference params"] = reference_params_bytes(cfg, hf)
    others = colocated_models(cfg, hf, device)
    for name, mem in others.items():
        resident[f"{name} resident"] = mem.resident(getattr(cfg, name).offload)
    trainer = {
        "actor params": actor.params,
        "actor grads": actor.grads,
        "actor optimizer": actor.optimizer,
        "actor activations": actor.activations,
        "actor logits": actor.logits,
        "trainer runtime": actor.reserve,
        **resident,
    }
    off = cfg.actor.offload
    kept = {
        "actor params": 0 if off.params else actor.params,
        "actor grads": 0 if off.grads else actor.grads,
        "actor optimizer": 0 if off.optimizer else actor.optimizer,
        "trainer runtime": actor.reserve,
        **resident,
    }
    engine = {"rollout weights + KV": rollout.pool, "rollout runtime": rollout.reserve}
    if cfg.cluster.placement == "colocated":
        released = {"rollout runtime": rollout.reserve} if cfg.rollout.release_memory else engine
        bucket = 2 * cfg.bridge.bucket_size_mb * 2**20
        phases = {
            "train": {**trainer, **released},
            "generate": {**{k: v for k, v in kept.items() if v}, **engine},
            "sync": {
                "actor params": actor.params,
                "trainer runtime": actor.reserve,
                **resident,
                "rollout weights": rollout.weights,
                "rollout runtime": rollout.reserve,
                "buckets in flight": bucket,
            },
        }
        for name, mem in others.items():  # its whole state, next to what the others keep resident
            phases[f"{name} train"] = {
                f"{name} params": mem.params,
                f"{name} grads": mem.grads,
                f"{name} optimizer": mem.optimizer,
                f"{name} activations": mem.activations,
                **({f"{name} logits": mem.logits} if mem.logits else {}),
                f"{name} runtime": mem.reserve,
                **{k: v for k, v in kept.items() if v and k != f"{name} resident"},
                **released,
            }
    else:
        phases = {"train": trainer, "generate": engine}
    mean = float(mean_response if mean_response is not None else cfg.rollout.max_new_tokens)
    t = None
    if timed:
        timing_cfg = cfg
        if mean_prompt is not None:
            timing_cfg = copy.deepcopy(cfg)
            timing_cfg.data.max_prompt_length = int(round(mean_prompt))
        t = step_time(timing_cfg, hf, device, actor, rollout, mean)
    plan = Plan(sum(pool_sizes(cfg)), device, phases, actor, t, rollout.kv_capacity, rollout.kv_needed, mean)
    if timed:
        plan.weight_sync = predict(cfg, hf, device, rollout, efficiency_of(device))
    plan.host = host_memory(cfg, hf, actor, others)
    plan.notes += _kv_notes(rollout)
    return plan


def _kv_notes(rollout) -> list[str]:
    if rollout.kv_capacity >= rollout.kv_needed:
        return []
    return [
        f"the KV cache holds {rollout.kv_capacity:,} tokens per engine, "
        f"{rollout.kv_capacity / max(rollout.kv_needed, 1):.0%} of the {rollout.kv_needed:,} "
        "that rollout.max_batch_size full-length sequences need: sequences that run long run fewer at "
        "once (the time is planned with as many as fit at the mean length)"
    ]


def colocated_models(cfg, hf: dict, device: Device) -> dict[str, TrainMemory]:
    """The trained models beside the actor on its ranks, by config section: the critic (PPO) and
    PRIME's implicit PRM (a causal LM with its own optimizer)."""
    out = {}
    if cfg.critic.enabled:
        out["critic"] = train_memory(cfg, hf, device, "critic")
    if cfg.algorithm.adv_estimator == "prime":
        out["prm"] = train_memory(cfg, hf, device, "prm")
    return out


def host_memory(cfg, hf: dict, actor: TrainMemory, others: dict[str, TrainMemory] | None = None) -> dict[str, float]:
    """Host memory per node that the trainer's state takes (beyond its processes): the host
    optimizer's share (actor.offload.host_optimizer) and what colocation offload parks there
    between phases, for the ranks of one node (cluster.devices_per_node, else the actor pool)."""
    ranks = min(cfg.cluster.devices_per_node or cfg.cluster.num_actor_ranks, cfg.cluster.num_actor_ranks)
    off = cfg.actor.offload
    per_rank = {
        "actor host optimizer": actor.host_optimizer,
        "actor params (offloaded)": actor.params if off.params else 0.0,
        "actor grads (offloaded)": actor.grads if off.grads else 0.0,
        "actor optimizer (offloaded)": actor.optimizer if off.optimizer else 0.0,
        "reference params (offloaded)": reference_params_bytes(cfg, hf) if cfg.ref.enabled and cfg.ref.offload else 0.0,
    }
    for name, mem in (others or {}).items():
        per_rank[f"{name} (offloaded)"] = mem.static + mem.reserve - mem.resident(getattr(cfg, name).offload)
    return {k: v * ranks for k, v in per_rank.items() if v}


# single changes tried, cheapest first, per overflowing phase: (dotted key, new value from cfg)
def _candidates(cfg, hf: dict, phase: str) -> list[tuple[str, object]]:
    a, p, r = cfg.actor, cfg.actor.parallel, cfg.rollout
    moe = any(hf.get(k) for k in ("num_experts", "n_routed_experts"))
    out: list[tuple[str, object]] = []
    if phase in ("train", "critic train", "prm train", "sync"):
        if not a.optim.use_distributed_optimizer:
            out.append(("actor.optim.use_distributed_optimizer", True))
        if getattr(a, "recompute", None) == "none":
            out.append(("actor.recompute", "full"))
        if a.max_tokens_per_micro_batch:
            out.append(("actor.max_tokens_per_micro_batch", a.max_tokens_per_micro_batch // 2))
        elif a.micro_batch_size > 1:
            out.append(("actor.micro_batch_size", a.micro_batch_size // 2))
        out += [("actor.parallel.pp", p.pp * 2)] + ([("actor.parallel.ep", p.ep * 2)] if moe else [])
        out += [("actor.parallel.tp", p.tp * 2)]
        if a.offload.host_optimizer < 1:  # last: the host Adam step and its PCIe traffic cost time
            out.append(("actor.offload.host_optimizer", 1.0))
    if phase in ("critic train", "prm train"):  # that model's own knobs first
        out += _model_candidates(cfg, phase.split()[0], moe)
    if phase in ("generate", "critic train", "prm train"):
        for item in ("optimizer", "grads", "params"):
            if not getattr(a.offload, item):
                out.append((f"actor.offload.{item}", True))
        if cfg.ref.enabled and not cfg.ref.offload:
            out.append(("ref.offload", True))
    if phase in ("generate", "sync") or phase == "kv":
        if r.backend == "sglang":
            frac = getattr(r, "mem_fraction_static", None)
            for f in (0.8, 0.7, 0.6, 0.5):
                if frac is None or f < frac:
                    out.append(("rollout.mem_fraction_static", f))
        out.append(("rollout.tp", r.tp * 2))
    return out


def _model_candidates(cfg, name: str, moe: bool) -> list[tuple[str, object]]:
    """The single changes that shrink a colocated model's own training peak (critic, prm)."""
    sec, p, out = getattr(cfg, name), getattr(cfg, name).parallel, []
    if not sec.optim.use_distributed_optimizer:
        out.append((f"{name}.optim.use_distributed_optimizer", True))
    if sec.recompute == "none":
        out.append((f"{name}.recompute", "full"))
    if sec.micro_batch_size > 1:
        out.append((f"{name}.micro_batch_size", sec.micro_batch_size // 2))
    out += [(f"{name}.parallel.pp", p.pp * 2)] + ([(f"{name}.parallel.ep", p.ep * 2)] if moe else [])
    return out + [(f"{name}.parallel.tp", p.tp * 2)]


def _set(cfg, key: str, value):
    out = copy.deepcopy(cfg)
    *path, last = key.split(".")
    node = out
    for part in path:
        node = getattr(node, part)
    if not hasattr(node, last):
        return None  # a knob this version does not have
    setattr(node, last, value)
    return out


def _with_change(cfg, hf: dict, device: Device, key: str, value, mean_response):
    from megarl.config.loader import ConfigError
    from megarl.config.validate import validate

    changed = _set(cfg, key, value)
    if changed is None:
        return None
    if key == "rollout.tp" and changed.rollout.backend == "sglang":
        changed.rollout.nnodes = max(1, changed.rollout.tp // (cfg.cluster.devices_per_node or changed.rollout.tp))
    try:
        changed = validate(changed, hf)
    except (ConfigError, ValueError, ZeroDivisionError):
        return None
    return make_plan(changed, hf, device, mean_response, timed=False)


def _fallback_knob(cfg, phase: str, items: dict) -> str:
    """The knob for the largest item when no single change fits: one not already at its limit."""
    a, p = cfg.actor, cfg.actor.parallel
    kept = {k: v for k, v in items.items() if k.startswith("actor ")}
    if phase == "generate" and kept:  # what the trainer keeps while the engine generates
        return f"actor.offload.{max(kept, key=kept.get).split()[1]}"
    item = max(items, key=items.get)
    owner = item.split()[0]
    if owner in ("critic", "prm"):
        knob = _colocated_knob(cfg, owner, item.split()[1])
        if knob is not None:
            return knob
    ep_room = p.ep * p.etp * p.pp < cfg.cluster.num_actor_ranks
    options = {
        "actor optimizer": [
            "actor.optim.use_distributed_optimizer" if not a.optim.use_distributed_optimizer else None,
            "actor.parallel.ep" if ep_room else None,
            "actor.offload.host_optimizer" if a.offload.host_optimizer < 1 and a.precision == "bf16" else None,
        ],
        "actor activations": [
            "actor.recompute" if getattr(a, "recompute", "full") != "full" else None,
            "actor.max_tokens_per_micro_batch",
            "actor.parallel.pp",
        ],
        "actor logits": ["actor.max_tokens_per_micro_batch", "actor.parallel.tp"],
        "actor params": ["actor.parallel.pp"],
        "actor grads": ["actor.parallel.pp"],
        "rollout weights + KV": ["rollout.mem_fraction_static"],
        "rollout weights": ["rollout.tp"],
        "reference params": ["ref.offload"],
    }.get(item, [])
    return next((k for k in options if k), "cluster.num_actor_ranks")


def _colocated_knob(cfg, owner: str, part: str) -> str | None:
    """The knob for a colocated model's (critic, prm) largest item, or None to fall through."""
    sec = getattr(cfg, owner)
    if part == "resident":  # its state kept between its updates: the largest part first, fp32
        # gradients (4 bytes a parameter) unless the optimizer's 12 are not sharded over data parallel
        order = (
            ("grads", "optimizer", "params")
            if sec.optim.use_distributed_optimizer
            else ("optimizer", "grads", "params")
        )
        return next((f"{owner}.offload.{k}" for k in order if not getattr(sec.offload, k)), None)
    if part == "activations":
        return f"{owner}.recompute" if sec.recompute != "full" else f"{owner}.micro_batch_size"
    if part == "optimizer" and not sec.optim.use_distributed_optimizer:
        return f"{owner}.optim.use_distributed_optimizer"
    if part in ("params", "grads", "optimizer"):
        return f"{owner}.parallel.pp"
    return None


def refusal(cfg, hf: dict, plan: Plan) -> str | None:
    """None when the plan fits; else one line: the phase that overflows, by how much, the knob."""
    bad = plan.overflows()
    phase = bad[0] if bad else ("kv" if plan.kv_capacity <= 0 else None)
    if phase is None:
        return None
    dev = plan.device
    if phase == "kv":
        what = (
            f"the rollout engine's weights ({plan.phases['generate'].get('rollout weights + KV', 0) / GiB:.1f} "
            f"GiB pool) leave no room for a KV cache on {dev.name}"
        )
    else:
        items = plan.phases[phase]
        top = max(items, key=items.get)
        what = (
            f"the {phase} phase needs {plan.peak(phase) / GiB:.1f} GiB per device of {dev.memory / GiB:.1f} GiB "
            f"on {dev.name} ({top} {items[top] / GiB:.1f} GiB is the largest)"
        )
    for key, value in _candidates(cfg, hf, phase):
        other = _with_change(cfg, hf, dev, key, value, plan.mean_response)
        if other is not None and other.fits:
            worst = max(other.phases, key=other.peak)
            return f"{what}; set {key}={_show(value)} (then {other.peak(worst) / GiB:.1f} GiB at the {worst} phase)"
    knob = "rollout.tp" if phase == "kv" else _fallback_knob(cfg, phase, plan.phases[phase])
    if knob == "cluster.num_actor_ranks":
        return f"{what}; no single change fits and the layout shards it as far as it goes: more devices (cluster.num_actor_ranks)"
    return f"{what}; no single change fits: start with {knob}, or more devices (cluster.num_actor_ranks)"


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def format_plan(cfg, plan: Plan) -> str:
    dev, t = plan.device, plan.time
    small = max(plan.peak(p) for p in plan.phases) < 4 * GiB
    unit, div = ("MiB", 2**20) if small else ("GiB", GiB)
    lines = [
        f"plan: {plan.devices} x {dev.name} ({dev.memory / GiB:.1f} GiB each), "
        f"{cfg.cluster.placement}; mean response {plan.mean_response:.0f} tokens "
        f"(max {cfg.rollout.max_new_tokens})",
        "",
        f"memory per device ({unit}; the actor's worst pipeline stage is stage {plan.train.stage}, "
        f"{plan.train.in_flight:g} micro-batches of {plan.train.tokens:,} tokens in flight):",
    ]
    for phase, items in plan.phases.items():
        peak = plan.peak(phase)
        mark = "ok" if peak <= dev.memory else "DOES NOT FIT"
        lines.append(f"  {phase:<13} {peak / div:8.1f}  {mark}")
        for name, value in items.items():
            if value:
                lines.append(f"      {name:<24} {value / div:8.2f}")
    lines.append(
        f"  KV cache: {plan.kv_capacity:,} tokens per engine, {plan.kv_needed:,} wanted "
        "(rollout.max_batch_size sequences at full length)"
    )
    if plan.host:
        ranks = min(cfg.cluster.devices_per_node or cfg.cluster.num_actor_ranks, cfg.cluster.num_actor_ranks)
        lines.append(f"  host memory per node ({ranks} ranks): {sum(plan.host.values()) / div:.1f} {unit}")
        lines += [f"      {name:<28} {value / div:8.2f}" for name, value in plan.host.items()]
    lines += [f"note: {n}" for n in plan.notes]
    if t is None:
        return "\n".join(lines)
    mfu = update_mfu(cfg, plan) if t.update else 0.0
    lines = lines[: len(lines) - len(plan.notes)]
    digits = 2 if t.total < 10 else 1
    lines += [
        "",
        "step time (s):",
        f"  generation   {t.generation:10.{digits}f}",
        f"  log-probs    {t.log_prob:10.{digits}f}",
        f"  update       {t.update:10.{digits}f}   (predicted update MFU {mfu:.2f})",
        f"  weight sync  {t.weight_sync:10.{digits}f}",
        f"  total        {t.total:10.{digits}f}",
    ]
    if cfg.trainer.mode != "sync" and cfg.cluster.placement == "disaggregated":
        lines.append(
            f"  {cfg.trainer.mode}: {t.overlapped:.{digits}f} (the slower side: generation and training overlap)"
        )
    if plan.weight_sync:
        lines += ["", *format_sync(plan.weight_sync, cfg.bridge.transport)]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def plan_json(cfg, plan: Plan) -> dict:
    """`megarl plan --json`: the plan's numbers, machine-readable."""
    from megarl.perf.sync_model import as_json

    t = plan.time
    return {
        "devices": plan.devices,
        "device": plan.device.name,
        "placement": cfg.cluster.placement,
        "fits": plan.fits,
        "memory_gib": {name: plan.peak(name) / GiB for name in plan.phases},
        "kv_capacity": plan.kv_capacity,
        "step_s": t.total if t else None,
        "terms_s": {k: getattr(t, k) for k in ("generation", "log_prob", "update", "weight_sync")} if t else {},
        "weight_sync": as_json(plan.weight_sync, cfg.bridge.transport),
        "notes": list(plan.notes),
    }


def update_mfu(cfg, plan: Plan) -> float:
    t = plan.time
    return t.train_flops / (t.update * cfg.cluster.num_actor_ranks * plan.device.peak_flops(_dtype(cfg, plan.device)))


def run_device(cfg) -> tuple[Device | None, str | None]:
    """The device a run's pools are made of: cluster.device_type, else this host's first CUDA
    device, else this host's CPU share; (None, why) when it cannot be known from here."""
    from megarl.perf.hardware import GPUS, canonical_device, cpu_device

    kind = cfg.cluster.device_type
    if kind is None:
        import torch

        if torch.cuda.is_available():
            kind = torch.cuda.get_device_name(0)
        elif cfg.cluster.address is not None:
            return None, (
                "memory check skipped: this head node has no GPU to say which devices the cluster "
                "has; set cluster.device_type (e.g. H100) to check before start"
            )
        else:
            kind = "CPU"
    key = canonical_device(kind)
    if key is None:
        return None, f"memory check skipped: no planner entry for device {kind!r}"
    if key == "CPU":
        on_node = cfg.cluster.devices_per_node or sum(pool_sizes(cfg))
        return cpu_device(on_node, peak=0.0), None  # memory only: no FLOP/s needed
    return GPUS[key], None
