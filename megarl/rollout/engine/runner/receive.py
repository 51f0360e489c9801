"""Weights that arrive over an update group (megarl/wire/update_group.py), as one engine rank sees them: the
groups this rank belongs to, and the two transports.

- distributed (SGLang's /update_weights_from_distributed): group rank 0 broadcasts FULL tensors,
  one broadcast per tensor (load_format None), or one uint8 broadcast of every tensor's bytes back
  to back in `names` order ("flattened_bucket", SGLang's FlattenedTensorBucket: no padding).
- reshard (megarl's /update_weights_from_reshard): the rank receives only its own pieces, one
  point-to-point message per (sender, tag), from many senders at once; each entry of a message is
  a box of the rank's LOCAL shard, its bytes in C order at `offset`. An entry's dtype may differ
  from the parameter's: the values are cast when written, as on every other update path.

Receive first, check after: a rank that refused before taking the bytes would leave its senders
blocked and the group out of step. When the bytes cannot be taken at all (a sender died, a
timeout, metadata that does not say what is being sent) `ReceiveFailed` is raised and the caller
destroys the group on every rank: gloo never recovers from an error, and closing the group makes
the senders' pending operations fail at once instead of waiting out the group's timeout.
"""

from __future__ import annotations

import math

import torch

from megarl.rollout.engine.runner.stage import Box, Piece
from megarl.wire.update_group import UpdateGroup, join_update_group


class ReceiveFailed(RuntimeError):
    """The bytes of an update could not be received over group `group_name`: the group is unusable."""

    def __init__(self, group_name: str, what: str):
        super().__init__(f"receiving over weight update group {group_name!r} failed: {what}")
        self.group_name = group_name


def parse_dtype(text) -> torch.dtype:
    """ "float32", "bfloat16" (SGLang's strings; "torch.float32" also accepted) -> torch dtype."""
    dtype = getattr(torch, str(text).removeprefix("torch."), None) if isinstance(text, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {text!r} is not a torch dtype name such as 'float32' or 'bfloat16'")
    return dtype


class ReceiveBuffer:
    """This rank's receive memory, kept across updates and carved per request: large buffers come
    straight from mmap and go back to the kernel when freed, so a buffer allocated per update faults
    every page in again (30 ms per 64 MiB on the CPU measured, against 3.4 ms for the copy itself).
    Views are valid until the next request: staging and writing copy out of them before it returns."""

    ALIGN = 64  # bytes between carved parts: every part can be viewed in any dtype

    def __init__(self, device: torch.device):
        self.device = device
        self._buffer: torch.Tensor | None = None

    def carve(self, sizes: list[int]) -> list[torch.Tensor]:
        """One uint8 view per size, back to back (aligned) in the kept buffer, grown when too small."""
        offsets, end = [], 0
        for size in sizes:
            if size < 0:
                raise ValueError(f"a part of {size} bytes")
            offsets.append(end)
            end += -(-size // self.ALIGN) * self.ALIGN
        if self._buffer is None or self._buffer.numel() < end:
            self._buffer = None  # the old one is freed before the new one is taken
            self._buffer = torch.empty(end, dtype=torch.uint8, device=self.device)
        return [self._buffer[o : o + size] for o, size in zip(offsets, sizes)]

    def drop(self) -> None:
        self._buffer = None


class UpdateGroups:
    """This rank's update groups by name (several at once, as SGLang keeps them)."""

    def __init__(self, rank: int):
        self.rank = rank
        self._groups: dict[str, UpdateGroup] = {}

    def check_new(self, cmd: dict) -> None:
        name, rank, world = cmd["group_name"], cmd["rank_offset"] + self.rank, cmd["world_size"]
        if name in self._groups:
            raise ValueError(
                f"weight update group {name!r} already exists on this engine; destroy it first "
                "(/destroy_weights_update_group)"
            )
        if not 0 <= rank < world:
            raise ValueError(
                f"weight update group {name!r}: engine rank {self.rank} would be group rank "
                f"rank_offset + {self.rank} = {rank}, outside world_size {world}"
            )

    def join(self, cmd: dict) -> UpdateGroup:
        """Blocks until every member has joined (or the group's timeout passes)."""
        group = join_update_group(
            cmd["master_address"],
            cmd["master_port"],
            cmd["rank_offset"] + self.rank,
            cmd["world_size"],
            cmd["group_name"],
            cmd["backend"],
        )
        self._groups[group.name] = group
        return group

    def get(self, name: str) -> UpdateGroup:
        if name not in self._groups:
            raise ValueError(
                f"weight update group {name!r} does not exist on this engine (it has "
                f"{sorted(self._groups) or 'none'}); create it with /init_weights_update_group"
            )
        return self._groups[name]

    def destroy(self, name: str) -> bool:
        group = self._groups.pop(name, None)
        if group is not None:
            group.destroy()
        return group is not None


def _wait(group: UpdateGroup, works, what: str) -> None:
    try:
        for work in works:
            work.wait()
    except Exception as exc:  # noqa: BLE001  (gloo raises RuntimeError subclasses; all mean the same)
        raise ReceiveFailed(group.name, f"{what}: {exc}") from exc


# ---- distributed: full tensors from group rank 0 --------------------------------------------------
def receive_full_tensors(group: UpdateGroup, cmd: dict, memory: ReceiveBuffer) -> list[tuple[str, torch.Tensor]]:
    names, dtypes, shapes, load_format = cmd.get("names"), cmd.get("dtypes"), cmd.get("shapes"), cmd.get("load_format")
    try:
        if not (
            isinstance(names, list)
            and isinstance(dtypes, list)
            and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)
        ):
            raise ValueError("names, dtypes and shapes must be lists of equal length")
        metas = [(str(n), parse_dtype(d), tuple(int(s) for s in shape)) for n, d, shape in zip(names, dtypes, shapes)]
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format={load_format!r} is not supported; use null or 'flattened_bucket'")
    except (ValueError, TypeError) as exc:
        raise ReceiveFailed(group.name, f"the request does not say what the sender broadcasts ({exc})") from exc
    sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in metas]
    if load_format is None:  # one broadcast per tensor, in `names` order
        parts = memory.carve(sizes)
        tensors = [part.view(dtype).reshape(shape) for part, (_, dtype, shape) in zip(parts, metas)]
        for (name, _, _), tensor in zip(metas, tensors):
            _wait(group, [group.broadcast(tensor, src=0)], f"broadcast of {name!r} from group rank 0")
        return [(name, tensor) for (name, _, _), tensor in zip(metas, tensors)]
    flat = memory.carve([sum(sizes)])[0]
    _wait(group, [group.broadcast(flat, src=0)], f"flattened bucket of {len(metas)} tensors from group rank 0")
    out, offset = [], 0
    for (name, dtype, shape), size in zip(metas, sizes):
        out.append((name, _view(flat, offset, size, dtype, shape)))
        offset += size
    return out


def _view(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
    raw = buffer[offset : offset + nbytes]
    if offset % dtype.itemsize:  # packed without padding: a view needs the dtype's alignment
        raw = raw.clone()
    return raw.view(dtype).reshape(shape)


# ---- reshard: this rank's own pieces, point to point --------------------------------------------
def receive_messages(group: UpdateGroup, messages, memory: ReceiveBuffer) -> list[torch.Tensor]:
    """Post one recv per message (all before waiting on any: many senders at once), then wait."""
    try:
        if not isinstance(messages, list):
            raise TypeError(f"a rank's entry must be a list of messages, got {type(messages).__name__}")
        wanted = [(int(m["src"]), int(m["tag"]), int(m["nbytes"])) for m in messages]
    except (KeyError, TypeError, ValueError) as exc:
        raise ReceiveFailed(
            group.name, f"the request does not say what to receive ({exc!r}); each message needs src, tag and nbytes"
        ) from exc
    buffers, works = [], []
    try:
        buffers = memory.carve([nbytes for _, _, nbytes in wanted])
        for (src, tag, _), buffer in zip(wanted, buffers):
            works.append(group.recv(buffer, src, tag))
    except Exception as exc:  # noqa: BLE001  (a bad src, a broken pair: the group is out of step)
        raise ReceiveFailed(group.name, f"posting receive {len(works)} of {len(wanted)}: {exc}") from exc
    _wait(group, works, f"{len(wanted)} messages from group ranks {sorted({src for src, _, _ in wanted})}")
    return buffers


def message_pieces(messages: list[dict], buffers: list[torch.Tensor], local_shape) -> tuple[list[Piece], list[str]]:
    """Every entry of the received messages as a piece, checked against this rank's shard
    (`local_shape(name)`: None for a name the model lacks). Returns (pieces, problems)."""
    pieces, problems = [], []
    for index, (message, buffer) in enumerate(zip(messages, buffers)):
        for entry in message.get("entries") or []:
            name = entry.get("name") if isinstance(entry, dict) else None
            try:
                pieces.append(_entry_piece(entry, buffer, local_shape))
            except (KeyError, TypeError, ValueError) as exc:
                problems.append(
                    f"{name!r} (message {index} from group rank {message.get('src')}, tag {message.get('tag')}): {exc}"
                )
    return pieces, problems


def _entry_piece(entry: dict, buffer: torch.Tensor, local_shape) -> Piece:
    name, dtype = entry["name"], parse_dtype(entry["dtype"])
    shape = local_shape(name)
    if shape is None:
        raise ValueError("not a parameter of this model")
    box: Box = tuple((int(start), int(stop)) for start, stop in entry["box"])
    if len(box) != len(shape) or any(not 0 <= a <= b <= s for (a, b), s in zip(box, shape)):
        raise ValueError(f"box {[list(b) for b in box]} is outside this rank's local shard of shape {list(shape)}")
    extent = tuple(b - a for a, b in box)
    offset, nbytes = int(entry["offset"]), math.prod(extent) * dtype.itemsize
    if offset < 0 or offset + nbytes > buffer.numel():
        raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside the {buffer.numel()}-byte message")
    values = _view(buffer, offset, nbytes, dtype, extent)
    return Piece(name, box, lambda: values)
