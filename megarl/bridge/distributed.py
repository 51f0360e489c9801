"""Distributed transport: SGLang's /update_weights_from_distributed, full tensors broadcast to every
engine rank, with no rank-0 funnel.

Every rank that owns weights sends them through its own update group (group rank 0 = that trainer
rank; the engines' ranks follow, engine e at `1 + ranks of engines before e`): each pipeline stage
sends its own layers, each EP rank its own experts, tensors gathered over TP / expert-TP bucket by
bucket as the stream is consumed (weights.export_owned_hf_weights). Broadcasts of different groups
take turns through a ticket lock (ticket_lock.py); while bucket k is in flight the sender already
gathers bucket k+1. Order: pause generation (rank 0), buckets (staged on
embedded engines), then commit and continue (rank 0) once every rank reports success.
"""

from __future__ import annotations

import concurrent.futures

import torch
import torch.distributed as dist

from megarl.bridge.buckets import iter_buckets, tensor_bytes
from megarl.bridge.engines import WeightSyncError, wait_all
from megarl.bridge.ticket_lock import TicketLock
from megarl.bridge.transport import WeightTransport, drain
from megarl.wire import update_group


def pack_flat(bucket, out: torch.Tensor | None = None) -> torch.Tensor:
    """SGLang's FlattenedTensorBucket layout: every tensor's bytes, back to back, no padding
    (into `out`'s first bytes when given: a reused buffer spares the page faults of a fresh one)."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
    if out is None:
        return torch.cat(parts)
    nbytes = sum(p.numel() for p in parts)
    return torch.cat(parts, out=out[:nbytes])


class DistributedTransport(WeightTransport):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._store = None  # trainer rank 0 hosts it: the ticket lock and the heartbeats
        self._lock: TicketLock | None = None
        self._group: update_group.UpdateGroup | None = None
        self._group_key: tuple | None = None  # engine URLs the groups were built for
        self._generation = 0
        self._buffers: list[torch.Tensor | None] = [None, None]  # packed buckets, reused across syncs
        self._completer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bridge-complete")

    # ---- set-up -----------------------------------------------------------------------------
    def _ensure_store(self) -> None:
        if self._store is not None:
            return
        addr = [None]
        if self.rank == 0:
            self._store = update_group.host_store(self.address, self.spec.timeout_s)
            self._store.set("done/0", "1")
            addr = [(self.address, self._store.port)]
        dist.broadcast_object_list(addr, src=0)
        if self.rank != 0:
            self._store = update_group.connect_store(*addr[0], self.spec.timeout_s)
        signals = update_group.connect_store(*addr[0], self.spec.timeout_s)
        self._lock = TicketLock(self._store, signals, self.rank, stale_s=min(30.0, self.spec.timeout_s / 4))

    def _ensure_groups(self, source, urls: list[str]) -> None:
        """One group per sending rank, built (in turn: an engine joins one group at a time) whenever
        the engine set changed or a failed sync broke the groups."""
        key = tuple(urls)
        if self._group_key == key:
            return
        self._drop_group()
        self._generation += 1
        sender = bool(source.sends_owned_weights())
        senders = [None] * self.world_size
        dist.all_gather_object(senders, sender)
        backend = self.spec.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        for s in [r for r, is_sender in enumerate(senders) if is_sender]:
            error = None
            if s == self.rank:
                try:
                    self._join_own_group(urls, backend)
                except Exception as exc:  # noqa: BLE001  (every rank learns it just below)
                    error = f"trainer rank {s}: {exc}"
            failed = self._agree(error)  # one group at a time: an engine joins one group at a time
            if failed:
                self._drop_group()
                raise WeightSyncError("building the weight update groups failed: " + "; ".join(failed))
        self._group_key = key

    def _join_own_group(self, urls: list[str], backend: str) -> None:
        engines = self.engines.use(urls)  # asks every engine its TP size: a dead one fails here
        name = f"megarl-dist-{self._generation}-{self.rank}"
        world = 1 + self.engines.total_ranks
        store = update_group.host_store(self.address, self.spec.timeout_s)
        offsets = self.engines.rank_offsets(1)
        joins = [
            self.engines.submit(
                e.client.init_weights_update_group, self.address, store.port, offsets[i], world, name, backend
            )
            for i, e in enumerate(engines)
        ]
        try:
            self._group = update_group.new_update_group(store, name, 0, world, backend, self.spec.timeout_s)
        finally:
            wait_all(joins, [e.url for e in engines], f"init_weights_update_group {name}")
        self._group_store = store  # the group's rendezvous lives as long as the group

    def _broken(self) -> None:
        self._drop_group()

    def _drop_group(self) -> None:
        if self._group is not None:
            name, group = self._group.name, self._group
            self._group = None
            for engine in self.engines.engines:  # best effort: a failed sync already dropped it there
                try:
                    engine.client.destroy_weights_update_group(name)
                except Exception:  # noqa: BLE001
                    pass
            group.destroy()
        self._group_key = None

    # ---- a sync -----------------------------------------------------------------------------
    def _sync(self, source, version, urls):
        self._ensure_store()
        self._ensure_groups(source, urls)
        self._begin(urls, version)
        stats, error = {"bridge/buckets": 0, "bridge/tensors": 0, "bridge/bytes": 0}, None
        self._lock.start_heartbeat()
        stream = iter(source.export_owned_weights())
        try:
            if self._group is None:
                drain(stream)  # a gather helper: take part, send nothing
            else:
                self._send(stream, version, stats)
        except Exception as exc:  # noqa: BLE001  (every rank learns every error below)
            error = f"trainer rank {self.rank}: {exc}"
            drain(stream)  # the TP / expert-TP peers still expect this rank in their gathers
        finally:
            self._lock.stop_heartbeat()
        self._conclude(error, version)
        return stats if self._group is not None or self.rank == 0 else {}

    def _send(self, stream, version: str, stats: dict) -> None:
        inflight: concurrent.futures.Future | None = None
        for k, bucket in enumerate(iter_buckets(stream, self.spec.bucket_bytes)):
            # gathered and packed while the previous bucket is in flight, into the other of two
            # buffers kept across syncs; bucket k-2 (same buffer) is done: k-1 only got its ticket
            # once k-2's was released
            flat = pack_flat(bucket, self._pack_buffer(k % 2, bucket))
            if inflight is not None and inflight.done():
                inflight.result()  # surface an earlier failure before queueing behind it
            ticket = self._lock.acquire()
            try:
                requests = self._post_bucket(bucket, version)
                work = self._group.broadcast(flat, src=0)
            except BaseException:
                self._lock.release(ticket)
                raise
            inflight = self._completer.submit(self._complete, ticket, work, requests, flat)
            stats["bridge/buckets"] += 1
            stats["bridge/tensors"] += len(bucket)
            stats["bridge/bytes"] += sum(tensor_bytes(t) for _, t in bucket)
        if inflight is not None:
            inflight.result()

    def _pack_buffer(self, slot: int, bucket) -> torch.Tensor:
        nbytes = sum(tensor_bytes(t) for _, t in bucket)
        device = bucket[0][1].device
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._buffers[slot] = torch.empty(
                max(nbytes, self.spec.bucket_bytes), dtype=torch.uint8, device=device
            )
        return buf

    def _post_bucket(self, bucket, version: str) -> list:
        names = [n for n, _ in bucket]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        return [
            self.engines.submit(
                e.client.update_weights_from_distributed,
                names,
                dtypes,
                shapes,
                self._group.name,
                load_format="flattened_bucket",
                flush_cache=not e.stages,
                weight_version=version,
                defer=e.stages,
            )
            for e in self.engines.engines
        ]

    def _complete(self, ticket: int, work, requests: list, flat: torch.Tensor) -> None:
        """Wait until every engine has the bucket, then let the next sender go (flat stays alive)."""
        try:
            work.wait()
            wait_all(
                requests,
                [e.url for e in self.engines.engines],
                f"update_weights_from_distributed ({self._group.name}, {flat.numel()} bytes)",
            )
        finally:
            self._lock.release(ticket)

    def close(self) -> None:
        self._drop_group()
        self._completer.shutdown(wait=False, cancel_futures=True)
        super().close()
