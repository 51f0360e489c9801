"""KV-cache surgery for continuous batching: merge two batches' caches, trim shared padding.

A batch's cache holds, per layer, keys and values [rows, heads, width, head_dim] whose column c
is the cache entry of the batch's c-th input column; rows are left-padded, so every row's tokens
sit contiguously at the right end and its padding columns (attention mask 0) hold whatever the
forward wrote there. Two batches of different widths are merged by left-padding the narrower
with zero columns (their mask is 0: no row ever attends to them) and stacking the rows; a row's
RoPE positions are its own (the engine passes position_ids per row), so nothing is re-encoded.
Leading columns that are padding for every row can be dropped (`trim_front`) without changing
any row's attention.

The engine's own caches (kv_cache.py, GrowableLayer) merge into one new buffer with headroom and
trim by moving the buffer's start (no copy); other caches are rebuilt with torch.cat as below.
Works on Hugging Face DynamicCache in both layouts: `cache.layers[i].keys / .values`
(transformers >= 4.56) and the older `cache.key_cache[i] / value_cache[i]` lists. Only full
(non-sliding, non-quantised) dynamic layers are merged: a sliding-window layer keeps only its
last `sliding_window` columns and counts what it dropped (`cumulative_length`), so padding one
would shift its window; such a cache raises `CacheNotMergeable` before anything is changed. The
engine creates its caches as `DynamicCache()` without a config, which gives plain full layers for
every model it serves (sliding windows, where a model has them, are applied by the attention mask,
not by the cache), so all of megarl's tiny models (Qwen2, Qwen3, Llama, Qwen3-MoE, DeepSeek-V3's
MLA, whose HF cache holds per-head keys and values of different head dims) merge.
"""

from __future__ import annotations

import torch


class CacheNotMergeable(TypeError):
    """A cache whose layers cannot be padded and stacked (sliding-window or quantised layers)."""


def _check_layers(cache) -> None:
    for i, layer in enumerate(getattr(cache, "layers", ())):
        if type(layer).__name__ not in ("DynamicLayer", "GrowableLayer") or getattr(layer, "is_sliding", False):
            raise CacheNotMergeable(
                f"KV cache layer {i} is a {type(layer).__name__}; continuous batching merges only full "
                "DynamicLayer caches (a sliding-window or quantised layer cannot be left-padded)"
            )


def _get(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):
        _check_layers(cache)
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _set(cache, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if hasattr(cache, "layers"):
        for layer, (k, v) in zip(cache.layers, kvs):
            layer.keys, layer.values = k, v
    else:
        cache.key_cache[:] = [k for k, _ in kvs]
        cache.value_cache[:] = [v for _, v in kvs]


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - t.shape[-2]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[-2] = missing
    return torch.cat([t.new_zeros(shape), t], dim=-2)


def merge_into(into, other) -> None:
    """Append `other`'s rows after `into`'s, the narrower left-padded with zero columns. Both
    caches must have been through the same model (same layers); `other` is left unusable."""
    a, b = _get(into), _get(other)
    if len(a) != len(b):
        raise ValueError(f"cannot merge KV caches of {len(a)} and {len(b)} layers (not the same model?)")
    if _growable(into) and _growable(other):  # kv_cache.py: one copy into a buffer with headroom
        for la, lb in zip(into.layers, other.layers):
            la.append_rows(lb)
        return
    merged = []
    for (ka, va), (kb, vb) in zip(a, b):
        width = max(ka.shape[-2], kb.shape[-2])
        merged.append(
            (
                torch.cat([_left_pad(ka, width), _left_pad(kb, width)], dim=0),
                torch.cat([_left_pad(va, width), _left_pad(vb, width)], dim=0),
            )
        )
    _set(into, merged)


def trim_front(cache, columns: int) -> None:
    """Drop the first `columns` sequence columns of every layer (padding for every row)."""
    if columns > 0 and _growable(cache):  # kv_cache.py: the buffer's start moves, no copy
        for layer in cache.layers:
            layer.trim_front(columns)
    elif columns > 0:
        _set(cache, [(k[..., columns:, :], v[..., columns:, :]) for k, v in _get(cache)])


def _growable(cache) -> bool:
    return all(type(layer).__name__ == "GrowableLayer" for layer in getattr(cache, "layers", [None]))


def width(cache) -> int:
    kvs = _get(cache)
    return kvs[0][0].shape[-2] if kvs else 0
