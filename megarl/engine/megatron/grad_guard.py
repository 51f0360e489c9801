"""No rank applies a gradient that is not finite.

Megatron skips an optimizer step on inf/NaN only under loss scaling (fp16); in fp32 and bf16 a
NaN loss or gradient on one rank is applied, and every parameter becomes NaN. `grads_finite` is
asked before the step: one reduction over this rank's gradient buffers (the summed gradients
after data-parallel reduction, or this rank's own where the distributed optimizer's
reduce-scatter left them unreduced: a NaN anywhere stays visible on the rank that made it) and a
one-number all-reduce, so every rank agrees to skip. The trainer then stops the run with one line
(trainer/finite.py); the actor keeps its last good weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def grads_finite(model_chunks) -> bool:
    total = torch.zeros((), dtype=torch.float64)
    for chunk in model_chunks:
        for buffer in [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]:
            total += buffer.grad_data.sum(dtype=torch.float64).cpu()
    bad = torch.tensor([0.0 if torch.isfinite(total) else 1.0])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad.item())
