"""Group a stream of named tensors into buckets of bounded size (pure, no I/O)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

NamedTensor = tuple[str, torch.Tensor]


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(named: Iterable[NamedTensor], bucket_bytes: int) -> Iterator[list[NamedTensor]]:
    """Consecutive groups whose total size stays within `bucket_bytes`.

    A tensor larger than the bucket travels alone (never split: receivers load whole tensors).
    Order is preserved and no tensor is dropped or repeated.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bridge.bucket_size_mb must be positive (got {bucket_bytes} bytes)")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def with_last_flag(items: Iterable) -> Iterator[tuple[object, bool]]:
    """(item, is_last) pairs with one item of look-ahead."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True
