"""Boxes: one [start, stop) per dim of a full tensor ("global coords"), and what the bridge does
with them. Pure functions shared by the reshard plan and the Megatron side's pieces."""

from __future__ import annotations

import torch

Box = tuple[tuple[int, int], ...]
ALIGN = 16  # bytes; every entry starts aligned so the receiver can view it in its dtype (as FLAT_ALIGN)


def full_box(shape) -> Box:
    return tuple([(0, int(s)) for s in shape])


def box_numel(box: Box) -> int:
    n = 1
    for start, stop in box:
        n *= stop - start
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """The elements two boxes share, or None when they share none."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo = a0 if a0 > b0 else b0
        hi = a1 if a1 < b1 else b1
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def relative(box: Box, origin: Box) -> Box:
    """`box` in the coordinates of the tensor `full[origin]` (which must contain it)."""
    return tuple([(a - o, b - o) for (a, b), (o, _) in zip(box, origin)])


_ITEMSIZE: dict[str, int] = {}


def itemsize(dtype: str, tensor: str = "") -> int:
    """Bytes per element of a torch dtype named without its prefix ("bfloat16")."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        torch_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(
                f"{tensor}: dtype {dtype!r} is not a torch dtype name; use e.g. 'bfloat16' or "
                "'float32' (str(torch_dtype) without the 'torch.' prefix)"
            )
        size = _ITEMSIZE[dtype] = torch_dtype.itemsize
    return size
