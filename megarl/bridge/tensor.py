"""Colocated transport: shared-memory (CUDA IPC on GPU) handles through /update_weights_from_tensor.

Each bucket is packed into one of two flattened buffers allocated once in shared memory and reused
for every sync: while the engines load bucket k from one, bucket k+1 is gathered and packed into
the other. An engine copies its slices out (stages them) before it replies, so bucket k+2 may
overwrite bucket k's buffer once k's requests returned. Every TP rank of an engine gets its own
payload entry (SGLang's per-rank `serialized_named_tensors`; a payload is unpickled once). Rank 0
sends; the other ranks take part in the gathers of the export.
"""

from __future__ import annotations

import concurrent.futures

import torch

from megarl.bridge.buckets import iter_buckets, tensor_bytes, with_last_flag
from megarl.bridge.transport import WeightTransport, drain


class TensorTransport(WeightTransport):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._requests = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bridge-tensor")

    def _shared_buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty(max(nbytes, self.spec.bucket_bytes), dtype=torch.uint8, device=device)
            if device.type == "cpu":
                buf.share_memory_()
            self._buffers[slot] = buf
        return buf

    def _sync(self, source, version, urls):
        named = iter(source.export_weights())
        if self.rank != 0:
            drain(named)  # take part in the collectives, keep nothing
            return {}
        stats = {"bridge/buckets": 0, "bridge/tensors": 0, "bridge/bytes": 0}
        self._staged(version, urls, lambda stream: self._send(stream, version, stats), named)
        return stats

    def _send(self, named, version, stats) -> None:
        from megarl.wire.weights_codec import flattened_bucket_nbytes, pack_flattened_bucket, serialize

        pending: concurrent.futures.Future | None = None  # the previous bucket's requests
        # taking the next bucket from the stream gathers it while the previous one is loading
        for k, (bucket, last) in enumerate(with_last_flag(iter_buckets(named, self.spec.bucket_bytes))):
            buf = self._shared_buffer(k % 2, flattened_bucket_nbytes(bucket), bucket[0][1].device)
            flat, metadata = pack_flattened_bucket(bucket, out=buf)  # bucket k-2 (same buffer) is done

            def send(i, engine, flat=flat, metadata=metadata, last=last, whole=k == 0 and last):  # bound now
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
            stats["bridge/buckets"] += 1
            stats["bridge/tensors"] += len(bucket)
            stats["bridge/bytes"] += sum(tensor_bytes(t) for _, t in bucket)
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self._requests.shutdown(wait=True)
        super().close()
        self._buffers = [None, None]
