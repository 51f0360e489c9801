"""Balancing rows by token count: micro-batches under a token budget, rows across ranks.

Pure functions of the rows' lengths. A long-tail batch (a few long responses among many short
ones) makes row-count micro-batches uneven and data-parallel ranks wait for the rank that drew the
long rows; grouping by tokens keeps every micro-batch under a memory budget and every rank's work
alike (verl's dynamic batch size and balance_batch ideas). Greedy longest-first placement
(LPT) is within 4/3 of the best possible largest load and costs O(n log n).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


def _lpt(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Longest first, each row to the least-loaded of k parts."""
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, p) for p in range(k)]  # (load, part)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, p = heapq.heappop(heap)
        parts[p].append(i)
        heapq.heappush(heap, (load + lengths[i], p))
    return parts


def _fits(parts: list[list[int]], lengths: Sequence[int], max_tokens: int) -> bool:
    return all(len(p) == 1 or sum(lengths[i] for i in p) <= max_tokens for p in parts)


def min_micro_batches(lengths: Sequence[int], max_tokens: int) -> int:
    """The fewest micro-batches that keep every one at or under `max_tokens` (a row longer than
    the budget goes alone) when packed longest-first."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_micro_batch must be > 0, got {max_tokens}")
    n = len(lengths)
    alone = sum(1 for n_tokens in lengths if n_tokens > max_tokens)
    rest = sum(n_tokens for n_tokens in lengths if n_tokens <= max_tokens)
    k = min(max(1, alone + math.ceil(rest / max_tokens)), max(n, 1))
    while k < n and not _fits(_lpt(lengths, k), lengths, max_tokens):
        k += 1
    return k


def partition_micro_batches(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Row indices of k micro-batches with balanced token counts; each keeps its rows in their
    original order, and the micro-batches come in order of their first row."""
    if not 1 <= k <= len(lengths):
        raise ValueError(f"cannot split {len(lengths)} rows into {k} non-empty micro-batches")
    parts = [sorted(p) for p in _lpt(lengths, k)]
    return sorted(parts, key=lambda p: p[0])


# Rows are moved only when the ranks' largest load drops by more than this fraction: a near-even
# batch keeps its order (and its mini-batches), since moving rows there buys nothing.
REBALANCE_GAIN = 0.05


def balance_across_ranks(lengths: Sequence[int], n_ranks: int) -> list[int]:
    """A row order whose consecutive `Batch.chunk(n_ranks)` pieces carry balanced token counts.

    The pieces keep the sizes chunk() gives them (differing by at most one row, larger first),
    so the rows per rank do not change, only which rows. The identity order when balancing would
    lower the largest load by REBALANCE_GAIN or less.
    """
    n = len(lengths)
    base, extra = divmod(n, n_ranks)
    sizes = [base + (1 if r < extra else 0) for r in range(n_ranks)]
    loads = [0] * n_ranks
    ranks: list[list[int]] = [[] for _ in range(n_ranks)]
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        r = min((r for r in range(n_ranks) if len(ranks[r]) < sizes[r]), key=lambda r: (loads[r], r))
        ranks[r].append(i)
        loads[r] += lengths[i]
    order = [i for part in ranks for i in sorted(part)]
    starts = [sum(sizes[:r]) for r in range(n_ranks)]
    naive = max((sum(lengths[s : s + size]) for s, size in zip(starts, sizes)), default=0)
    return order if max(loads, default=0) < naive * (1 - REBALANCE_GAIN) else list(range(n))


def balance_groups_across_ranks(lengths: Sequence[int], groups: Sequence, n_ranks: int) -> list[int]:
    """balance_across_ranks for whole groups (rows sharing a group id, e.g. a prompt's samples): a
    row order that keeps every group's rows together, in their order, groups balanced by their
    summed tokens over the ranks. The groups must share one size and split evenly over the ranks
    (then every rank gets whole groups and as many rows)."""
    rows_of: dict = {}
    for i, g in enumerate(groups):
        rows_of.setdefault(g, []).append(i)
    members = list(rows_of.values())
    sizes = {len(m) for m in members}
    if len(sizes) > 1 or len(members) % n_ranks:
        raise ValueError(
            f"cannot keep groups whole over {n_ranks} ranks: {len(members)} groups of sizes {sorted(sizes)}; "
            "each rank needs the same number of equal groups"
        )
    order = balance_across_ranks([sum(lengths[i] for i in m) for m in members], n_ranks)
    return [i for g in order for i in members[g]]
