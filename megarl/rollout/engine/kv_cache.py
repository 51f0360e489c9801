"""The engine's KV cache: transformers' DynamicCache whose layers append in place.

transformers' `DynamicLayer.update` appends a step's keys and values with `torch.cat`, which
copies the layer's whole cache on every decode step: 22% of a 256-row decode step at 190 cached
columns on the tiny Qwen3-MoE (torch profiler, fully_async run of benchmarks/bench_async.py).
`GrowableLayer` keeps each layer's keys and values in a buffer with spare columns at the right:
a step writes its new columns into the spare ones and the layer's `keys` / `values` become a
view of the filled part, so a decode step copies only what it adds. When the spare columns run
out the buffer is reallocated with `headroom` more (amortised: one copy per `headroom` steps).
A batch's headroom is what its rows can still use (`headroom_for`: the largest remaining
`max_new_tokens` after the prefill's token, at most HEADROOM). A fixed 64 made every prefill of
the quickstart's 2-token rows allocate, fault in and copy a buffer ~10x the cache they use: a
256-row generation took 31-42 ms with it and 25-26 ms without (benchmarks/bench_generate_path.py
measures the engine alone against HF `generate`).

The scheduler's other cache edits keep the buffer too: finished rows leave in place
(`batch_select_indices`: only the rows after the first finished one move down; the buffer's
leading rows are the cache), leading padding is trimmed by moving the buffer's start
(kv_merge.trim_front, no copy), and a joining batch is merged into one new buffer with headroom
(kv_merge.merge_into, one copy). Code that assigns `keys` / `values` itself is respected: the
next update sees they are no longer the views it handed out and moves them into a fresh buffer.
The attention sees the same values, so outputs are bit-identical to DynamicCache
(tests/rollout/engine/test_kv_cache.py, every tiny architecture). Measured per decode step
(benchmarks/bench_kv_cache.py): 1.2x at 256 rows x 190 columns, 1.7x when a row leaves every
step; no change at narrow caches. MEGARL_KV_CACHE=dynamic gives transformers' layers back.
"""

from __future__ import annotations

import functools
import os

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

HEADROOM = 64  # spare columns per (re)allocation


def headroom_for(remaining_tokens: int) -> int:
    """Spare columns for a batch whose rows may still sample up to `remaining_tokens` each: the
    prefill samples the first without a new column, every later token feeds one."""
    return max(1, min(HEADROOM, remaining_tokens - 1))


class GrowableLayer(DynamicLayer):
    def __init__(self, headroom: int = HEADROOM):
        super().__init__()
        self.headroom = headroom

    def lazy_initialization(self, key_states: torch.Tensor):
        super().lazy_initialization(key_states)
        self._kbuf = self._vbuf = None

    def update(self, key_states, value_states, cache_kwargs=None):
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        new = key_states.shape[-2]
        if self.keys.numel() == 0:  # the first forward (a prefill): nothing to keep
            width = 0
            self._realloc(key_states, value_states, 0, new)
        else:
            width = self.keys.shape[-2]
            if not self._owned() or width + new > self._kbuf.shape[-2]:
                self._realloc(self.keys, self.values, width, new)
        self._kbuf[..., width : width + new, :].copy_(key_states)
        self._vbuf[..., width : width + new, :].copy_(value_states)
        self._views(width + new)
        return self.keys, self.values

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index`, in that order (finished rows leave), in place: only the rows whose
        position changes are copied (those after the first finished row, when the order is
        kept), then the buffer's leading rows are the cache. No reallocation, unless `index` has
        more rows than the cache (rows repeated): then a gathered copy."""
        if not self.is_initialized or self.keys.numel() == 0 or not self._owned():
            super().batch_select_indices(index)
            return
        width, index = self.keys.shape[-2], index.to(self._kbuf.device)
        if len(index) > self._kbuf.shape[0]:  # rows repeated (a prefill shared by several rows): new buffers
            with torch.inference_mode():
                self._kbuf, self._vbuf = self._kbuf.index_select(0, index), self._vbuf.index_select(0, index)
            self._views(width)
            return
        moved = index != torch.arange(len(index), device=index.device)  # tensor ops: no loop over rows
        if bool(moved.any()):  # gathered into a temporary first, so sources may also be destinations
            dst, src = moved.nonzero()[:, 0], index[moved]
            with torch.inference_mode():  # the buffers are inference tensors (the forward made them)
                # the filled columns only: the headroom holds nothing yet (64 columns at first)
                for buf in (self._kbuf[..., :width, :], self._vbuf[..., :width, :]):
                    buf.index_copy_(0, dst, buf.index_select(0, src))
        self._kbuf, self._vbuf = self._kbuf[: len(index)], self._vbuf[: len(index)]
        self._views(width)

    batch_select_indices = select_rows

    def trim_front(self, columns: int) -> None:
        """Drop the first `columns` columns: the buffer's start moves, nothing is copied."""
        if not self._owned():
            self.keys, self.values = self.keys[..., columns:, :], self.values[..., columns:, :]
            return
        width = self.keys.shape[-2]
        self._kbuf, self._vbuf = self._kbuf[..., columns:, :], self._vbuf[..., columns:, :]
        self._views(width - columns)

    def append_rows(self, other: GrowableLayer) -> None:
        """`other`'s rows after these, the narrower left-padded with zero columns, in one copy. The
        merged batch keeps the larger of the two headrooms (the joined rows may need more)."""
        (ka, va), (kb, vb) = (self.keys, self.values), (other.keys, other.values)
        self.headroom = max(self.headroom, other.headroom)
        width = max(ka.shape[-2], kb.shape[-2])
        rows = ka.shape[0]
        kbuf = ka.new_empty((rows + kb.shape[0], *ka.shape[1:-2], width + self.headroom, ka.shape[-1]))
        vbuf = va.new_empty((rows + vb.shape[0], *va.shape[1:-2], width + self.headroom, va.shape[-1]))
        for (k, v), sl in (((ka, va), slice(0, rows)), ((kb, vb), slice(rows, None))):
            pad = width - k.shape[-2]  # zeros, not garbage: masked out, but 0 * NaN would not be
            kbuf[sl, ..., :pad, :].zero_()
            vbuf[sl, ..., :pad, :].zero_()
            kbuf[sl, ..., pad:width, :].copy_(k)
            vbuf[sl, ..., pad:width, :].copy_(v)
        self._kbuf, self._vbuf = kbuf, vbuf
        self._views(width)

    def _owned(self) -> bool:
        return self._kbuf is not None and self.keys is self._kview and self.values is self._vview

    def _views(self, width: int) -> None:
        self.keys = self._kview = self._kbuf[..., :width, :]
        self.values = self._vview = self._vbuf[..., :width, :]

    def _realloc(self, keys, values, width: int, new: int) -> None:
        """A buffer with room for `new` columns plus headroom, holding the first `width` columns of keys/values."""
        capacity = width + new + self.headroom
        self._kbuf = keys.new_empty((*keys.shape[:-2], capacity, keys.shape[-1]))
        self._vbuf = values.new_empty((*values.shape[:-2], capacity, values.shape[-1]))
        if width:
            self._kbuf[..., :width, :].copy_(keys)
            self._vbuf[..., :width, :].copy_(values)


def new_engine_cache(headroom: int = HEADROOM) -> DynamicCache:
    """An empty DynamicCache whose layers (created on first use) are GrowableLayers with
    `headroom` spare columns (MEGARL_KV_CACHE=dynamic: transformers' own layers, for comparisons)."""
    cache = DynamicCache()
    if os.environ.get("MEGARL_KV_CACHE") != "dynamic":
        cache.layer_class_to_replicate = functools.partial(GrowableLayer, headroom=headroom)
    return cache
