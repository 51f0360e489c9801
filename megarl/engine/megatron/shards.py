"""Which part of each Hugging Face tensor this rank can produce from its own Megatron shard, with
no communication: the trainer side of the reshard bridge.

mbridge knows how Megatron's fused layouts (QKV grouped by query group, gate/up stacked, vocab
padding) map to HF tensors and how a tensor splits across TP ranks. Rather than restating those
layouts by hand (slime#1059 silently corrupted weights that way), we ask mbridge: push an *index*
tensor — element i along the partition dim holds i — through `_weight_split_across_tp` (which
full-tensor rows does TP rank t hold, in its local order?) and `_weight_to_hf_format` (which
full-tensor row lands at each HF row?). Composing the two gives, for every HF tensor, the rows
this rank holds; they must form one contiguous run in the HF tensor and in the local shard, or the
tensor is refused (never guessed). Maps are cached per layer-independent name, so planning costs
a handful of index conversions per model, not one per layer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.engine.megatron.weights import _is_tp_partitioned, _tp_split, global_tensors

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class LocalPiece:
    """`box` (global coords of the full HF tensor `name`) comes from this rank's shard via `fetch()`."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    box: Box
    fetch: Callable[[], torch.Tensor]  # the box's values, a view of the live parameter


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _whole(shape) -> Box:
    return tuple((0, int(s)) for s in shape)


def _index_tensor(shape: tuple[int, ...], dim: int, reduced: bool) -> torch.Tensor:
    """Element i along `dim` holds i; other dims are size 1 (`reduced`) or broadcast (stride 0)."""
    n = shape[dim]
    view = [1] * len(shape)
    view[dim] = n
    idx = torch.arange(n, dtype=torch.int64).view(view)
    return idx if reduced else idx.expand(shape)


class _RowMaps:
    """Per layer-independent mcore name: for each HF output, the local rows this rank holds."""

    def __init__(self, bridge):
        self.bridge = bridge
        self._cache: dict[tuple, list[tuple[int, int, int] | None]] = {}

    def runs(self, global_name: str, local: torch.Tensor, dim: int, size: int, rank: int):
        """For each HF output of this mcore tensor: (hf_start, local_start, length) or None."""
        key = (re.sub(r"\d+", "*", global_name), tuple(local.shape), dim, size, rank)
        if key not in self._cache:
            self._cache[key] = self._compute(global_name, local, dim, size, rank)
        return self._cache[key]

    def _compute(self, global_name, local, dim, size, rank):
        full_shape = list(local.shape)
        full_shape[dim] *= size
        full_shape = tuple(full_shape)
        # which full rows this rank holds, in local order (mbridge's own TP split)
        reduced_param = torch.empty(tuple(1 if d != dim else local.shape[d] for d in range(local.dim())), device="meta")
        held = self.bridge._weight_split_across_tp(
            global_name, _index_tensor(full_shape, dim, True), reduced_param, size
        )[rank].reshape(-1)
        local_pos = {int(v): i for i, v in enumerate(held.tolist())}
        outputs = self._hf_index(global_name, full_shape, dim)
        runs = []
        for out in outputs:
            rows = out.tolist()
            mine = [(h, local_pos[m]) for h, m in enumerate(rows) if m in local_pos]
            if not mine:
                runs.append(None)
                continue
            h0, l0 = mine[0]
            if any(h != h0 + k or lp != l0 + k for k, (h, lp) in enumerate(mine)):
                raise NotImplementedError(
                    f"{global_name}: the rows TP rank {rank} holds are not one contiguous run of the HF "
                    "tensor; the reshard transport cannot slice it (use bridge.transport=distributed)"
                )
            runs.append((h0, l0, len(mine)))
        return runs

    def _hf_index(self, global_name, full_shape, dim) -> list[torch.Tensor]:
        """The full-tensor row behind each HF row, per HF output (mbridge's conversion on indices)."""
        # the full shape, broadcast (stride 0) so it costs one row of memory: conversions read the
        # config's sizes (QKV views by hidden size), and a reduced shape could reshape "successfully" wrong
        _, outs = self.bridge._weight_to_hf_format(global_name, _index_tensor(full_shape, dim, False))
        return [o.select(1 - dim, 0) if o.dim() == 2 else o.reshape(-1) for o in outs]


def local_hf_pieces(bridge, models) -> list[LocalPiece]:
    """Every HF box this rank can produce from its own parameters, over all its model chunks (virtual
    pipeline stages); replicas included: data-parallel copies list the same boxes, and the planner
    picks who sends. A collective-free call."""
    maps = _RowMaps(bridge)
    pieces: list[LocalPiece] = []
    for global_name, param in global_tensors(models):
        size, rank, _ = _tp_split(global_name)
        hf_names = bridge._weight_name_mapping_mcore_to_hf(global_name)
        if size == 1 or not _is_tp_partitioned(param):
            pieces.extend(_whole_pieces(bridge, global_name, hf_names, param))
            continue
        dim = int(getattr(param, "partition_dim", 0))
        if param.dim() > 2:
            raise NotImplementedError(f"{global_name}: {param.dim()}-d partitioned tensors are not supported")
        full_shapes = _hf_full_shapes(bridge, global_name, param, dim, size)
        for hf_name, run, shape in zip(hf_names, maps.runs(global_name, param, dim, size, rank), full_shapes):
            if run is None:
                continue
            h0, l0, n = run
            box = tuple((h0, h0 + n) if d == dim else (0, s) for d, s in enumerate(shape))
            pieces.append(
                LocalPiece(
                    hf_name,
                    shape,
                    _dtype_name(param.dtype),
                    box,
                    lambda p=param, d=dim, l0=l0, n=n: p.detach().narrow(d, l0, n),
                )
            )
    return pieces


def _whole_pieces(bridge, global_name, hf_names, param) -> list[LocalPiece]:
    """A tensor this rank holds whole: each HF output is one piece (converted when fetched)."""
    _, outs = bridge._weight_to_hf_format(global_name, param.detach().to("meta"))
    return [
        LocalPiece(
            name,
            tuple(o.shape),
            _dtype_name(param.dtype),
            _whole(o.shape),
            lambda g=global_name, p=param, k=k: bridge._weight_to_hf_format(g, p.detach())[1][k],
        )
        for k, (name, o) in enumerate(zip(hf_names, outs))
    ]


def _hf_full_shapes(bridge, global_name, param, dim, size) -> list[tuple[int, ...]]:
    full = list(param.shape)
    full[dim] *= size
    _, outs = bridge._weight_to_hf_format(global_name, torch.empty(full, dtype=param.dtype, device="meta"))
    return [tuple(o.shape) for o in outs]
