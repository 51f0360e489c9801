"""Senders: push buckets of named tensors to SGLang-API rollout servers."""

from __future__ import annotations

import os
import shutil
import time
from typing import Iterable

import torch

from megarl.bridge.buckets import NamedTensor, iter_buckets, tensor_bytes, with_last_flag
from megarl.rollout.client import RolloutClient


class TensorWeightSender:
    """Colocated transport: each bucket is packed into one flattened buffer whose shared-memory
    handle (CUDA IPC on GPU) goes to /update_weights_from_tensor; the bytes never cross HTTP.

    The buffer is allocated in shared memory once and reused for every bucket of every sync: the
    server copies a bucket into its parameters before it replies, so the next bucket may
    overwrite it. Packing copies, so later in-place optimizer updates cannot race the read.
    Keep one sender for the whole run (clients and buffer are reused); close() at the end.
    """

    def __init__(self, server_urls: list[str], bucket_bytes: int, timeout_s: float = 600.0,
                 api_key: str | None = None):
        if not server_urls:
            raise ValueError("bridge: no rollout server URLs to send weights to")
        self.server_urls, self.bucket_bytes = list(server_urls), bucket_bytes
        self._timeout_s, self._api_key = timeout_s, api_key
        self._clients: dict[str, tuple[RolloutClient, int]] = {}  # url -> (client, engine tp size)
        self._buffer: torch.Tensor | None = None

    def _client(self, url: str) -> tuple[RolloutClient, int]:
        """A kept client per engine and the engine's TP size: SGLang reads one payload per rank."""
        if url not in self._clients:
            client = RolloutClient(url, timeout_s=self._timeout_s, api_key=self._api_key)
            tp = int(client.get_server_info().get("tp_size") or 1)
            self._clients[url] = (client, tp)
        return self._clients[url]

    def _shared_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._buffer
        if buf is None or buf.numel() < nbytes or buf.device != device:
            # the bucket size, or one oversized tensor's size when that is larger
            buf = torch.empty(max(nbytes, self.bucket_bytes), dtype=torch.uint8, device=device)
            if device.type == "cpu":
                buf.share_memory_()
            self._buffer = buf
        return buf

    def send(self, named: Iterable[NamedTensor], weight_version: str, server_urls: list[str] | None = None) -> dict:
        """Every bucket to every engine (`server_urls`, default all): each rank of a TP engine gets
        its own payload of the same buffer (a payload is unpickled, and its reference dropped, once)."""
        from megarl.rollout.weights_codec import flattened_bucket_nbytes, pack_flattened_bucket, serialize

        targets = [self._client(url) for url in (server_urls or self.server_urls)]
        n_tensors = n_bytes = n_buckets = 0
        for bucket, last in with_last_flag(iter_buckets(named, self.bucket_bytes)):
            buf = self._shared_buffer(flattened_bucket_nbytes(bucket), bucket[0][1].device)
            flat, metadata = pack_flattened_bucket(bucket, out=buf)
            for client, tp in targets:
                payloads = [serialize({"flattened_tensor": flat, "metadata": metadata}) for _ in range(tp)]
                client.update_weights_from_tensor(
                    payloads, load_format="flattened_bucket", flush_cache=last,
                    weight_version=weight_version if last else None)
            n_buckets += 1
            n_tensors += len(bucket)
            n_bytes += sum(tensor_bytes(t) for _, t in bucket)
        return {"bridge/buckets": n_buckets, "bridge/tensors": n_tensors, "bridge/bytes": n_bytes}

    def close(self) -> None:
        for client, _ in self._clients.values():
            client.close()
        self._clients.clear()
        self._buffer = None


class DiskWeightSender:
    """Disk transport: write an HF safetensors checkpoint (atomically: temp dir, then rename),
    ask every server to reload it with /update_weights_from_disk, then delete the version it
    replaced (only once every server has moved off it)."""

    def __init__(self, server_urls: list[str], directory: str, timeout_s: float = 600.0,
                 api_key: str | None = None):
        self.server_urls, self._api_key = list(server_urls), api_key
        self.directory = directory
        self.timeout_s = timeout_s
        self._current: str | None = None

    def send(self, named: Iterable[NamedTensor], weight_version: str, server_urls: list[str] | None = None) -> dict:
        from safetensors.torch import save_file

        # clone: exported tensors can be views sharing storage (split QKV), which safetensors
        # refuses to save
        tensors = {name: t.detach().contiguous().clone() for name, t in named}
        final = os.path.join(self.directory, f"weights_{weight_version}")
        tmp = f"{final}.tmp{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        start = time.perf_counter()
        for url in server_urls or self.server_urls:
            with RolloutClient(url, timeout_s=self.timeout_s, api_key=self._api_key) as client:
                client.update_weights_from_disk(final, weight_version=weight_version)
        if self._current is not None and self._current != final:
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = final
        return {"bridge/tensors": len(tensors),
                "bridge/bytes": sum(tensor_bytes(t) for t in tensors.values()),
                "bridge/disk_load_s": time.perf_counter() - start}

    def close(self) -> None:
        pass


def make_weight_sender(spec: dict):
    """spec: transport ("tensor"|"disk"), server_urls, bucket_bytes, disk_dir, timeout_s, api_key."""
    transport = spec.get("transport", "tensor")
    if transport == "tensor":
        return TensorWeightSender(spec["server_urls"], int(spec["bucket_bytes"]),
                                  spec.get("timeout_s", 600.0), spec.get("api_key"))
    if transport == "disk":
        return DiskWeightSender(spec["server_urls"], spec["disk_dir"], spec.get("timeout_s", 600.0),
                                spec.get("api_key"))
    raise ValueError(f"bridge.transport={transport!r} is not one of 'tensor', 'disk'")
