"""How a worker-group call is split across SPMD ranks and how the results are gathered.

Pure Python (no Ray): the worker group is only the transport. A call goes through two steps:

    per_worker = split_args(mode, coords, args, kwargs)   # one (args, kwargs) per worker, by rank
    outputs    = [worker_i.method(*a, **k) ...]           # done by the transport
    result     = collect_outputs(mode, coords, outputs)

`coords[i]` is the Megatron mesh coordinate of the worker with global rank i.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megarl.data.batch import Batch


class Dispatch(enum.Enum):
    """How a registered worker method is called across a group."""

    ONE_TO_ALL = "one_to_all"  # same args to every worker; list of every output
    ALL_TO_ALL = "all_to_all"  # i-th element of each list argument to worker i; list out
    RANK_ZERO = "rank_zero"  # same args to every worker (collectives need all); rank 0's output
    DP_COMPUTE = "dp_compute"  # Batch args split by dp rank; outputs from the dp-rank owners


@dataclass(frozen=True)
class MeshCoord:
    """Where one worker sits in the Megatron device mesh (world = dp * tp * pp * cp).

    Expert parallelism is folded into the same ranks (Megatron carves ep out of dp*cp*tp), so ep
    is recorded for engines that need it but does not multiply the world size.
    """

    rank: int
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def owns_dp_output(self) -> bool:
        """True for the one rank per dp group whose output is the dp group's result: the first
        tp and cp rank of the last pipeline stage (where the loss / log-probs are produced)."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        return (
            f"rank {self.rank} (dp {self.dp_rank}/{self.dp_size}, tp {self.tp_rank}/{self.tp_size}, "
            f"pp {self.pp_rank}/{self.pp_size}, cp {self.cp_rank}/{self.cp_size}, "
            f"ep {self.ep_rank}/{self.ep_size})"
        )


class MeshError(ValueError):
    """The workers' mesh coordinates do not describe one complete Megatron mesh."""


_AXES = ("dp", "tp", "pp", "cp", "ep")


def validate_mesh(coords: Sequence[MeshCoord]) -> None:
    """Raise MeshError unless `coords` (indexed by global rank) form one complete mesh."""
    if not coords:
        raise MeshError("a worker group needs at least one worker; got no mesh coordinates")
    world = len(coords)
    for index, coord in enumerate(coords):
        if coord.rank != index:
            raise MeshError(f"mesh coordinates must be ordered by rank: position {index} holds rank {coord.rank}")
    _check_sizes_agree(coords)
    first = coords[0]
    for coord in coords:
        for axis in _AXES:
            rank, size = getattr(coord, f"{axis}_rank"), getattr(coord, f"{axis}_size")
            if size < 1 or not 0 <= rank < size:
                raise MeshError(f"{coord.describe()}: {axis}_rank={rank} is outside [0, {axis}_size={size})")
    product = first.dp_size * first.tp_size * first.pp_size * first.cp_size
    if product != world:
        raise MeshError(
            f"mesh is incomplete: dp_size*tp_size*pp_size*cp_size = {first.dp_size}*{first.tp_size}*"
            f"{first.pp_size}*{first.cp_size} = {product}, but the group has {world} workers"
        )
    if world % (first.ep_size * first.pp_size) != 0:
        raise MeshError(f"ep_size={first.ep_size} * pp_size={first.pp_size} does not divide the world size {world}")
    _check_positions_unique(coords)


def _check_sizes_agree(coords: Sequence[MeshCoord]) -> None:
    first = coords[0]
    for coord in coords[1:]:
        for axis in _AXES:
            size, expected = getattr(coord, f"{axis}_size"), getattr(first, f"{axis}_size")
            if size != expected:
                raise MeshError(
                    f"rank {coord.rank} reports {axis}_size={size} but rank 0 reports {axis}_size={expected}"
                )


def _check_positions_unique(coords: Sequence[MeshCoord]) -> None:
    seen: dict[tuple[int, int, int, int], int] = {}
    for coord in coords:
        position = (coord.dp_rank, coord.tp_rank, coord.pp_rank, coord.cp_rank)
        if position in seen:
            raise MeshError(
                f"ranks {seen[position]} and {coord.rank} claim the same mesh position "
                f"(dp={position[0]}, tp={position[1]}, pp={position[2]}, cp={position[3]})"
            )
        seen[position] = coord.rank


def dp_output_ranks(coords: Sequence[MeshCoord]) -> list[int]:
    """Global ranks whose outputs make up a DP_COMPUTE result, ordered by dp rank."""
    owners = sorted((c for c in coords if c.owns_dp_output), key=lambda c: c.dp_rank)
    dp_size = coords[0].dp_size
    if [c.dp_rank for c in owners] != list(range(dp_size)):
        found = [c.dp_rank for c in owners]
        raise MeshError(f"expected one output owner per dp rank 0..{dp_size - 1}, found dp ranks {found}")
    return [c.rank for c in owners]


Call = tuple[tuple, dict]


def split_args(mode: Dispatch, coords: Sequence[MeshCoord], args: tuple, kwargs: dict) -> list[Call]:
    """One (args, kwargs) per worker, in rank order."""
    return _SPLITTERS[mode](coords, args, kwargs)


def collect_outputs(mode: Dispatch, coords: Sequence[MeshCoord], outputs: Sequence[Any]) -> Any:
    """Reduce the per-worker outputs (in rank order) to what the controller sees."""
    if len(outputs) != len(coords):
        raise ValueError(f"{mode.name}: got {len(outputs)} outputs for {len(coords)} workers")
    return _COLLECTORS[mode](coords, outputs)


def _same_to_all(coords: Sequence[MeshCoord], args: tuple, kwargs: dict) -> list[Call]:
    return [(args, kwargs) for _ in coords]


def _split_all_to_all(coords: Sequence[MeshCoord], args: tuple, kwargs: dict) -> list[Call]:
    world = len(coords)
    named = [(f"positional argument {i}", a) for i, a in enumerate(args)]
    named += [(f"argument '{k}'", v) for k, v in kwargs.items()]
    for name, value in named:
        is_list = isinstance(value, (list, tuple))
        if not is_list or len(value) != world:
            got = f"a {type(value).__name__} of length {len(value)}" if is_list else type(value).__name__
            raise ValueError(f"ALL_TO_ALL: {name} must be a list with one element per worker ({world}), got {got}")
    return [(tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()}) for i in range(world)]


def _split_dp_compute(coords: Sequence[MeshCoord], args: tuple, kwargs: dict) -> list[Call]:
    dp_size = coords[0].dp_size
    chunked_args = [_chunk_if_batch(f"positional argument {i}", a, dp_size) for i, a in enumerate(args)]
    chunked_kwargs = {k: _chunk_if_batch(f"argument '{k}'", v, dp_size) for k, v in kwargs.items()}
    calls = []
    for coord in coords:
        calls.append(
            (
                tuple(a[coord.dp_rank] if chunked else a for chunked, a in chunked_args),
                {k: v[coord.dp_rank] if chunked else v for k, (chunked, v) in chunked_kwargs.items()},
            )
        )
    return calls


def _chunk_if_batch(name: str, value: Any, dp_size: int) -> tuple[bool, Any]:
    """(True, chunks) for a Batch, (False, value) for anything else (broadcast unchanged)."""
    if not isinstance(value, Batch):
        return False, value
    if len(value) % dp_size != 0:
        raise ValueError(
            f"DP_COMPUTE: {name} is a Batch of {len(value)} rows, which is not divisible by dp_size={dp_size}; "
            f"size the batch to a multiple of {dp_size} (e.g. in the trainer's batch-size settings)"
        )
    return True, value.chunk(dp_size)


def _collect_list(coords: Sequence[MeshCoord], outputs: Sequence[Any]) -> list:
    return list(outputs)


def _collect_rank_zero(coords: Sequence[MeshCoord], outputs: Sequence[Any]) -> Any:
    return outputs[0]


def _collect_dp_compute(coords: Sequence[MeshCoord], outputs: Sequence[Any]) -> Any:
    owned = [outputs[rank] for rank in dp_output_ranks(coords)]
    if owned and all(isinstance(o, Batch) for o in owned):
        return Batch.concat(owned)
    return owned


_SPLITTERS: dict[Dispatch, Callable[[Sequence[MeshCoord], tuple, dict], list[Call]]] = {
    Dispatch.ONE_TO_ALL: _same_to_all,
    Dispatch.ALL_TO_ALL: _split_all_to_all,
    Dispatch.RANK_ZERO: _same_to_all,
    Dispatch.DP_COMPUTE: _split_dp_compute,
}

_COLLECTORS: dict[Dispatch, Callable[[Sequence[MeshCoord], Sequence[Any]], Any]] = {
    Dispatch.ONE_TO_ALL: _collect_list,
    Dispatch.ALL_TO_ALL: _collect_list,
    Dispatch.RANK_ZERO: _collect_rank_zero,
    Dispatch.DP_COMPUTE: _collect_dp_compute,
}
