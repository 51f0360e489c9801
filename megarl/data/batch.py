"""Batch: the one container that travels between the controller and every worker group.

A Batch is a set of equally long columns: tensors (batch dimension first) and non-tensor
columns (1-D numpy object arrays, one Python object per row), plus `meta`, a dict of
batch-level values (temperature, step, metrics) that row operations carry along unchanged.

Every operation returns a new Batch and never mutates its inputs, except `b[key] = value`
and `pop`, which say so in their names. Like tensor views, derived batches share the objects
inside non-tensor columns (repeat_interleave repeats references): replace them, never
mutate a row's list in place. Pickling goes through torch's storage-based tensor
reduction; views are compacted first so that a slice of a large batch ships only its own rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

RowIndex = int | slice | Sequence[int] | np.ndarray | torch.Tensor


class BatchError(ValueError):
    """A Batch operation got columns or indices that do not fit together."""


def as_object_array(values: Any) -> np.ndarray:
    """A 1-D numpy object array with one element per row (lists stay lists, not a 2-D array)."""
    if isinstance(values, np.ndarray) and values.ndim == 1:
        return values if values.dtype == object else values.astype(object)
    if isinstance(values, torch.Tensor):
        raise BatchError("a tensor column belongs in `tensors`, not `non_tensors`")
    items = list(values)
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):  # element-wise: np.array() would build 2-D from lists
        out[i] = item
    return out


def _column_length(key: str, value: torch.Tensor | np.ndarray) -> int:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        raise BatchError(f"tensor column {key!r} is 0-dimensional; put scalars in `meta`")
    return int(value.shape[0])


def _compact(t: torch.Tensor) -> torch.Tensor:
    """The same values in a storage of exactly their size (a view would pickle its whole base)."""
    needed = t.numel() * t.element_size()
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == needed:
        return t
    return t.contiguous().clone()


# dtypes numpy holds exactly; bfloat16 and the rest travel as torch storages
_WIRE_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


def _to_wire(t: torch.Tensor) -> torch.Tensor | np.ndarray:
    """A column as it is pickled: a CPU tensor whose dtype numpy holds goes as an ndarray of just
    its values. A torch storage pickles as a call to whatever `torch.storage._load_from_bytes`
    is in the sending process, and megatron-core replaces that function with its own
    (megatron/core/__init__.py), so every Batch an actor returned made the receiving process
    import megatron-core (seconds of CPU, in the driver) and parse each column with
    `torch.load(weights_only=True)`. An ndarray names only numpy, and Ray ships it as an
    out-of-band buffer."""
    if t.device.type == "cpu" and t.dtype in _WIRE_DTYPES and not (t.requires_grad or t.is_conj() or t.is_neg()):
        return t.contiguous().numpy()
    return _compact(t)


def _from_wire(v: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(v, np.ndarray):  # Ray hands zero-copy arrays read-only; a column must be writable
        return torch.from_numpy(v if v.flags.writeable else v.copy())
    return v


class Batch:
    """Equally long tensor and non-tensor columns plus batch-level meta (see module doc)."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, np.ndarray | list] | None = None,
        meta: dict | None = None,
    ):
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.non_tensors: dict[str, np.ndarray] = {k: as_object_array(v) for k, v in (non_tensors or {}).items()}
        self.meta: dict = dict(meta or {})
        overlap = set(self.tensors) & set(self.non_tensors)
        if overlap:
            raise BatchError(f"keys {sorted(overlap)} are both tensor and non-tensor columns")
        for k, v in self.tensors.items():
            if not isinstance(v, torch.Tensor):
                raise BatchError(
                    f"tensor column {k!r} is a {type(v).__name__}; pass non-tensor columns in `non_tensors`"
                )
        lengths = {k: _column_length(k, v) for k, v in self._columns()}
        if len(set(lengths.values())) > 1:
            raise BatchError(f"columns have different lengths: {lengths}")

    # ---------------------------------------------------------------- columns
    def _columns(self) -> Iterable[tuple[str, torch.Tensor | np.ndarray]]:
        yield from self.tensors.items()
        yield from self.non_tensors.items()

    def __len__(self) -> int:
        for _, value in self._columns():
            return int(value.shape[0])
        return 0

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.non_tensors)

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors

    def _missing(self, keys: Iterable[str]) -> None:
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no column(s) {missing}; it has {self.keys()}")

    def __setitem__(self, key: str, value: torch.Tensor | np.ndarray | list) -> None:
        """Add or replace a column in place; its length must equal len(self) (if any columns)."""
        column = value if isinstance(value, torch.Tensor) else as_object_array(value)
        length = _column_length(key, column)
        if self.keys() and length != len(self):
            raise BatchError(f"column {key!r} has {length} rows but the batch has {len(self)}")
        self.tensors.pop(key, None)
        self.non_tensors.pop(key, None)
        if isinstance(column, torch.Tensor):
            self.tensors[key] = column
        else:
            self.non_tensors[key] = column

    def __getitem__(self, index: str | RowIndex):
        """b["key"] -> the column; b[rows] -> a Batch of those rows (int keeps the batch dim)."""
        if isinstance(index, str):
            self._missing([index])
            return self.tensors[index] if index in self.tensors else self.non_tensors[index]
        return self._take(index)

    def select(self, *keys: str) -> Batch:
        """A Batch with only `keys` (columns shared, not copied) and the same meta."""
        self._missing(keys)
        return Batch(
            {k: v for k, v in self.tensors.items() if k in keys},
            {k: v for k, v in self.non_tensors.items() if k in keys},
            self.meta,
        )

    def pop(self, *keys: str) -> Batch:
        """Remove `keys` from this batch (in place) and return them as a Batch with the same meta."""
        out = self.select(*keys)
        for k in keys:
            self.tensors.pop(k, None)
            self.non_tensors.pop(k, None)
        return out

    def union(self, other: Batch) -> Batch:
        """Columns and meta of both; a key present in both must hold equal values."""
        if self.keys() and other.keys() and len(self) != len(other):
            raise BatchError(f"cannot union batches of {len(self)} and {len(other)} rows")
        tensors, non_tensors, meta = dict(self.tensors), dict(self.non_tensors), dict(self.meta)
        for k, v in other.tensors.items():
            if k in non_tensors or (k in tensors and not _same_tensor(tensors[k], v)):
                raise BatchError(f"union conflict on tensor column {k!r}: values differ")
            tensors[k] = v
        for k, v in other.non_tensors.items():
            if k in tensors or (k in non_tensors and not _same_objects(non_tensors[k], v)):
                raise BatchError(f"union conflict on non-tensor column {k!r}: values differ")
            non_tensors[k] = v
        for k, v in other.meta.items():
            if k in meta and not _same_meta(meta[k], v):
                raise BatchError(f"union conflict on meta {k!r}: {meta[k]!r} != {v!r}")
            meta[k] = v
        return Batch(tensors, non_tensors, meta)

    # ---------------------------------------------------------------- rows
    def _take(self, index: RowIndex) -> Batch:
        rows = _normalize_index(index, len(self))
        np_rows = rows if isinstance(rows, slice) else rows.cpu().numpy()
        tensors = {}
        for k, v in self.tensors.items():
            tensors[k] = v[rows if isinstance(rows, slice) else rows.to(v.device)]
        non_tensors = {k: v[np_rows] for k, v in self.non_tensors.items()}
        return Batch(tensors, non_tensors, self.meta)

    def split(self, sizes: Sequence[int]) -> list[Batch]:
        """Consecutive pieces of the given sizes, which must sum to len(self)."""
        if any(s < 0 for s in sizes) or sum(sizes) != len(self):
            raise BatchError(f"split sizes {list(sizes)} must be >= 0 and sum to {len(self)}")
        out, start = [], 0
        for size in sizes:
            out.append(self[start : start + size])
            start += size
        return out

    def chunk(self, n: int) -> list[Batch]:
        """n consecutive pieces whose sizes differ by at most one (larger pieces first)."""
        if n < 1:
            raise BatchError(f"chunk(n) needs n >= 1, got {n}")
        base, extra = divmod(len(self), n)
        return self.split([base + (1 if i < extra else 0) for i in range(n)])

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order; all must have the same columns.

        meta: the first batch's values win; keys only later batches have are added.
        """
        if not batches:
            raise BatchError("Batch.concat needs at least one batch")
        keys = set(batches[0].keys())
        for i, b in enumerate(batches[1:], start=1):
            if set(b.keys()) != keys:
                raise BatchError(
                    f"Batch.concat: batch {i} has columns {sorted(b.keys())} but batch 0 has {sorted(keys)}"
                )
        tensors = {}
        for k in batches[0].tensors:
            parts = [b.tensors[k] for b in batches]
            shapes = {tuple(p.shape[1:]) for p in parts}
            if len(shapes) > 1:
                raise BatchError(
                    f"Batch.concat: column {k!r} has different per-row shapes {sorted(shapes)}; pad to one length first"
                )
            tensors[k] = torch.cat(parts, dim=0)
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in batches[0].non_tensors}
        meta: dict = {}
        for b in batches:
            for k, v in b.meta.items():
                meta.setdefault(k, v)
        return Batch(tensors, non_tensors, meta)

    def repeat_interleave(self, n: int) -> Batch:
        """Each row repeated n times in place: rows a, b -> a, a, b, b (n=2)."""
        if n < 1:
            raise BatchError(f"repeat_interleave(n) needs n >= 1, got {n}")
        return Batch(
            {k: v.repeat_interleave(n, dim=0) for k, v in self.tensors.items()},
            {k: np.repeat(v, n) for k, v in self.non_tensors.items()},
            self.meta,
        )

    def to(self, device: str | torch.device) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.non_tensors, self.meta)

    # ---------------------------------------------------------------- pickling / display
    def __getstate__(self) -> dict:
        return {
            "tensors": {k: _to_wire(v) for k, v in self.tensors.items()},
            "non_tensors": self.non_tensors,
            "meta": self.meta,
        }

    def __setstate__(self, state: dict) -> None:
        self.tensors = {k: _from_wire(v) for k, v in state["tensors"].items()}
        self.non_tensors, self.meta = state["non_tensors"], state["meta"]

    def __repr__(self) -> str:
        cols = [f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items()]
        cols += [f"{k}: object[{len(v)}]" for k, v in self.non_tensors.items()]
        return f"Batch(len={len(self)}, {', '.join(cols)}, meta={sorted(self.meta)})"


def _normalize_index(index: RowIndex, length: int) -> slice | torch.Tensor:
    """A slice, or a LongTensor of row positions; bool masks must have length rows."""
    if isinstance(index, slice):
        return index
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        i = int(index)
        if not -length <= i < length:
            raise IndexError(f"row {i} is out of range for a batch of {length} rows")
        i %= length
        return slice(i, i + 1)
    rows = torch.as_tensor(np.asarray(index) if not isinstance(index, torch.Tensor) else index)
    if rows.dtype == torch.bool:
        if rows.dim() != 1 or rows.shape[0] != length:
            raise BatchError(f"bool row mask has shape {tuple(rows.shape)}; expected ({length},)")
        return rows.nonzero().squeeze(-1)
    if rows.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dim() != 1:
        raise BatchError(
            f"row index must be a 1-D integer or bool sequence, got {rows.dtype} of shape {tuple(rows.shape)}"
        )
    rows = rows.long()
    if bool(((rows < -length) | (rows >= length)).any()):
        raise IndexError(f"row index out of range for a batch of {length} rows")
    return rows % max(length, 1)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.cpu())))


def _same_objects(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or (len(a) == len(b) and all(_same_meta(x, y) for x, y in zip(a, b)))


def _same_meta(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_tensor(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a, dtype=object), np.asarray(b, dtype=object)))
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # e.g. objects whose == is ambiguous
        return a is b
