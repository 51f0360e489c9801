"""`megarl plan --search`: the layouts of a run on N devices, pruned by the memory model and ranked
by predicted step time.

The search runs in three passes, cheapest first:
1. trainer side: every actor layout (search_space.py) checked by megarl/config's layout rules, its
   worst stage's memory (memory.train_memory) against the device, and for each that fits, its
   log-prob and update time (steptime.trainer_time) per offload choice;
2. engine side: every rollout layout checked by check_rollout, its weights + KV pool, its
   generation and weight-sync time;
3. every pair whose memory lower bound fits (the phases of plan.make_plan without what only some
   runs add: reference, critic) ranked by the sum of its parts; the best pairs are then planned
   whole, from a config the full `validate` accepted, and that plan's numbers are the ones shown.
The step time ranked is the plan's total (`overlapped` for an asynchronous loop on pools of their
own, as `megarl plan` prints it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from megarl.config.loader import ConfigError
from megarl.config.schema import OffloadConfig
from megarl.config.validate_parallel import check_batch_sizes, check_critic, check_parallel, resolve_sequence_parallel
from megarl.config.validate_rollout import check_rollout, resolve_rollout
from megarl.perf import search_space as space
from megarl.perf.hardware import Device, GiB
from megarl.perf.memory import rollout_memory, train_memory
from megarl.perf.plan import make_plan, pool_sizes
from megarl.perf.steptime import StepTime, efficiency_of, generation_time, trainer_time
from megarl.perf.sync_model import as_json as sync_json
from megarl.perf.sync_model import sync_time

TERMS = ("generation", "log_prob", "update", "weight_sync")


@dataclass
class Candidate:
    layout: dict[str, object]  # dotted config keys -> values
    step: StepTime
    step_s: float
    tokens_per_s_per_device: float
    memory: dict[str, float]  # phase -> bytes per device (the plan's peaks)
    fits: bool = True
    weight_sync: dict = field(default_factory=dict)  # every transport's sync_model.predict, as JSON


@dataclass
class SearchResult:
    candidates: list[Candidate]  # fitting, fastest first
    planned: int  # layouts whose memory was predicted
    shipped: Candidate | None  # the config's own layout on the same devices, if its pools match
    refusal: str | None = None  # one line when nothing fits: the binding constraint
    notes: list[str] = field(default_factory=list)


def apply(cfg, overrides: dict[str, object]):
    """A copy of `cfg` with dotted `overrides` set."""
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = getattr(node, part)
        setattr(node, last, value)
    return out


def step_seconds(cfg, t: StepTime) -> float:
    """What the search ranks: the step's total, or the slower side of an asynchronous loop on pools
    of their own (what `megarl plan` prints for it)."""
    if cfg.trainer.mode != "sync" and cfg.cluster.placement == "disaggregated":
        return t.overlapped
    return t.total


def _tokens_per_s(cfg, mean: float, step_s: float, devices: int) -> float:
    rows = cfg.data.train_batch_size * cfg.rollout.n
    return rows * (cfg.data.max_prompt_length + mean) / step_s / devices


@dataclass
class _Side:
    overrides: dict[str, object]
    mem: object  # TrainMemory or RolloutMemory
    times: tuple  # trainer: (log_prob, update); engine: (generation, weight_sync)


class _Tracker:
    """The leanest thing seen per side, for the refusal when nothing fits."""

    def __init__(self):
        self.error: str | None = None
        self.least: dict[str, tuple[float, str, str]] = {}  # side -> (bytes, largest item, layout)

    def see(self, side: str, need: float, item: str, layout: str) -> None:
        if side not in self.least or need < self.least[side][0]:
            self.least[side] = (need, item, layout)


def _pool_cfg(base, placement: str, actors: int, rollout: int):
    over = {"cluster.placement": placement, "cluster.num_actor_ranks": actors}
    if placement == "disaggregated":
        over |= {"cluster.num_rollout_devices": rollout, "rollout.release_memory": None}
        if base.bridge.transport == "tensor":
            over["bridge.transport"] = "distributed"
    else:  # a colocated config keeps its own release setting; a disaggregated one's is auto (on)
        keep = base.rollout.release_memory if base.cluster.placement == "colocated" else None
        over |= {"cluster.num_rollout_devices": None, "rollout.release_memory": keep}
    return apply(base, over), over


def _trainer_side(cfg, hf, device: Device, mean: float, reserve: float, track: _Tracker) -> list[_Side]:
    eff, out = efficiency_of(device), []
    offloads = space.OFFLOADS if cfg.cluster.placement == "colocated" else {"none": space.OFFLOADS["none"]}
    for layout in space.actor_layouts(cfg.cluster.num_actor_ranks, hf, cfg.cluster.devices_per_node):
        c = apply(cfg, layout.overrides())
        try:
            check_parallel(c, hf)
            check_batch_sizes(c)
            check_critic(c, hf)
        except ConfigError as err:
            track.error = track.error or str(err)
            continue
        resolve_sequence_parallel(c)
        # the leanest variant first (full recompute, one row per micro-batch: the fewest
        # activations and logits); when even it overflows, no variant of the layout fits
        c.actor.recompute, c.actor.max_tokens_per_micro_batch = "full", space.micro_batch_budgets(c)[0]
        lean = train_memory(c, hf, device)
        if lean.peak + reserve > device.memory:
            items = {"actor params": lean.params, "actor grads": lean.grads, "actor optimizer": lean.optimizer}
            track.see("train", lean.peak + reserve, max(items, key=items.get), _show(layout.overrides()))
            continue
        for recompute in ("none", "full"):
            for budget in space.micro_batch_budgets(c):
                c.actor.recompute, c.actor.max_tokens_per_micro_batch = recompute, budget
                mem = train_memory(c, hf, device)
                items = {"actor params": mem.params, "actor grads": mem.grads, "actor optimizer": mem.optimizer}
                items |= {"actor activations": mem.activations, "actor logits": mem.logits}
                track.see("train", mem.peak + reserve, max(items, key=items.get), _show(layout.overrides()))
                if mem.peak + reserve > device.memory:
                    continue
                for off in offloads.values():
                    c.actor.offload = OffloadConfig(**off, host_optimizer=cfg.actor.offload.host_optimizer)
                    lp, upd, _, _ = trainer_time(c, hf, device, mem, mean, eff)
                    over = layout.overrides() | {
                        "actor.recompute": recompute,
                        "actor.max_tokens_per_micro_batch": budget,
                        **{f"actor.offload.{k}": v for k, v in off.items()},
                    }
                    out.append(_Side(over, mem, (lp, upd)))
    return out


def _engine_side(cfg, hf, device: Device, mean: float, pool: int, track: _Tracker) -> list[_Side]:
    eff, out = efficiency_of(device), []
    for over in space.rollout_layouts(cfg, pool, hf, cfg.cluster.devices_per_node):
        if cfg.bridge.transport == "tensor" and over["rollout.nnodes"] > 1:
            # megarl's tensor transport sends each host's engines from that host's trainer rank and
            # refuses an engine over several hosts: such a candidate syncs (and is priced) as
            # `distributed`, so every listed layout is one megarl runs
            over = {**over, "bridge.transport": "distributed"}
        c = apply(cfg, over)
        try:
            check_rollout(c, hf)
        except ConfigError as err:
            track.error = track.error or str(err)
            continue
        resolve_rollout(c)
        mem = rollout_memory(c, hf, device)
        track.see("generate", mem.weights + mem.reserve, "rollout weights", _show(over))
        if mem.kv_capacity <= 0 or mem.peak > device.memory:
            continue
        gen = generation_time(c, hf, device, mem, mean, eff)
        out.append(_Side(over, mem, (gen, sync_time(c, hf, device, mem, eff))))
    return out


def _bound(cfg, a: _Side, r: _Side) -> dict[str, float]:
    """Lower bounds of the plan's phase peaks (make_plan without reference and critic)."""
    t, e = a.mem, r.mem
    if cfg.cluster.placement != "colocated":
        return {"train": t.peak, "generate": e.peak}
    kept = t.reserve + sum(
        v
        for k, v in (("params", t.params), ("grads", t.grads), ("optimizer", t.optimizer))
        if not a.overrides[f"actor.offload.{k}"]
    )
    sync = t.params + t.reserve + e.weights + e.reserve + 2 * cfg.bridge.bucket_size_mb * 2**20
    return {"train": t.peak + e.reserve, "generate": kept + e.peak, "sync": sync}


def _pairs(cfg, trainer: list[_Side], engine: list[_Side], device: Device, track: _Tracker):
    """(predicted seconds, trainer side, engine side) of every pair whose bound fits."""
    out = []
    for r in engine:
        gen, sync = r.times
        for a in trainer:
            bound = _bound(cfg, a, r)
            worst = max(bound, key=bound.get)
            if bound[worst] > device.memory:
                track.see(
                    worst + " (trainer and engine together)", bound[worst], worst, _show(a.overrides | r.overrides)
                )
                continue
            lp, upd = a.times
            t = StepTime(gen, lp, upd, sync, 0.0, 0.0)
            out.append((step_seconds(cfg, t), a, r))
    return out


def _show(overrides: dict[str, object]) -> str:
    return " ".join(
        f"{k.split('.')[-1] if k.startswith('actor.parallel.') else k}={_val(v)}" for k, v in overrides.items()
    )


def _val(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def plan_candidate(cfg, hf: dict, device: Device, mean: float | None, mean_prompt: float | None = None):
    """(Candidate, plan) of a validated config: the numbers `megarl plan` prints for it."""
    plan = make_plan(cfg, hf, device, mean, mean_prompt=mean_prompt)
    s = step_seconds(cfg, plan.time)
    devices = sum(pool_sizes(cfg))
    memory = {name: plan.peak(name) for name in plan.phases}
    sync = sync_json(plan.weight_sync, cfg.bridge.transport)
    return Candidate(
        {}, plan.time, s, _tokens_per_s(cfg, plan.mean_response, s, devices), memory, plan.fits, sync
    ), plan


def ranked_layouts(cfg, hf: dict, count: int, device: Device, mean_response: float | None = None):
    """Every layout of `cfg` on `count` x `device` whose memory bound fits, as (predicted step
    seconds, layout overrides), fastest first; with the number of layouts planned and the tracker
    of what bound (for a refusal)."""
    mean = float(mean_response if mean_response is not None else cfg.rollout.max_new_tokens)
    track, pairs, planned = _Tracker(), [], 0
    for placement, actors, rollout in space.pool_splits(count, cfg.cluster.devices_per_node):
        pool_cfg, over = _pool_cfg(cfg, placement, actors, rollout)
        reserve = device.runtime_reserve if placement == "colocated" else 0.0
        trainer = _trainer_side(pool_cfg, hf, device, mean, reserve, track)
        engine = _engine_side(pool_cfg, hf, device, mean, rollout or actors, track)
        planned += len(trainer) + len(engine)
        for s, a, r in _pairs(pool_cfg, trainer, engine, device, track):
            pairs.append((s, a.overrides["actor.parallel.etp"], over | a.overrides | r.overrides))
    pairs.sort(key=lambda p: p[:2])  # a tie goes to etp=1: the model does not price etp's own gathers
    return [(s, layout) for s, _, layout in pairs], planned, track


def search(cfg, hf: dict, count: int, device: Device, top: int = 5, mean_response: float | None = None) -> SearchResult:
    """The `top` fastest layouts of validated `cfg` on `count` x `device` that fit, planned whole."""
    from megarl.config.validate import validate

    pairs, planned, track = ranked_layouts(cfg, hf, count, device, mean_response)
    found, alike, twins = [], set(), 0
    for _, layout in pairs:
        try:
            full = validate(apply(cfg, layout), hf)
        except ConfigError as err:
            track.error = track.error or str(err)
            continue
        cand, _ = plan_candidate(full, hf, device, mean_response)
        same = tuple(getattr(cand.step, k) for k in TERMS)
        if cand.fits and same in alike:
            twins += 1  # the model cannot tell it from one already listed (e.g. another pipeline split)
        elif cand.fits:
            alike.add(same)
            cand.layout = layout
            found.append(cand)
        if len(found) >= top:
            break
    found.sort(key=lambda c: c.step_s)
    shipped = plan_candidate(cfg, hf, device, mean_response)[0] if sum(pool_sizes(cfg)) == count else None
    result = SearchResult(found, planned, shipped)
    if twins:
        result.notes.append(f"{twins} layouts predicted alike to a listed one (same step times) are left out")
    if not found:
        result.refusal = _binding(cfg, hf, device, count, track)
    return result


def _binding(cfg, hf: dict, device: Device, count: int, track: _Tracker) -> str:
    """One line: the constraint no layout gets past."""
    where = f"{count} x {device.name} ({device.memory / GiB:.1f} GiB each)"
    if not track.least:
        return f"no layout on {where} passes the config's rules ({track.error}); change the devices or the batch sizes"
    order = ["train", "generate"] + [k for k in track.least if k not in ("train", "generate")]
    for side in order:
        if side not in track.least:
            continue
        need, item, layout = track.least[side]
        if need > device.memory:
            return (
                f"no layout fits {where}: the {side} phase needs at least {need / GiB:.1f} GiB per device "
                f"({item} is the largest; leanest layout {layout}); more devices (--devices)"
            )
    return f"no layout fits {where}: {track.error or 'every candidate overflows'}"


def loses_on(best: Candidate, other: Candidate) -> str:
    """The predicted term by which `other` is slower than `best` the most."""
    if other.step_s - best.step_s < 1e-3 * best.step_s:
        return "(a tie at the step's resolution)"
    diffs = {name: getattr(other.step, name) - getattr(best.step, name) for name in TERMS}
    name = max(diffs, key=diffs.get)
    return f"{name.replace('_', ' ')} +{diffs[name]:.1f} s" if diffs[name] > 0 else "-"


def as_json(result: SearchResult) -> dict:
    def one(c: Candidate) -> dict:
        return {
            "layout": c.layout,
            "step_s": c.step_s,
            "tokens_per_s_per_device": c.tokens_per_s_per_device,
            "fits": c.fits,
            "memory_gib": {k: v / GiB for k, v in c.memory.items()},
            "terms_s": {k: getattr(c.step, k) for k in TERMS},
            "weight_sync": c.weight_sync,
        }

    return {
        "candidates": [one(c) for c in result.candidates],
        "shipped_step_s": result.shipped.step_s if result.shipped else None,
        "shipped_fits": result.shipped.fits if result.shipped else None,
        "layouts_planned": result.planned,
    }


def format_search(cfg, result: SearchResult, device: Device, count: int, seconds: float) -> str:
    shipped = (
        f"the config's layout {result.shipped.step_s:.1f} s/step" + ("" if result.shipped.fits else " (does not fit)")
        if result.shipped
        else "the config's pools differ from --devices"
    )
    lines = [
        f"search: {count} x {device.name}, {result.planned:,} trainer and engine layouts planned in "
        f"{seconds:.1f} s; {shipped}",
        "",
        f"{'#':>2} {'step s':>8} {'tok/s/dev':>10} {'peak GiB':>9}  loses to #1 on",
    ]
    best = result.candidates[0]
    digits = 2 if best.step_s < 10 else 1
    for i, c in enumerate(result.candidates, 1):
        lines.append(
            f"{i:>2} {c.step_s:8.{digits}f} {c.tokens_per_s_per_device:10.1f} {max(c.memory.values()) / GiB:9.1f}  "
            f"{loses_on(best, c) if i > 1 else '(best)'}"
        )
        lines.append(f"     {_show(_changed(cfg, c.layout)) or '(the config as it is)'}")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


def _changed(cfg, layout: dict[str, object]) -> dict[str, object]:
    """The layout's keys whose value differs from the config's (what to pass as overrides)."""
    out = {}
    for key, value in layout.items():
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        auto = value is None and not key.endswith("_stage_layers")  # null: resolved by validate
        if node != value and not auto:
            out[key] = value
    return out


def run_search(cfg, hf: dict, devices: str | None, top: int, json_out: bool, mean_response: float | None):
    """`megarl plan --search`: (exit code, stdout text, one stderr line or None)."""
    import json
    import time

    from megarl.perf.hardware import parse_devices

    if not devices:
        return 2, None, "--search needs --devices COUNTxTYPE (e.g. 256xH100): the devices to lay the run out on"
    if top < 1:
        return 2, None, f"--top {top} must be >= 1"
    try:
        count, device = parse_devices(devices, cfg.cluster.devices_per_node or sum(pool_sizes(cfg)))
    except ValueError as err:
        return 2, None, str(err)
    start = time.perf_counter()
    try:
        result = search(cfg, hf, count, device, top, mean_response)
    except ValueError as err:  # e.g. a model type the FLOPs model does not know
        return 2, None, str(err)
    if result.refusal:
        return 2, None, f"does not fit: {result.refusal}"
    if json_out:
        return 0, json.dumps(as_json(result), indent=1), None
    return 0, format_search(cfg, result, device, count, time.perf_counter() - start), None


__all__ = [
    "Candidate",
    "SearchResult",
    "apply",
    "as_json",
    "format_search",
    "loses_on",
    "run_search",
    "search",
    "step_seconds",
]
