"""Colocated transport: shared-memory (CUDA IPC on GPU) handles through /update_weights_from_tensor.

Each bucket is packed into one of two flattened buffers allocated once in shared memory and reused
for every sync: while the engines load bucket k from one, bucket k+1 is gathered and packed into
the other. An engine copies its slices out (stages them) before it replies, so bucket k+2 may
overwrite bucket k's buffer once k's requests returned. Every TP rank of an engine gets its own
payload entry (SGLang's per-rank `serialized_named_tensors`; a payload is unpickled once).

Handles open only on the host that made them, and every trainer rank holds each full tensor as the
export yields it, so the lowest trainer rank of each host sends to the engines on that host
(hosts.py); the other ranks take part in the export's collectives and keep nothing. One host:
rank 0 sends, as before, with no collective of its own. Several: each sender stages every bucket
on its engines, then one agreement over every trainer rank decides: all succeeded, every sender
commits; anything failed anywhere, every sender aborts, so no host's engines move to weights
another host's did not get. Stats: buckets, tensors and bytes are what one host received (every
host gets the same stream); `bridge/hosts` counts the hosts sent to.
"""

from __future__ import annotations

import concurrent.futures

import torch

from megarl.bridge.buckets import iter_buckets, tensor_bytes, with_last_flag
from megarl.bridge.engines import WeightSyncError
from megarl.bridge.hosts import resolve, senders_by_host
from megarl.bridge.transport import WeightTransport, drain


class TensorTransport(WeightTransport):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._requests = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bridge-tensor")
        self._addresses: list[str] | None = None  # every trainer rank's host IP, by rank
        self._plan: tuple[tuple[str, ...], dict[int, list[str]]] | None = None  # (urls, their senders)

    def _shared_buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty(max(nbytes, self.spec.bucket_bytes), dtype=torch.uint8, device=device)
            if device.type == "cpu":
                buf.share_memory_()
            self._buffers[slot] = buf
        return buf

    def _sync(self, source, version, urls):
        senders = self._senders(urls)
        named = iter(source.export_weights())
        if len(set(self._addresses)) > 1:
            return self._sync_hosts(named, version, senders)
        if self.rank != 0:
            drain(named)  # take part in the collectives, keep nothing
            return {}
        stats = _new_stats(1)
        self._staged(version, urls, lambda stream: self._send(stream, version, stats, True), named)
        return stats

    def _senders(self, urls: list[str]) -> dict[int, list[str]]:
        """{sending rank: its engines}; the ranks' hosts are gathered once (the first sync)."""
        if self._addresses is None:
            import torch.distributed as dist

            addresses = [resolve(self.address)]
            if self.world_size > 1:
                addresses = [None] * self.world_size
                dist.all_gather_object(addresses, resolve(self.address))
            self._addresses = addresses
        if len(set(self._addresses)) == 1:
            return {0: list(urls)}  # one host: every engine there, however its URL names it
        if self._plan is None or self._plan[0] != tuple(urls):
            self._plan = (tuple(urls), senders_by_host(self._addresses, urls))
        return self._plan[1]

    def _sync_hosts(self, named, version, senders: dict[int, list[str]]) -> dict:
        """Every host's sender stages the stream on its engines; one agreement, then all commit or all abort."""
        mine, stats, error = senders.get(self.rank), _new_stats(len(senders)), None
        if mine:
            try:
                self.engines.use(mine)
                _refuse_engines_over_hosts(self.engines.engines)
                self.engines.pause()
                # never applied at once: another host may fail after this one's engines took it
                self._send(named, version, stats, False)
            except Exception as exc:  # noqa: BLE001  (every rank learns it in _conclude)
                error = f"trainer rank {self.rank} on {self.address}: {exc}"
                drain(named)
        elif self.rank == 0:  # no engine on its host this time: it reports what the senders sent
            drain(_counted(iter_buckets(named, self.spec.bucket_bytes), stats))
        else:
            drain(named)
        self._conclude(error, version, controls=bool(mine))
        return stats if mine or self.rank == 0 else {}

    def _send(self, named, version, stats, may_apply: bool) -> None:
        """`may_apply`: a single bucket holding every weight may be applied by its one request."""
        from megarl.wire.weights_codec import flattened_bucket_nbytes, pack_flattened_bucket, serialize

        pending: concurrent.futures.Future | None = None  # the previous bucket's requests
        # taking the next bucket from the stream gathers it while the previous one is loading
        for k, (bucket, last) in enumerate(with_last_flag(iter_buckets(named, self.spec.bucket_bytes))):
            buf = self._shared_buffer(k % 2, flattened_bucket_nbytes(bucket), bucket[0][1].device)
            flat, metadata = pack_flattened_bucket(bucket, out=buf)  # bucket k-2 (same buffer) is done
            whole = may_apply and k == 0 and last

            def send(i, engine, flat=flat, metadata=metadata, last=last, whole=whole):  # bound now
                payloads = [serialize({"flattened_tensor": flat, "metadata": metadata}) for _ in range(engine.tp)]
                # one bucket holds every weight: the embedded engine applies it at once, all or
                # nothing under its model lock, and the commit's round trip (~4 ms) is saved
                defer = engine.stages and not whole
                result = engine.client.update_weights_from_tensor(
                    payloads,
                    load_format="flattened_bucket",
                    flush_cache=last and not engine.stages,
                    weight_version=version if (defer or last) else None,
                    defer=defer,
                )
                engine.applied = engine.stages and whole
                return result

            if pending is not None:
                pending.result()  # one bucket in flight: engines load in order
            pending = self._requests.submit(self.engines.each, send, "update_weights_from_tensor")
            _count(stats, bucket)
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self._requests.shutdown(wait=True)
        super().close()
        self._buffers = [None, None]


def _new_stats(hosts: int) -> dict:
    return {"bridge/buckets": 0, "bridge/tensors": 0, "bridge/bytes": 0, "bridge/hosts": hosts}


def _count(stats: dict, bucket) -> None:
    stats["bridge/buckets"] += 1
    stats["bridge/tensors"] += len(bucket)
    stats["bridge/bytes"] += sum(tensor_bytes(t) for _, t in bucket)


def _counted(buckets, stats: dict):
    for bucket in buckets:
        _count(stats, bucket)
        yield bucket


def _refuse_engines_over_hosts(engines) -> None:
    """One request carries every TP rank's handle, and a rank on another host cannot open it."""
    spanning = [f"{e.url} ({e.nnodes} hosts)" for e in engines if e.nnodes > 1]
    if spanning:
        raise WeightSyncError(
            f"bridge.transport=tensor: the engine {', '.join(spanning)} spans hosts, and one "
            "/update_weights_from_tensor request carries every TP rank's handle, made on the "
            "sender's host: use rollout.nnodes=1, or bridge.transport=distributed"
        )
