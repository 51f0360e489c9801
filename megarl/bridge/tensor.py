"""Colocated transport: shared-memory (CUDA IPC on GPU) handles through /update_weights_from_tensor.

Each bucket is packed into one flattened buffer allocated once in shared memory and reused for
every bucket of every sync; an engine copies its slices out (stages them) before it replies, so
the next bucket may overwrite the buffer. Every TP rank of an engine gets its own payload entry
(SGLang's per-rank `serialized_named_tensors`; a payload is unpickled once). Rank 0 sends; the
other ranks take part in the gathers of the export.
"""

from __future__ import annotations

import torch

from megarl.bridge.buckets import iter_buckets, tensor_bytes, with_last_flag
from megarl.bridge.transport import WeightTransport, drain


class TensorTransport(WeightTransport):
    _buffer: torch.Tensor | None = None

    def _shared_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._buffer
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty(max(nbytes, self.spec.bucket_bytes), dtype=torch.uint8, device=device)
            if device.type == "cpu":
                buf.share_memory_()
            self._buffer = buf
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
        from megarl.rollout.weights_codec import flattened_bucket_nbytes, pack_flattened_bucket, serialize

        for bucket, last in with_last_flag(iter_buckets(named, self.spec.bucket_bytes)):
            buf = self._shared_buffer(flattened_bucket_nbytes(bucket), bucket[0][1].device)
            flat, metadata = pack_flattened_bucket(bucket, out=buf)

            def send(i, engine):
                payloads = [serialize({"flattened_tensor": flat, "metadata": metadata}) for _ in range(engine.tp)]
                return engine.client.update_weights_from_tensor(
                    payloads, load_format="flattened_bucket", flush_cache=last and not engine.stages,
                    weight_version=version if (engine.stages or last) else None, defer=engine.stages)

            self.engines.each(send, "update_weights_from_tensor")
            stats["bridge/buckets"] += 1
            stats["bridge/tensors"] += len(bucket)
            stats["bridge/bytes"] += sum(tensor_bytes(t) for _, t in bucket)

    def close(self) -> None:
        super().close()
        self._buffer = None
