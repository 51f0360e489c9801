"""How many bytes of tensors the converter holds at once (reported with each conversion).

Every tensor the converter makes (read from Hugging Face, built for Megatron, loaded from torch_dist,
converted for writing) is registered here and counted until Python frees it, so a writer or loader
that kept references would show up as a growing peak. Memory the libraries use inside one call
(DCP's read buffers, safetensors' mmap pages) is not seen; benchmarks/bench_convert.py measures RSS.
"""

from __future__ import annotations

import weakref

import torch


class HeldBytes:
    def __init__(self):
        self.now = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count `tensor`'s storage until it is freed; returns it."""
        n = tensor.untyped_storage().nbytes()
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(tensor, self._release, n)
        return tensor

    def _release(self, n: int) -> None:
        self.now -= n
