"""Disk transport: an HF safetensors checkpoint (written atomically: temp dir, then rename), loaded
by every engine with /update_weights_from_disk (one request: all or nothing by itself); the
version it replaced is deleted once every engine moved off it."""

from __future__ import annotations

import os
import shutil
import time

from megarl.bridge.buckets import tensor_bytes
from megarl.bridge.transport import WeightTransport, drain


class DiskTransport(WeightTransport):
    _current: str | None = None

    def _sync(self, source, version, urls):
        named = iter(source.export_weights())
        if self.rank != 0:
            drain(named)
            return {}
        from safetensors.torch import save_file

        tensors = _without_overlaps({name: t.detach().contiguous() for name, t in named})
        final = os.path.join(self.spec.disk_dir, f"weights_{version}")
        tmp = f"{final}.tmp{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        start = time.perf_counter()
        engines = self.engines
        try:
            engines.use(urls)
            engines.pause()
            engines.each(
                lambda i, e: e.client.update_weights_from_disk(final, weight_version=version),
                "update_weights_from_disk",
            )
        finally:
            self._resume_quietly()
        if self._current is not None and self._current != final:
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = final
        return {
            "bridge/tensors": len(tensors),
            "bridge/bytes": sum(tensor_bytes(t) for t in tensors.values()),
            "bridge/disk_load_s": time.perf_counter() - start,
        }


def _without_overlaps(tensors: dict) -> dict:
    """Clone only the tensors whose bytes overlap another's (a tied name, a view of a view):
    safetensors refuses those, and disjoint views (split QKV) it takes as they are. Cloning all of
    them cost a fresh copy of the model per sync (new pages: page faults on every one)."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name) for name, t in tensors.items() if t.numel()
    )
    end = None
    for start, stop, name in spans:
        if end is not None and start < end:
            tensors[name] = tensors[name].clone()
        else:
            end = stop if end is None else max(end, stop)
    return tensors
