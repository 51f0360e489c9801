"""The layouts `megarl plan --search` tries: per-dimension values, each list already cut to what the
model and the device count allow, so the search never builds a layout that only validation would
throw away.

Actor (Megatron): tp over the divisors of a node's devices (a tensor-parallel group stays in a
node), pp over the divisors of the ranks left (up to the layer count) with every pipeline split whose largest
stage is as small as that pp allows (uneven first / last stages for depths like 61 or 94), vpp 1 or
2, cp 1 or 2, ep over the powers of two dividing the routed experts and the ranks of one stage,
etp 1 or tp, sequence parallel auto (on with tp > 1; also off for dense models), recompute none or
full (selective is planned as none: with flash attention it saves nothing the model counts), a
micro-batch token budget of 1, 2 or 4 full-length rows (and the config's own), and what is
offloaded while the engines generate (nothing, the optimizer, or everything).

Rollout (SGLang): engines of tp devices for tp a power of two, as many engines as the pool holds
(and the config's own count), expert parallel 1 or tp, DP attention 1 or tp.

Pools: colocated on every device, or disaggregated with a quarter or a half of the devices (whole
nodes) for the engines.

Every layout is still checked by megarl/config's own rules (check_parallel, check_batch_sizes,
check_rollout) before it is planned, and the finalists by the full `validate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from megarl.config.loader import ConfigError
from megarl.config.schema import ParallelConfig
from megarl.config.validate_parallel import num_experts
from megarl.config.validate_pipeline import stage_layers

OFFLOADS = {
    "none": dict(params=False, grads=False, optimizer=False),
    "optimizer": dict(params=False, grads=False, optimizer=True),
    "all": dict(params=True, grads=True, optimizer=True),
}


def powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(max(limit, 1).bit_length()) if 2**i <= limit]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@cache
def stage_splits(layers: int, pp: int, vpp: int) -> tuple[tuple[int | None, int | None], ...]:
    """(first_stage_layers, last_stage_layers) of every split of `layers` over pp stages whose
    largest stage is the smallest possible, one per distinct list of stage sizes (the even split,
    then None before a number, names a list first)."""
    if pp == 1:
        return ((None, None),) if vpp == 1 else ()
    top = math.ceil(layers / pp)
    found: dict[tuple[int, ...], tuple[int | None, int | None]] = {}
    ends = [None, *range(1, top + vpp + 1)]
    for first in ends:
        for last in ends:
            p = ParallelConfig(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
            try:
                sizes = tuple(stage_layers(p, layers))
            except ConfigError:
                continue
            found.setdefault(sizes, (first, last))
    if not found:
        return ()
    least = min(max(s) for s in found)
    return tuple(v for s, v in found.items() if max(s) == least)


@dataclass(frozen=True)
class ActorLayout:
    tp: int
    pp: int
    vpp: int
    cp: int
    ep: int
    etp: int
    first: int | None
    last: int | None
    sequence_parallel: bool | None  # None: auto (on iff tp > 1)

    def overrides(self) -> dict[str, object]:
        p = "actor.parallel."
        return {
            p + "tp": self.tp,
            p + "pp": self.pp,
            p + "vpp": self.vpp,
            p + "cp": self.cp,
            p + "ep": self.ep,
            p + "etp": self.etp,
            p + "first_stage_layers": self.first,
            p + "last_stage_layers": self.last,
            p + "sequence_parallel": self.sequence_parallel,
        }


def actor_layouts(world: int, hf: dict, per_node: int | None) -> list[ActorLayout]:
    """Structural actor layouts on `world` ranks that pass the divisibility rules cheaply checked
    here; megarl/config's check_parallel has the last word on each."""
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    layers = hf["num_hidden_layers"]
    experts = num_experts(hf)
    out = []
    for tp in powers_of_two(min(per_node or world, world)):
        if heads % tp or kv % tp:
            continue
        sps: list[bool | None] = [None] + ([False] if tp > 1 and not experts else [])
        for cp in (1, 2):
            for pp in divisors(world // (tp * cp)):
                if pp > layers:
                    continue
                per_stage = world // pp
                eps = [e for e in powers_of_two(per_stage) if experts and experts % e == 0] or [1]
                for vpp in (1, 2):
                    for first, last in stage_splits(layers, pp, vpp):
                        for ep in eps:
                            for etp in sorted({1, tp}):
                                if per_stage % (ep * etp) or (etp > 1 and not experts):
                                    continue
                                for sp in sps:
                                    out.append(ActorLayout(tp, pp, vpp, cp, ep, etp, first, last, sp))
    return out


def micro_batch_budgets(cfg) -> list[int]:
    """Token budgets per micro-batch: 1, 2 and 4 full-length rows, and the config's own."""
    row = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    own = cfg.actor.max_tokens_per_micro_batch
    return sorted({row, 2 * row, 4 * row} | ({own} if own else set()))


def rollout_layouts(cfg, pool: int, hf: dict, per_node: int | None) -> list[dict[str, object]]:
    """Engine layouts on a pool of `pool` devices, as dotted overrides."""
    r = cfg.rollout
    sglang = r.backend == "sglang"
    out = []
    for tp in powers_of_two(pool):
        engines = sorted({pool // tp} | ({r.num_servers} if r.tp == tp and r.num_servers * tp <= pool else set()))
        nnodes = max(1, tp // per_node) if per_node else 1
        # the config's own kind first (expert parallel or not): the model prices rollout ep not at
        # all, so a tie keeps it
        eps = sorted({1, tp}, key=lambda v: (v != (tp if r.ep > 1 else 1), v)) if sglang and num_experts(hf) else [1]
        for ep in eps:
            for dp in sorted({1, tp}) if sglang else [1]:
                for n in engines:
                    out.append(
                        {
                            "rollout.tp": tp,
                            "rollout.num_servers": n,
                            "rollout.nnodes": nnodes,
                            "rollout.ep": ep,
                            "rollout.dp": dp,
                        }
                    )
    own = {k: getattr(r, k.split(".")[1]) for k in out[0]} if out else {}
    if own and own["rollout.num_servers"] * own["rollout.tp"] <= pool and own not in out:
        out.append(own)
    return out


def pool_splits(count: int, per_node: int | None) -> list[tuple[str, int, int]]:
    """(placement, actor devices, rollout devices): colocated, then a quarter and a half of the
    devices (whole nodes) for disaggregated engines."""
    out = [("colocated", count, 0)]
    node = per_node or 1
    for share in (4, 2):
        rollout = count // share
        if rollout >= 1 and rollout % node == 0 and count % share == 0:
            out.append(("disaggregated", count - rollout, rollout))
    return out
