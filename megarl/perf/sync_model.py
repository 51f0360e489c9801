"""Weight sync, predicted per transport: seconds per named bound, their total, the one that dominates.

A sync moves the trainer's bf16 weights (B bytes in T Hugging Face tensors) into every rollout
engine (E engines of R ranks; each rank keeps `rollout_memory(...).weights` bytes). Each transport
is priced from what megarl/bridge does, as four bounds and a fixed cost:

- links: the bytes that cross the busiest link over its bandwidth (a GPU's NIC between nodes,
  NVLink inside one, the filesystem for `disk`);
- gather: assembling full HF tensors on the trainer (pipeline broadcasts, TP / EP all-gathers);
- engine_load: an engine rank copying what it received into its parameters (HBM, twice its shard);
- per_tensor: fixed costs per tensor (or per piece for `reshard`) and per request (a bucket);
- fixed: eff.phase_s, once.

Per transport (buckets pipeline, so byte-bound terms overlap where the code overlaps them; the
per-tensor and per-request work is on the critical path and adds):

- tensor: every trainer rank materialises every full tensor (export_weights: each pipeline stage
  broadcasts its tensors over the PP group, then EP and TP all-gathers); engine ranks get handles
  (CUDA IPC) and copy their slices over NVLink from the sender's GPU while the next bucket is
  gathered: max(gather, links, engine_load). Handles open only on the sender's host.
- distributed: every owner (a stage's TP-0 rank, each EP owner) TP-gathers its own tensors and
  broadcasts them bucket by bucket to every engine rank (each receives all B bytes); buckets of
  different senders take turns and the next waits until the engines loaded the last:
  max(gather, links + engine_load).
- reshard: every trainer rank sends exactly the boxes engine ranks need from its own shard, no
  gathers; an engine rank receives its shard from many senders: max(links, engine_load), where links
  is the larger of the busiest sender's and a receiver's bytes. Per piece, not per tensor.
- disk: rank 0 writes a checkpoint that every engine reads (gather as tensor's, links = write +
  read at DISK_BW).

Constants: Efficiency.tensor_s is the cost of a tensor handled on its own (its own broadcast and
request: verl's Qwen3-30B-A3B sync without its checkpoint engine). BUCKETED_SHARE of it stays
when tensors travel in buckets (verl's bucketed checkpoint engine on the same runs: 0.13 and 0.25
ms per tensor left after the link time, 30B and 235B); REQUEST_S per bucket; PIECE_SHARE of it per
reshard piece (an assumption: one copy launch and its bookkeeping, no collective, no request; the
only published reshard-class sync, NeMo-RL's DeepSeek-V3 at ~2.4 s, checks it). Predictions
against the published syncs: benchmarks/RESULTS.md, "Weight sync per transport".
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field

from megarl.perf.flops import _as_dict, count_params, layer_params
from megarl.perf.hardware import Device

TRANSPORTS = ("tensor", "distributed", "reshard", "disk")
BOUNDS = ("links", "gather", "engine_load", "per_tensor", "fixed")
BUCKETED_SHARE = 0.25  # of Efficiency.tensor_s, per tensor when tensors travel in buckets (GPU)
PIECE_SHARE = 1 / 30  # of Efficiency.tensor_s, per reshard piece on its busiest rank (~25 us on GPU)
REQUEST_S = 4e-3  # one bucket's request round trip to the engines (the embedded engine's commit: ~4 ms)
DISK_BW = 2e9  # bytes/s a checkpoint is written or read at (a node's parallel filesystem share)


@dataclass(frozen=True)
class TransportTime:
    """One transport's predicted sync: seconds per bound, their total (None: not applicable),
    the bound that dominates, and why it is not applicable or what it needs that the run lacks."""

    transport: str
    s: float | None
    terms_s: dict[str, float] = field(default_factory=dict)
    bound: str | None = None
    why: str | None = None
    usable: bool = True  # False: predicted, but this run cannot use it as configured (see why)

    def as_json(self, used: bool) -> dict:
        out = {"s": self.s, "bound": self.bound, "terms_s": dict(self.terms_s), "used": used}
        if self.why:
            out["why"] = self.why
        if not self.usable or self.s is None:
            out["usable"] = False
        return out


@dataclass(frozen=True)
class _Model:
    bytes: float  # bf16
    expert_bytes: float
    tensors: int
    expert_tensors: int

    @property
    def dense_bytes(self) -> float:
        return self.bytes - self.expert_bytes

    @property
    def dense_tensors(self) -> int:
        return self.tensors - self.expert_tensors


def hf_tensor_count(hf: dict) -> int:
    """Tensors of the model's Hugging Face checkpoint (what a weight sync names one by one)."""
    hf = _as_dict(hf)
    mt = hf["model_type"]
    n = 2 + (0 if hf.get("tie_word_embeddings") else 1)  # embedding, final norm, LM head
    if mt == "deepseek_v3":
        attn = 4 + (3 if hf.get("q_lora_rank") else 1)  # kv_a, kv_a_norm, kv_b, o + q (a, a_norm, b)
    else:
        attn = 4 + (3 if mt == "qwen2" or hf.get("attention_bias") else 0) + (2 if mt in ("qwen3", "qwen3_moe") else 0)
    for i in range(hf["num_hidden_layers"]):
        lp = layer_params(hf, i)
        if lp.experts:
            mlp = 1 + 3 * lp.experts + (3 if hf.get("n_shared_experts") else 0) + (mt == "deepseek_v3")
        else:
            mlp = 3
        n += 2 + attn + mlp  # + the two norms
    return n


def _model(hf: dict) -> _Model:
    hf = _as_dict(hf)
    layers = [layer_params(hf, i) for i in range(hf["num_hidden_layers"])]
    experts = sum(lp.experts * lp.expert for lp in layers)
    return _Model(
        count_params(hf).total * 2.0, experts * 2.0, hf_tensor_count(hf), sum(3 * lp.experts for lp in layers)
    )


@dataclass(frozen=True)
class _Mesh:
    """Both sides' layouts, in the numbers the bounds need."""

    world: int  # trainer ranks
    tp: int
    pp: int
    ep: int
    etp: int
    cp: int
    engines: int
    rtp: int  # ranks per engine
    rep: int  # experts split over this many ranks of an engine (1: each rank a slice of every expert)
    per_node: int
    colocated: bool
    bucket: float  # bytes
    backend: str

    @property
    def engine_ranks(self) -> int:
        return self.engines * self.rtp

    @property
    def devices(self) -> int:
        return self.world if self.colocated else self.world + self.engine_ranks


def _mesh(cfg, devices_per_node: int | None) -> _Mesh:
    p, r, c = cfg.actor.parallel, cfg.rollout, cfg.cluster
    colocated = c.placement == "colocated"
    rollout = 0 if colocated else (c.num_rollout_devices or r.num_servers * r.tp)
    per_node = devices_per_node or c.devices_per_node or (c.num_actor_ranks + rollout)
    rep = r.ep if r.backend == "sglang" else 1  # the embedded engine slices every expert by tp
    return _Mesh(
        max(c.num_actor_ranks, 1),
        max(p.tp, 1),
        max(p.pp, 1),
        max(p.ep, 1),
        max(p.etp, 1),
        max(p.cp, 1),
        max(r.num_servers, 1),
        max(r.tp, 1),
        max(rep, 1),
        max(per_node, 1),
        colocated,
        cfg.bridge.bucket_size_mb * 2**20,
        r.backend,
    )


def _bw(device: Device, eff, span: int, per_node: int) -> float:
    """A group of `span` devices: NVLink when it fits a node, else each device's NIC."""
    return (device.nvlink_bw if span <= per_node else device.net_bw) * eff.link


def _tensor_cost(device: Device, eff, alone: bool) -> float:
    """Seconds per tensor: whole when each tensor is its own request; in buckets, the share that
    stays (the CPU constant was timed on megarl's own bucketed transports: whole)."""
    return eff.tensor_s if alone or device.name == "CPU" else eff.tensor_s * BUCKETED_SHARE


def _finish(name: str, terms: dict[str, float], total: float, why: str | None = None, usable: bool = True):
    bound = max(terms, key=terms.get)
    return TransportTime(name, total, terms, bound, why, usable)


def _full_gather(m: _Model, mesh: _Mesh, device: Device, eff) -> float:
    """Every rank materialises every full tensor (export_weights): each stage's tensors broadcast
    over the PP group, experts all-gathered over EP, then TP / expert-TP all-gathers."""
    nvlink = device.nvlink_bw * eff.link
    pp = m.bytes * (mesh.pp - 1) / mesh.pp / _bw(device, eff, mesh.world if mesh.pp > 1 else 1, mesh.per_node)
    stage_experts = m.expert_bytes / mesh.pp
    ep = stage_experts * (mesh.ep - 1) / mesh.ep / _bw(device, eff, mesh.ep * mesh.etp, mesh.per_node)
    tp = (m.dense_bytes / mesh.pp * (mesh.tp - 1) / mesh.tp) / nvlink
    etp = (stage_experts / mesh.ep * (mesh.etp - 1) / mesh.etp) / nvlink
    return pp + ep + tp + etp


def _tensor(m, mesh, device, eff, shard: float, alone: bool) -> TransportTime:
    if not mesh.colocated and mesh.devices > mesh.per_node:
        return TransportTime(
            "tensor",
            None,
            why="not applicable: the engines are on devices of their own, on other hosts; "
            "CUDA IPC handles open only on the sender's host (cluster.placement=disaggregated)",
        )
    readers = min(mesh.per_node, mesh.engine_ranks)  # engine ranks reading the sender GPU's buckets
    buckets = 0 if alone else math.ceil(m.bytes / mesh.bucket)
    terms = {
        "links": readers * shard / (device.nvlink_bw * eff.link),
        "gather": _full_gather(m, mesh, device, eff),
        "engine_load": 2 * shard / (device.hbm_bw * eff.decode_bw),
        "per_tensor": m.tensors * _tensor_cost(device, eff, alone) + buckets * REQUEST_S,
        "fixed": eff.phase_s,
    }
    total = max(terms["gather"], terms["links"], terms["engine_load"]) + terms["per_tensor"] + terms["fixed"]
    why = None
    if mesh.engine_ranks > mesh.per_node:
        why = (
            "an engine spans hosts (rollout.nnodes > 1): megarl's tensor transport sends each host's "
            "engines from that host's trainer rank, and one request cannot carry handles made on "
            "several hosts yet; priced as SGLang allows it (each engine rank a handle from its "
            "co-located trainer rank, gathered into one request)"
        )
    return _finish("tensor", terms, total, why, usable=why is None)


def _distributed(m, mesh, device, eff, shard: float, alone: bool) -> TransportTime:
    senders = mesh.pp * (mesh.ep if m.expert_tensors else 1)  # each stage's dense owner, each EP owner
    span = mesh.engine_ranks + (0 if mesh.colocated else 1)
    nvlink = device.nvlink_bw * eff.link
    gather = (
        m.dense_bytes / mesh.pp * (mesh.tp - 1) / mesh.tp
        + m.expert_bytes / (mesh.pp * mesh.ep) * (mesh.etp - 1) / mesh.etp
    ) / nvlink  # owners gather in parallel, over TP / expert-TP only
    buckets = 0 if alone else math.ceil(m.bytes / mesh.bucket) + senders
    terms = {
        "links": m.bytes / _bw(device, eff, span, mesh.per_node),  # every engine rank receives all of it
        "gather": gather,
        "engine_load": 2 * shard / (device.hbm_bw * eff.decode_bw),
        "per_tensor": m.tensors * _tensor_cost(device, eff, alone) + buckets * REQUEST_S,
        "fixed": eff.phase_s,
    }
    total = max(gather, terms["links"] + terms["engine_load"]) + terms["per_tensor"] + terms["fixed"]
    return _finish("distributed", terms, total)


def reshard_pieces(m: _Model, mesh: _Mesh) -> tuple[float, float]:
    """(pieces an engine rank receives, pieces the average trainer rank sends): one per HF tensor
    box an engine rank holds, times the trainer slices that overlap it."""
    moe_tp = max(mesh.rtp // mesh.rep, 1)
    per_rank = m.dense_tensors * max(1.0, mesh.tp / mesh.rtp) + m.expert_tensors / mesh.rep * max(
        1.0, mesh.etp / moe_tp
    )
    return per_rank, per_rank * mesh.engine_ranks / mesh.world


def _reshard(m, mesh, device, eff, shard: float) -> TransportTime:
    per_sender = shard * mesh.engine_ranks / mesh.world  # data-parallel replicas share the sending
    received, sent = reshard_pieces(m, mesh)
    terms = {
        "links": max(per_sender, shard) / _bw(device, eff, mesh.devices, mesh.per_node),
        "gather": 0.0,
        "engine_load": 2 * shard / (device.hbm_bw * eff.decode_bw),  # stage into spares, swap on commit
        "per_tensor": max(received, sent) * eff.tensor_s * PIECE_SHARE + REQUEST_S,
        "fixed": eff.phase_s,
    }
    total = max(terms["links"], terms["engine_load"]) + terms["per_tensor"] + terms["fixed"]
    why = None
    if mesh.backend == "sglang":
        why = (
            "needs megarl's receiver (rollout.backend=embedded): stock SGLang takes no per-rank "
            "shards from many senders (docs/bridge.md, 'Weight sync at scale')"
        )
    return _finish("reshard", terms, total, why, usable=why is None)


def _disk(m, mesh, device, eff, shard: float, alone: bool) -> TransportTime:
    terms = {
        "links": 2 * m.bytes / (DISK_BW * eff.link),  # written once, read by the engines
        "gather": _full_gather(m, mesh, device, eff),
        "engine_load": 2 * shard / (device.hbm_bw * eff.decode_bw),
        "per_tensor": m.tensors * _tensor_cost(device, eff, alone) + REQUEST_S,
        "fixed": eff.phase_s,
    }
    total = max(terms["gather"], terms["links"]) + terms["engine_load"] + terms["per_tensor"] + terms["fixed"]
    return _finish("disk", terms, total)


def predict(
    cfg, hf: dict, device: Device, rollout_mem, eff, devices_per_node: int | None = None, alone: bool = False
) -> dict[str, TransportTime]:
    """Every transport's predicted sync for config `cfg` (its trainer and engine layouts) on
    `device`. `alone`: price each tensor as its own request (a sync that does not bucket)."""
    m, mesh, shard = _model(hf), _mesh(cfg, devices_per_node), rollout_mem.weights
    return {
        "tensor": _tensor(m, mesh, device, eff, shard, alone),
        "distributed": _distributed(m, mesh, device, eff, shard, alone),
        "reshard": _reshard(m, mesh, device, eff, shard),
        "disk": _disk(m, mesh, device, eff, shard, alone),
    }


def sync_time(cfg, hf: dict, device: Device, rollout_mem, eff) -> float:
    """The configured transport's predicted seconds (distributed's where it cannot apply)."""
    times = predict(cfg, hf, device, rollout_mem, eff)
    own = times[cfg.bridge.transport]
    return own.s if own.s is not None else times["distributed"].s


def as_json(times: dict[str, TransportTime], used: str) -> dict:
    return {name: t.as_json(name == used) for name, t in times.items()}


def format_sync(times: dict[str, TransportTime], used: str) -> list[str]:
    """The plan's weight-sync block: each transport's seconds, its dominant bound, its terms."""
    lines = ["weight sync per transport (s; the bound that dominates; its terms):"]
    for name, t in times.items():
        mark = "  <- bridge.transport" if name == used else ""
        if t.s is None:
            lines += textwrap.wrap(f"  {name:<12} {'-':>8}  {t.why}{mark}", 100, subsequent_indent=" " * 25)
            continue
        digits = 2 if t.s < 10 else 1
        terms = ", ".join(f"{k.replace('_', ' ')} {v:.{2 if v < 10 else 0}f}" for k, v in t.terms_s.items() if v)
        lines.append(f"  {name:<12} {t.s:8.{digits}f}  {t.bound.replace('_', ' '):<12} ({terms}){mark}")
        if t.why:
            lines += textwrap.wrap(t.why, 100, initial_indent=" " * 25, subsequent_indent=" " * 25)
    return lines
