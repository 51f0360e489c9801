"""Pieces of parameters on one rank, and the stage that deferred updates build until a commit.

A piece is part of one parameter as this rank holds it: a box ([start, stop) per dim) of the
rank's LOCAL shard, or the whole local shard. Every update path ends in pieces: full tensors
(tensor, disk, distributed) become whole-shard pieces of their rank's slice; reshard messages carry
boxes. Writing a piece is `param[box].copy_(values)`, which also casts to the parameter's dtype.

The stage is all or nothing ("never a half-updated model"): pieces received with defer=True for
one weight_version are kept here, and only a commit naming that version writes them. A deferred
request for another version discards the stale stage first. A deferred request that fails leaves
the stage *poisoned* for its version: the rest of that version's pieces are refused and its commit
fails, so a version that lost a bucket can never be committed in part.

Staged values land in *spares*: one tensor per parameter, of its local shape, kept across syncs.
A commit then swaps each parameter whose whole local shard was staged with its spare (`.data`
rebinding: the model keeps its Parameter objects, the old values become the next sync's spare);
parameters staged in part are copied box by box as before. So a commit costs no copy, and staging
writes into memory touched before, never into fresh pages (measured: a fresh 64 MiB buffer costs
30 ms of page faults here, a copy into a warm one 3.4 ms). Until the commit the parameters are
untouched, so a failed sync still leaves the previous weights. The price is one copy of the
rank's shard kept for good (dropped on release). Only for engines whose forward reads parameters
through their modules: CUDA graphs, which capture addresses, would need a copy commit.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

Box = tuple[tuple[int, int], ...]  # [start, stop) per dim, in the rank's local shard coordinates


@dataclass
class Piece:
    name: str  # HF name
    box: Box | None  # None: the whole local shard
    read: Callable[[], torch.Tensor]  # its values (called when written or staged: disk reads lazily)


def box_index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def write_pieces(tensors: dict[str, torch.Tensor], pieces: list[Piece]) -> None:
    with torch.no_grad():
        for piece in pieces:
            target = tensors[piece.name].data
            (target if piece.box is None else target[box_index(piece.box)]).copy_(piece.read())


def names_of(pieces: list[Piece]) -> list[str]:
    return list(dict.fromkeys(p.name for p in pieces))


def covered_names(pieces: list[Piece], local_shape: Callable[[str], tuple[int, ...]]) -> list[str]:
    """Names whose whole local shard these pieces cover (a resumed parameter counts as refilled only
    then). Boxes may come from several senders, so coverage is the union, counted on a mask."""
    boxes: dict[str, list[Box | None]] = {}
    for piece in pieces:
        boxes.setdefault(piece.name, []).append(piece.box)
    covered = []
    for name, parts in boxes.items():
        shape = tuple(local_shape(name))
        if any(box is None or tuple(b - a for a, b in box) == shape for box in parts):
            covered.append(name)
            continue
        volume = sum(math.prod(b - a for a, b in box) for box in parts)
        if volume < math.prod(shape):
            continue  # too few elements to cover it, overlaps or not
        if volume == math.prod(shape) and len(parts) <= 64 and _disjoint(parts):  # a plan's boxes: no mask
            covered.append(name)
            continue
        mask = torch.zeros(shape, dtype=torch.bool)
        for box in parts:
            mask[box_index(box)] = True
        if bool(mask.all()):
            covered.append(name)
    return covered


def _disjoint(boxes: list[Box]) -> bool:
    """No two boxes share an element (two boxes are apart when some dim's ranges are)."""
    return all(
        any(b1 <= a2 or b2 <= a1 for (a1, b1), (a2, b2) in zip(x, y))
        for i, x in enumerate(boxes)
        for y in boxes[i + 1 :]
    )


class Stage:
    def __init__(self, tensors: dict[str, torch.Tensor], local_shape: Callable[[str], tuple[int, ...]]):
        self.tensors, self.local_shape = tensors, local_shape  # HF name -> Parameter; its local shard shape
        self.version: str | None = None  # the weight_version being built (None: nothing staged)
        self.pieces: list[Piece] = []
        self.failure: str | None = None  # why this version's stage was discarded (poisoned)
        self._spares: dict[int, torch.Tensor] = {}  # id(Parameter) -> its spare, kept across syncs

    def accept(self, version: str | None) -> None:
        """Check, before the vote, that a deferred request for `version` may be staged."""
        if version is None:
            raise ValueError("defer=true needs a weight_version: /commit_weight_update names the version it applies")
        if str(version) == self.version and self.failure:
            raise ValueError(
                f"the staged update for weight_version {self.version!r} was already discarded "
                f"({self.failure}); abort it and send the whole version again"
            )

    def copy(self, pieces: list[Piece]) -> list[Piece]:
        """Copy every piece into its parameter's spare (the values may be the sender's memory or a
        receive buffer reused by the next request); the copies, to `add` once every rank has them.
        Writes only spares: a copy whose update is then refused leaves the parameters as they were."""
        copies = []
        with torch.no_grad():
            for piece in pieces:
                spare = self._spare(piece.name)
                target = spare if piece.box is None else spare[box_index(piece.box)]
                target.copy_(piece.read())
                copies.append(Piece(piece.name, piece.box, lambda target=target: target))
        return copies

    def add(self, version: str, copies: list[Piece]) -> None:
        """Stage `copies` (from `copy`) for `version`; a stage of another version is discarded first."""
        self._switch_to(str(version))
        self.pieces.extend(copies)

    def _spare(self, name: str) -> torch.Tensor:
        param = self.tensors[name]
        shape = tuple(self.local_shape(name))  # not param.shape: a released parameter is empty
        spare = self._spares.get(id(param))
        if spare is None or tuple(spare.shape) != shape or spare.dtype != param.dtype or spare.device != param.device:
            spare = self._spares[id(param)] = torch.empty(shape, dtype=param.dtype, device=param.device)
        return spare

    def swap_in(self, pieces: list[Piece], covered: list[str]) -> list[Piece]:
        """Commit the parameters in `covered` (whole local shard staged) by swapping them with their
        spares; returns the pieces still to be written (parameters staged in part)."""
        swapped: set[int] = set()
        for name in covered:
            param = self.tensors[name]
            spare = self._spares.get(id(param))
            if id(param) in swapped or spare is None or spare.shape != param.data.shape:
                continue  # a tied name already swapped, or a parameter not resident: written below
            self._spares[id(param)], param.data = param.data, spare
            swapped.add(id(param))
        return [p for p in pieces if id(self.tensors[p.name]) not in swapped]

    def drop_spares(self) -> None:
        """Free the spares (weights released); the next staged update allocates them again."""
        self._spares.clear()

    def poison(self, version: str | None, reason: str) -> bool:
        """Discard `version`'s stage for good (until an abort or another version); False if it already was."""
        if version is None:
            return False
        self._switch_to(str(version))
        first = self.failure is None
        self.pieces, self.failure = [], self.failure or reason
        return first

    def discard(self, reason: str) -> None:
        """A failure outside a deferred request (a broken group): whatever is staged is lost."""
        self.poison(self.version, reason)

    def take(self, version: str) -> list[Piece]:
        """The pieces to commit for `version`; raises ValueError otherwise. Always leaves the stage empty."""
        version = str(version)
        try:
            if self.version is None:
                raise ValueError(
                    f"nothing is staged for weight_version {version!r}: no update with defer=true "
                    "arrived since the last commit or abort"
                )
            if self.failure:
                raise ValueError(
                    f"the staged update for weight_version {self.version!r} was discarded "
                    f"({self.failure}); send the whole version again"
                )
            if self.version != version:
                raise ValueError(
                    f"the stage holds weight_version {self.version!r}, not {version!r}; it was "
                    f"discarded: send weight_version {version!r} again"
                )
            return self.pieces
        finally:
            self.clear()

    def clear(self) -> int:
        count = len(self.pieces)
        self.version, self.pieces, self.failure = None, [], None
        return count

    def _switch_to(self, version: str) -> None:
        if self.version is not None and self.version != version:
            if self.pieces:
                log.warning(
                    "discarding the stage of weight_version %r (%d pieces): a deferred update for "
                    "weight_version %r arrived before it was committed or aborted",
                    self.version,
                    len(self.pieces),
                    version,
                )
            self.clear()
        self.version = version
