"""Offload for colocation: move an engine's tensors to host memory and free their device storage.

Works on storages, not tensors: Megatron's DDP keeps every parameter as a view into one contiguous
`param_data` buffer (distributed optimizer) and every `main_grad` as a view into `grad_data`, and
the distributed optimizer's fp32 shards are views of the parameters. Copying each distinct storage
once and shrinking it with `untyped_storage().resize_(0)` frees the device memory while every view
keeps its shape, stride and identity; growing the storage back and copying the bytes restores all
views bit for bit, so Megatron's buffers, buckets and optimizer never notice.

On CPU (no CUDA) the "device" is the host: the copy is an ordinary allocation and the original
storage is still released, which is what the tests check.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

PARTS = ("params", "grads", "optimizer")


def _key(t: torch.Tensor) -> int:
    # the StorageImpl's address: stable across resize_, shared by every view of one storage
    return t.untyped_storage()._cdata


class HostCopy:
    """Host-memory copies of a set of storages whose device memory has been released."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        storages = {}
        for t in tensors:
            storages.setdefault(_key(t), t.untyped_storage())
        pin = torch.cuda.is_available()
        self._saved = []
        for storage in storages.values():
            if storage.size() == 0:  # already released (or empty): nothing to keep
                continue
            host = torch.empty(storage.size(), dtype=torch.uint8, pin_memory=pin).untyped_storage()
            host.copy_(storage, non_blocking=pin)
            self._saved.append((storage, host))
        if pin:
            torch.cuda.synchronize()  # the copies must land before the device memory is reused
        for storage, _ in self._saved:
            storage.resize_(0)

    @property
    def nbytes(self) -> int:
        return sum(host.size() for _, host in self._saved)

    def restore(self) -> None:
        pin = torch.cuda.is_available()
        for storage, host in self._saved:
            storage.resize_(host.size())
            storage.copy_(host, non_blocking=pin)
        if pin:
            torch.cuda.synchronize()
        self._saved = []


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron (possibly chained) optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    inner = chained if chained is not None else [optimizer]
    return [getattr(o, "optimizer", o) for o in inner]


def offload_groups(chunks: list, optimizer) -> dict[str, list[torch.Tensor]]:
    """The tensors of each offloadable part of an engine (its model chunks and optimizer).

    params: the parameters (views of DDP's param_data when it has one); grads: the DDP main_grad
    views (of grad_data); optimizer: Adam moments and any main parameters or gradients of the
    optimizer that are not views of the first two (fp32 masters of 16-bit models).
    """
    params = [p for chunk in chunks for p in chunk.parameters()]
    grads = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    taken = {_key(t) for t in params + grads}
    opt_tensors = []
    if optimizer is not None:
        for opt in _torch_optimizers(optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    opt_tensors += [p] + ([p.grad] if p.grad is not None else [])
            for state in opt.state.values():
                opt_tensors += [v for v in state.values() if torch.is_tensor(v)]
    device = params[0].device if params else torch.device("cpu")
    # Adam's scalar step counter lives on the host even when the model is on a GPU
    opt_tensors = [t for t in opt_tensors if _key(t) not in taken and t.device.type == device.type]
    return {"params": params, "grads": grads, "optimizer": opt_tensors}


def memory_metrics(chunks: list, optimizer, prefix: str = "actor") -> dict[str, float]:
    """perf/memory/{prefix}_{params,grads,optimizer}_gib: the bytes of this rank's resident state (call
    it while nothing is offloaded), and perf/memory/{prefix}_peak_gib: the device's peak allocation
    (CUDA), or this process's peak resident set on CPU. The trainer reports the max over ranks."""
    import resource

    out = {
        f"perf/memory/{prefix}_{name}_gib": sum(t.numel() * t.element_size() for t in tensors) / 2**30
        for name, tensors in offload_groups(chunks, optimizer).items()
    }
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    out[f"perf/memory/{prefix}_peak_gib"] = peak / 2**30
    return out
