"""Reshard transport: each rollout rank receives exactly its own shard, point to point, from many
trainer ranks at once.

The plan (plan.py, a pure function) intersects what every trainer rank can produce from its own
Megatron shard (shards.local_hf_pieces: TP/EP/PP placements and mbridge's fused layouts) with each
engine's reported layout (/get_parallelism_config). Exactly those bytes move: one update group
spans the trainer ranks (group rank = trainer rank) and every engine rank (after them); each
trainer rank packs its messages (bounded by the bucket size) into two buffers kept across syncs and
sends them while the next is packed; each engine rank posts all its receives at once
(/update_weights_from_reshard, megarl's endpoint) and stages them until rank 0 commits. The plan and the group are kept until the engine
set changes (a restart) or a sync fails.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.bridge.engines import WeightSyncError, wait_all
from megarl.bridge.plan import SourcePiece, TensorSource, plan_reshard
from megarl.bridge.transport import WeightTransport
from megarl.wire import update_group

SEND_SLOTS = 2  # packed buffers per rank, kept across syncs: messages on the wire while the next is packed


class ReshardTransport(WeightTransport):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._key: tuple | None = None
        self._plan = None
        self._pieces: dict[str, object] = {}
        self._group: update_group.UpdateGroup | None = None
        self._generation = 0
        self._slots: list[torch.Tensor | None] = [None] * SEND_SLOTS

    # ---- set-up: plan and group, once per engine set ---------------------------------------------
    def _prepare(self, source, urls: list[str]) -> None:
        key = tuple(urls)
        if self._key == key:
            return
        self._drop_group()
        answer = [None]
        if self.rank == 0:
            try:
                answer = [("ok", [e.client.get_parallelism_config() for e in self.engines.use(urls)])]
            except Exception as exc:  # noqa: BLE001  (every rank raises it below)
                answer = [("error", f"asking the engines for their layouts failed: {exc}")]
        dist.broadcast_object_list(answer, src=0)
        status, layouts = answer[0]
        if status != "ok":
            raise WeightSyncError(layouts)
        pieces = source.local_pieces()
        self._pieces = {p.name: p for p in pieces}
        mine = [(p.name, tuple(p.shape), p.dtype, p.box) for p in pieces]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        self._plan = plan_reshard(_tensor_sources(everyone), layouts, self.spec.bucket_bytes)
        # the engines' receive lists: built once per plan (large: ~1 s and tens of MiB of JSON per
        # tp=8 engine of a 235B model), sent every sync
        self._requests = [self._plan.request_for(e) for e in range(len(layouts))] if self.rank == 0 else []
        tps = [int(layout["tp_size"]) for layout in layouts]
        self._offsets = [self.world_size + sum(tps[:e]) for e in range(len(tps))]
        self._join_group(sum(tps))
        self._key = key

    def _join_group(self, engine_ranks: int) -> None:
        self._generation += 1
        name, world = f"megarl-reshard-{self._generation}", self.world_size + engine_ranks
        backend = self.spec.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        addr, joins, store = [None], [], None
        if self.rank == 0:
            store = update_group.host_store(self.address, self.spec.timeout_s)
            addr = [(self.address, store.port)]
        dist.broadcast_object_list(addr, src=0)
        if self.rank == 0:
            joins = [
                self.engines.submit(
                    e.client.init_weights_update_group, self.address, store.port, self._offsets[i], world, name, backend
                )
                for i, e in enumerate(self.engines.engines)
            ]
        else:
            store = update_group.connect_store(*addr[0], self.spec.timeout_s)
        try:
            self._group = update_group.new_update_group(store, name, self.rank, world, backend, self.spec.timeout_s)
        finally:
            if self.rank == 0:
                wait_all(joins, [e.url for e in self.engines.engines], f"init_weights_update_group {name}")
        self._store = store

    def _broken(self) -> None:
        self._drop_group()

    def _drop_group(self) -> None:
        if self._group is not None:
            if self.rank == 0:
                for engine in self.engines.engines:  # best effort: a failed sync already dropped it there
                    try:
                        engine.client.destroy_weights_update_group(self._group.name)
                    except Exception:  # noqa: BLE001
                        pass
            self._group.destroy()
            self._group = None
        self._key = None

    # ---- a sync -----------------------------------------------------------------------------
    def _sync(self, source, version, urls):
        self._prepare(source, urls)
        plan, requests, error, sent = self._plan, [], None, 0
        self._begin(urls, version)
        try:
            if self.rank == 0:
                requests = [
                    self.engines.submit(
                        e.client.update_weights_from_reshard,
                        self._group.name,
                        self._requests[i],
                        weight_version=version,
                        defer=e.stages,
                    )
                    for i, e in enumerate(self.engines.engines)
                ]
            sent = self._send_mine(plan)
            if self.rank == 0:
                wait_all(requests, [e.url for e in self.engines.engines], "update_weights_from_reshard")
        except Exception as exc:  # noqa: BLE001  (every rank learns every error below)
            error = f"trainer rank {self.rank}: {exc}"
            # this rank's side of the group closes now: engines still waiting for its messages (a
            # live engine, when another one died) fail at once instead of at their timeout, which
            # would hold the abort below and the fleet's restart for two request timeouts (measured)
            self._group.destroy()
        self._conclude(error, version)
        stats = {"bridge/bytes_sent": float(sent), "bridge/messages": float(len(plan.sends_of(self.rank)))}
        if self.rank == 0:
            stats["bridge/bytes"] = float(plan.total_bytes)
            stats["bridge/bytes_per_rollout_rank_max"] = float(
                max(plan.bytes_received(e, r) for e, size in enumerate(plan.engine_sizes) for r in range(size))
            )
        return stats

    def _send_mine(self, plan) -> int:
        """Pack and send this rank's messages through SEND_SLOTS buffers; bytes sent. A slot is
        packed again once its previous message has left. The slots are kept across syncs (fresh
        buffers this large fault every page in again: ~30 ms per 64 MiB on CPU)."""
        inflight: list = [None] * SEND_SLOTS
        fetched: dict[str, torch.Tensor] = {}  # a piece converted once per sync, sliced per message
        total = 0
        try:
            for k, msg in enumerate(plan.sends_of(self.rank)):
                for entry in msg.entries:
                    if entry.name not in fetched:
                        fetched[entry.name] = self._pieces[entry.name].fetch()
                slot = k % SEND_SLOTS
                if inflight[slot] is not None:
                    inflight[slot].wait()
                    inflight[slot] = None
                buf = self._slot(slot, msg.nbytes, fetched[msg.entries[0].name].device)
                for entry in msg.entries:
                    part = fetched[entry.name][tuple(slice(a, b) for a, b in entry.src_box_local)]
                    _pack(buf, entry.offset, part)
                dst = self._offsets[msg.engine] + msg.dst_rank
                inflight[slot] = self._group.send(buf, dst, msg.tag)
                total += msg.nbytes
            for work in inflight:
                if work is not None:
                    work.wait()
        except BaseException:
            self._slots = [None] * SEND_SLOTS  # sends may still be pending on them: the next sync packs anew
            raise
        return total

    def _slot(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """Slot `slot`'s buffer, a uint8 view of `nbytes` (on the parameters' device: NCCL moves
        device memory only); grown to the bucket size or to the largest message seen."""
        buf = self._slots[slot]
        if buf is None or buf.numel() < nbytes or buf.device != device:
            self._slots[slot] = None
            buf = self._slots[slot] = torch.empty(max(nbytes, self.spec.bucket_bytes), dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def close(self) -> None:
        self._drop_group()
        super().close()


def _pack(buf: torch.Tensor, offset: int, part: torch.Tensor) -> None:
    """Copy `part` (any strides) into buf[offset:] in C order: straight into a typed view of the
    buffer (entries start aligned, boxes.ALIGN), no contiguous temporary."""
    nbytes = part.numel() * part.element_size()
    if offset % part.element_size() == 0:
        buf[offset : offset + nbytes].view(part.dtype).view(part.shape).copy_(part)
    else:
        buf[offset : offset + nbytes].copy_(part.contiguous().reshape(-1).view(torch.uint8))


def _tensor_sources(per_rank: list[list]) -> list[TensorSource]:
    """Every rank's (name, shape, dtype, box) list -> one TensorSource per HF name (replicas kept)."""
    by_name: dict[str, dict] = {}
    for rank, entries in enumerate(per_rank):
        for name, shape, dtype, box in entries:
            entry = by_name.setdefault(name, {"shape": tuple(shape), "dtype": dtype, "pieces": []})
            if entry["shape"] != tuple(shape) or entry["dtype"] != dtype:
                raise WeightSyncError(
                    f"{name}: trainer ranks disagree on its shape/dtype "
                    f"({entry['shape']}/{entry['dtype']} vs {tuple(shape)}/{dtype})"
                )
            entry["pieces"].append(SourcePiece(rank, tuple(tuple(b) for b in box)))
    return [TensorSource(name, e["shape"], e["dtype"], tuple(e["pieces"])) for name, e in by_name.items()]
