"""The reshard plan: which trainer rank sends which bytes of which HF tensor to which rollout rank.

A pure function of two descriptions: the trainer side (`TensorSource`: the box of every full HF
tensor that each trainer rank can produce from its own Megatron shard; equal boxes are replicas,
distinct boxes tile the tensor) and each engine's `GET /get_parallelism_config` answer (the box
each rollout rank holds). Intersected tensor by tensor they give the transfers: every rollout rank
receives exactly the bytes it owns, from all the trainer ranks that hold them, at once; among
replicas the least loaded rank sends. Transfers from one sender to one receiver are packed into
bounded buckets (`Message`s), one contiguous buffer per point-to-point send. Every process computes
the same plan from the same inputs (no randomness, no set order), so senders and receivers agree on
tags, offsets and sizes without talking.

Boxes are `((start, stop), ...)`, one per dim of the full tensor, stop exclusive ("global coords").
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

from megarl.bridge.boxes import ALIGN, Box, box_numel, full_box, intersect, itemsize, relative  # noqa: F401


# ---- the two descriptions --------------------------------------------------------------------------
@dataclass(frozen=True)
class SourcePiece:
    """Trainer rank `rank` can produce `box` of the full HF tensor from its own Megatron shard."""

    rank: int
    box: Box

    def __post_init__(self):  # boxes may arrive as JSON lists; they are compared and hashed as tuples
        object.__setattr__(self, "box", tuple([(int(a), int(b)) for a, b in self.box]))


@dataclass(frozen=True)
class TensorSource:
    """Where one full HF tensor lives on the trainer side; `dtype` is what travels ("bfloat16")."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[SourcePiece, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple([int(s) for s in self.shape]))
        object.__setattr__(self, "pieces", tuple(self.pieces))


def _replica_groups(source: TensorSource) -> list[tuple[Box, list[int]]]:
    """The tensor's distinct boxes, each with the ranks that hold it, checked to tile the tensor."""
    name, shape = source.name, source.shape
    itemsize(source.dtype, name)
    if not source.pieces:
        raise ValueError(f"{name}: no trainer rank holds any of it; give it at least one SourcePiece")
    groups: dict[Box, list[int]] = {}
    box_of: dict[int, Box] = {}  # a sender finds what to slice by (rank, name): one box per rank
    for piece in source.pieces:
        rank, box = piece.rank, piece.box
        if box_of.setdefault(rank, box) != box:
            raise ValueError(
                f"{name}: trainer rank {rank} lists two boxes, {box_of[rank]} and {box}; give "
                "each rank one box per tensor (the rows it can produce must be contiguous)"
            )
        holders = groups.get(box)
        if holders is None:
            if len(box) != len(shape) or not all(0 <= a <= b <= s for (a, b), s in zip(box, shape)):
                raise ValueError(
                    f"{name}: trainer rank {rank}'s box {box} is not within the tensor's shape "
                    f"{shape}; a box is one [start, stop) per dim of the full HF tensor"
                )
            holders = groups[box] = []
        if rank not in holders:
            holders.append(rank)
    boxes = list(groups)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if intersect(a, b) is not None:
                raise ValueError(
                    f"{name}: trainer boxes {a} and {b} overlap; replicas must list identical "
                    "boxes and distinct boxes must not share elements"
                )
    covered, numel = sum(box_numel(b) for b in boxes), box_numel(full_box(shape))
    if covered != numel:
        raise ValueError(
            f"{name}: the trainer pieces cover {covered} of its {numel} elements (a gap); every "
            "element needs a trainer rank that can produce it"
        )
    return list(groups.items())


def _rank_params(layout: dict, engine: int) -> list[dict]:
    """Each rank's `params` (name -> slice entry) in one engine's layout, indexed by rank."""
    ranks = sorted(layout["ranks"], key=lambda r: r["rank"])
    if [r["rank"] for r in ranks] != list(range(len(ranks))):
        raise ValueError(
            f"engine {engine}: layout ranks {[r['rank'] for r in ranks]} are not 0..n-1; pass "
            "the engine's /get_parallelism_config answer unchanged"
        )
    return [r["params"] for r in ranks]


def _dest_box(entry: dict, whole: Box, where: str) -> Box:
    """The box a layout entry names: `full.narrow(dim, start, stop - start)`, or the whole tensor."""
    dim = entry["dim"]
    if dim is None:
        return whole
    start, stop = entry["range"]
    if not (0 <= dim < len(whole) and 0 <= start <= stop <= whole[dim][1]):
        raise ValueError(f"{where}: dim {dim} range [{start}, {stop}) is outside global_shape {[s for _, s in whole]}")
    return whole[:dim] + ((start, stop),) + whole[dim + 1 :]


def dest_boxes(layout: dict) -> list[dict[str, Box]]:
    """Per rank of one engine (index = rank), the box of every HF tensor the rank holds."""
    return [
        {
            name: _dest_box(entry, full_box(entry["global_shape"]), f"{name} on rank {rank}")
            for name, entry in params.items()
        }
        for rank, params in enumerate(_rank_params(layout, 0))
    ]


# ---- the plan --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Transfer:
    """`box` (global coords) of tensor `name` goes from trainer rank `src_rank` to rank `dst_rank` of
    engine `engine`; it lies within the sender's piece `src_box` and the receiver's shard `dst_box`."""

    name: str
    src_rank: int
    engine: int
    dst_rank: int
    box: Box
    src_box: Box
    dst_box: Box
    nbytes: int

    @property
    def src_local(self) -> Box:  # what the sender slices from its local piece
        return relative(self.box, self.src_box)

    @property
    def dst_local(self) -> Box:  # where it lands in the receiver's shard
        return relative(self.box, self.dst_box)


@dataclass(frozen=True, slots=True)
class MessageEntry:
    """One box of one tensor in a message buffer: bytes [offset, offset + nbytes), C order of the box."""

    name: str
    dtype: str
    dst_box_local: Box
    src_box_local: Box
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Message:
    """One buffer from one trainer rank to one rollout rank; (src_rank, tag) identify it at the receiver."""

    src_rank: int
    engine: int
    dst_rank: int
    tag: int  # 0, 1, ... per (src_rank, engine, dst_rank)
    entries: tuple[MessageEntry, ...]
    nbytes: int  # buffer size: the end of the last entry (alignment padding between entries included)


@dataclass(frozen=True)
class ReshardPlan:
    """The plan as plain tuples; Transfer and Message objects are made on demand. Every process
    computes the whole plan but uses only its own part, and making millions of objects everywhere
    would cost more than the planning itself."""

    engine_sizes: tuple[int, ...]  # ranks per engine
    bytes_by_sender: dict[int, int] = field(repr=False)  # trainer rank -> payload bytes
    bytes_by_receiver: dict[tuple[int, int], int] = field(repr=False)  # (engine, rank) -> payload bytes
    # tensor by tensor, engine by engine, rank by rank: a Transfer's fields, then (dtype, src_local, dst_local)
    transfer_records: tuple[tuple, ...] = field(repr=False)
    # sender by sender in send order: a Message's fields, its entries as tuples of MessageEntry's fields
    message_records: tuple[tuple, ...] = field(repr=False)

    @cached_property
    def transfers(self) -> tuple[Transfer, ...]:
        with _gc_paused():
            return tuple([Transfer(*record[:8]) for record in self.transfer_records])

    @cached_property
    def messages(self) -> tuple[Message, ...]:
        with _gc_paused():
            return tuple([_message(record) for record in self.message_records])

    @cached_property
    def _index(self) -> tuple[dict, dict]:  # src -> records in send order, (engine, dst) -> by (src, tag)
        by_sender: dict[int, list[tuple]] = {}
        by_receiver: dict[tuple[int, int], list[tuple]] = {}
        for record in self.message_records:
            by_sender.setdefault(record[0], []).append(record)
        for record in sorted(self.message_records, key=lambda r: (r[0], r[3])):
            by_receiver.setdefault((record[1], record[2]), []).append(record)
        return by_sender, by_receiver

    def sends_of(self, src_rank: int) -> list[Message]:
        """What trainer rank `src_rank` sends, in the order to pack and send it: round by round (every
        receiver's tag 0 first) and, within a round, starting at a receiver that depends on the
        sender, so that concurrent senders do not all queue at the same rollout rank."""
        return [_message(record) for record in self._index[0].get(src_rank, ())]

    def receives_of(self, engine: int, dst_rank: int) -> list[Message]:
        """What rank `dst_rank` of `engine` receives, by (src_rank, tag); they may be posted in any order."""
        return [_message(record) for record in self._index[1].get((engine, dst_rank), ())]

    def bytes_sent(self, src_rank: int) -> int:
        return self.bytes_by_sender.get(src_rank, 0)

    def bytes_received(self, engine: int, dst_rank: int) -> int:
        return self.bytes_by_receiver.get((engine, dst_rank), 0)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_sender.values())

    def request_for(self, engine: int) -> list[list[dict]]:
        """The `ranks` value of the engine's reshard request body, JSON-ready: per engine rank, its
        messages with boxes in the receiving shard's coordinates. `src` is the sender's rank in the
        update group, which is its trainer rank. Large for large models: build it once per plan."""
        with _gc_paused():
            return [
                [_message_json(m) for m in self.receives_of(engine, rank)] for rank in range(self.engine_sizes[engine])
            ]


def _message(record: tuple) -> Message:
    src, engine, dst, tag, entries, nbytes = record
    return Message(src, engine, dst, tag, tuple([MessageEntry(*entry) for entry in entries]), nbytes)


def _message_json(message: Message) -> dict:
    return {
        "src": message.src_rank,
        "tag": message.tag,
        "nbytes": message.nbytes,
        "entries": [
            {"name": e.name, "dtype": e.dtype, "box": [[a, b] for a, b in e.dst_box_local], "offset": e.offset}
            for e in message.entries
        ],
    }


# ---- planning --------------------------------------------------------------------------------------
def plan_reshard(sources: list[TensorSource], engine_layouts: list[dict], bucket_bytes: int) -> ReshardPlan:
    """Plan moving every tensor in `sources` to every rank of every engine that holds part of it.

    Every name an engine lists needs a source (tied names, e.g. an LM head sharing the embedding,
    are listed under both names, so give the tied tensor's pieces under both). A source no engine
    lists is an error too: it would silently never reach the rollout model, which is what a name
    mapping bug looks like; leave such tensors out of `sources` on purpose instead.

    Buckets hold at most `bucket_bytes` (payload and alignment padding); a box larger than that is
    split along its dim 0 into row blocks that fit (a single row larger than a bucket travels alone).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive (got {bucket_bytes}); set bridge.bucket_size_mb")
    engines = [_rank_params(layout, e) for e, layout in enumerate(engine_layouts)]
    by_name: dict[str, TensorSource] = {}
    for source in sources:
        if source.name in by_name:
            raise ValueError(
                f"{source.name}: listed twice in the sources; give each tensor one TensorSource "
                "whose pieces name every rank that holds part of it"
            )
        by_name[source.name] = source
    for e, ranks in enumerate(engines):
        for rank, params in enumerate(ranks):
            missing = params.keys() - by_name.keys()
            if missing:
                raise ValueError(
                    f"engine {e} rank {rank} holds {_some(missing)} but no trainer rank exports "
                    "them: the trainer's HF names must match the rollout model's (a tied weight "
                    "needs its pieces under both names)"
                )
    with _gc_paused():
        records, sent, received = _intersect(sources, engines)
        engine_sizes = tuple(len(ranks) for ranks in engines)
        messages = _pack(records, bucket_bytes, engine_sizes)
        return ReshardPlan(engine_sizes, sent, received, tuple(records), tuple(messages))


@contextmanager
def _gc_paused():
    """Planning allocates millions of small acyclic objects; the cyclic collector would scan them
    again and again (it doubled the time of a 37k-tensor x 64-rank plan)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _some(names) -> str:
    names = sorted(names)
    return ", ".join(names[:5]) + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")


def _intersect(sources: list[TensorSource], engines: list[list[dict]]):
    """Transfer records tensor by tensor, engine by engine, rank by rank; among replicas the rank with
    the fewest bytes so far sends (ties: the lowest rank). Returns (records, bytes per sender, bytes
    per (engine, rank)); a record is a Transfer's fields, then (dtype, src_local, dst_local)."""
    records: list[tuple] = []
    sent: dict[int, int] = {}
    received = [[0] * len(ranks) for ranks in engines]
    # Geometry repeats (every expert, every layer): intersections are cached per (shape, source
    # boxes) and destination slice, so a tensor costs a few lookups per rollout rank.
    geometries: dict[tuple, dict] = {}
    unwanted = []
    for source in sources:
        groups = _replica_groups(source)
        name, dtype, size = source.name, source.dtype, itemsize(source.dtype)
        shape, whole = list(source.shape), full_box(source.shape)
        src_boxes = tuple([box for box, _ in groups])
        by_slice = geometries.setdefault((whole, src_boxes), {})
        wanted = False
        for e, ranks in enumerate(engines):
            received_e = received[e]
            for rank, params in enumerate(ranks):
                entry = params.get(name)
                if entry is None:
                    continue
                wanted = True
                global_shape = entry["global_shape"]
                if global_shape != shape and list(global_shape) != shape:
                    raise ValueError(
                        f"{name}: engine {e} rank {rank} has global_shape {list(global_shape)} but "
                        f"the trainer exports shape {shape}; both sides must load the same model"
                    )
                dim = entry["dim"]
                key = None if dim is None else (dim, *entry["range"])
                geometry = by_slice.get(key)
                if geometry is None:
                    dst_box = _dest_box(entry, whole, f"{name} on engine {e} rank {rank}")
                    geometry = by_slice[key] = _geometry(name, src_boxes, dst_box)
                dst_box, need, parts = geometry
                for g, box, n, src_local, dst_local in parts:
                    holders = groups[g][1]
                    src = holders[0] if len(holders) == 1 else min(holders, key=lambda r: (sent.get(r, 0), r))
                    sent[src] = sent.get(src, 0) + n * size
                    records.append(
                        (name, src, e, rank, box, src_boxes[g], dst_box, n * size, dtype, src_local, dst_local)
                    )
                received_e[rank] += need * size
        if not wanted:
            unwanted.append(name)
    if unwanted:
        raise ValueError(
            f"the trainer exports {_some(unwanted)} but no engine holds them; leave them out of "
            "the sources if the rollout model has no such parameter, else fix the name mapping"
        )
    return records, sent, {(e, rank): n for e, row in enumerate(received) for rank, n in enumerate(row)}


def _geometry(name: str, src_boxes: tuple[Box, ...], dst_box: Box):
    """(dst_box, its numel, [(source box index, box, numel, src_local, dst_local)]) for one shard."""
    parts = []
    for g, src_box in enumerate(src_boxes):
        box = intersect(src_box, dst_box)
        if box is not None:
            parts.append((g, box, box_numel(box), relative(box, src_box), relative(box, dst_box)))
    need = box_numel(dst_box)
    # the source boxes tile the tensor (checked), so their parts of dst_box are disjoint: equal
    # counts mean the received boxes tile the shard exactly
    assert sum(p[2] for p in parts) == need, f"{name}: {dst_box} would receive {parts}"
    return dst_box, need, parts


def _row_blocks(box: Box, size: int, bucket_bytes: int) -> list[Box]:
    """`box` split along dim 0 into blocks of at most `bucket_bytes` (one row at least)."""
    (start, stop), rest = box[0], box[1:]
    rows = max(1, bucket_bytes // (box_numel(rest) * size))
    return [((a, min(a + rows, stop)),) + rest for a in range(start, stop, rows)]


def _pack(records: list[tuple], bucket_bytes: int, engine_sizes: tuple[int, ...]) -> list[tuple]:
    """Consecutive transfers from one sender to one receiver, packed into buckets of `bucket_bytes`:
    message records (see ReshardPlan) in send order (see ReshardPlan.sends_of)."""
    open_buckets: dict[tuple[int, int, int], list] = {}  # (src, engine, dst) -> [entries, end]
    tags: dict[tuple[int, int, int], int] = {}
    messages: list[tuple] = []

    def close(key, entries, end):
        tags[key] = tag = tags.get(key, -1) + 1
        messages.append((*key, tag, tuple(entries), end))

    for name, src, e, rank, box, src_box, dst_box, nbytes, dtype, src_local, dst_local in records:
        key = (src, e, rank)
        if nbytes <= bucket_bytes or not box:
            pieces = ((dst_local, src_local, nbytes),)
        else:
            size = itemsize(dtype)
            pieces = [
                (relative(block, dst_box), relative(block, src_box), box_numel(block) * size)
                for block in _row_blocks(box, size, bucket_bytes)
            ]
        for dst_local, src_local, nbytes in pieces:
            bucket = open_buckets.get(key)
            if bucket is None:
                bucket = open_buckets[key] = [[], 0]
            offset = -(-bucket[1] // ALIGN) * ALIGN
            if offset and offset + nbytes > bucket_bytes:
                close(key, *open_buckets.pop(key))
                bucket = open_buckets[key] = [[], 0]
                offset = 0
            bucket[0].append((name, dtype, dst_local, src_local, offset, nbytes))
            bucket[1] = offset + nbytes
    for key, (entries, end) in open_buckets.items():
        close(key, entries, end)

    first_rank = [sum(engine_sizes[:e]) for e in range(len(engine_sizes))]
    receivers = max(1, sum(engine_sizes))

    def send_order(record: tuple):
        src, engine, dst, tag = record[:4]
        return src, tag, (first_rank[engine] + dst - src) % receivers

    return sorted(messages, key=send_order)
