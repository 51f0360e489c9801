"""What every rank does with a command: forward on its shard with its own KV caches, take its
part of a weight update (write it, or stage it until a commit), release and re-allocate its
parameters, join and leave weight update groups.

Rank 0 runs the very commands it broadcasts (runners.py), so all ranks execute the same code on
the same inputs. A command that uses collectives runs them unconditionally on every rank: a
weight update that one rank cannot apply still goes through both votes everywhere, so the mesh
stays in lockstep and the update is refused on all ranks (nothing written). Updates that arrive
over an update group are received in full before anything is checked (receive.py says why), and a
receive that failed on any rank destroys that group on every rank. Any other exception out of
`execute` means the ranks may have diverged; the callers treat it as fatal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from megarl.models.hf_names import checkpoint_renamer
from megarl.rollout.engine import kv_merge
from megarl.rollout.engine.attn_mask import forward_step, prepare_model
from megarl.rollout.engine.runner.receive import (
    ReceiveBuffer,
    ReceiveFailed,
    UpdateGroups,
    message_pieces,
    receive_full_tensors,
    receive_messages,
)
from megarl.rollout.engine.runner.sharding import ShardSpec, shard_spec
from megarl.rollout.engine.runner.stage import Piece, Stage, covered_names, names_of, write_pieces

# (HF name, full shape, fetch this rank's slice given its ShardSpec)
UpdateItem = tuple[str, tuple[int, ...], Callable[[ShardSpec], torch.Tensor]]
_GROUP_SOURCES = ("distributed", "reshard")


class UpdateRejected(ValueError):
    """A weight update (or a group or stage command) failed its checks on some rank; no rank wrote anything."""


class UpdateFailed(RuntimeError):
    """A checked weight update failed while writing on some rank; ranks may hold mixed weights."""


@dataclass
class Applied:
    """What an update did; the same on every rank."""

    names: list[str]  # HF names written, or staged
    covered: list[str] = field(default_factory=list)  # names whose whole shard was written on every rank
    staged: int = 0  # pieces staged (defer), 0 when written


def check_update(shapes: list[tuple[str, tuple[int, ...]]], full_shapes: dict, model_name: str) -> None:
    """All-or-nothing check of (name, full shape) pairs against the model's full HF shapes."""
    problems = []
    for name, shape in shapes:
        expected = full_shapes.get(name)
        if expected is None:
            problems.append(f"{name!r} is not a parameter of {model_name}")
        elif tuple(shape) != tuple(expected):
            problems.append(f"{name!r} has shape {tuple(shape)}, the model expects {tuple(expected)}")
    _reject_if(problems)


def _reject_if(problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UpdateRejected("weight update rejected, nothing was written: " + "; ".join(problems[:5]) + more)


def encode_inputs(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> dict:
    """Model inputs in a compact, picklable form (the 0/1 mask bit-packed: it grows every step)."""
    mask = mask.cpu().numpy()
    return {
        "ids": ids.cpu().numpy(),
        "positions": positions.cpu().numpy(),
        "mask": np.packbits(mask.astype(bool), axis=-1),
        "mask_width": mask.shape[-1],
    }


def decode_inputs(cmd: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = np.unpackbits(cmd["mask"], axis=-1, count=cmd["mask_width"])
    return (
        torch.from_numpy(cmd["ids"]).to(device),
        torch.from_numpy(mask).long().to(device),
        torch.from_numpy(cmd["positions"]).to(device),
    )


class RankWorker:
    def __init__(
        self,
        model,
        plan: dict[str, str],
        full_shapes: dict[str, tuple[int, ...]],
        tp: int,
        rank: int,
        device: torch.device,
    ):
        prepare_model(model)  # grouped KV heads without copies under a mask (attn_mask.py)
        self.model, self.plan, self.full_shapes = model, plan, full_shapes
        self.tp, self.rank, self.device = tp, rank, device
        self.tensors = model.state_dict(keep_vars=True)  # HF name -> this rank's Parameter/buffer
        self._rename = checkpoint_renamer(model)  # checkpoint name -> the model's (hf_names.py); None: same
        self._caches: dict[int, object] = {}  # cache id -> this rank's DynamicCache (local heads)
        self._released: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self.groups = UpdateGroups(rank)
        self.stage = Stage(self.tensors, self._local_shape)
        self.buffers = ReceiveBuffer(device)  # receive memory kept across syncs (staging copies out of it)

    def execute(self, cmd: dict):
        handler = {
            "forward": self.forward,
            "update": self.update,
            "commit": self.commit,
            "abort": self.abort,
            "init_group": self.init_group,
            "destroy_group": self.destroy_group,
        }.get(cmd["op"])
        if handler is not None:
            return handler(cmd)
        if cmd["op"] == "release":
            return self.release()
        if cmd["op"] == "resume":
            return self.resume()
        raise ValueError(f"unknown TP command {cmd['op']!r}")

    # ---- forward -----------------------------------------------------------------------------------
    def forward(self, cmd: dict) -> torch.Tensor:
        """Logits for the command's inputs: full-vocab on rank 0, this rank's part elsewhere."""
        from megarl.rollout.engine.kv_cache import new_engine_cache

        cache = self._caches.get(cmd["cache"])
        if cache is None:  # the first step of a new batch
            cache = self._caches[cmd["cache"]] = new_engine_cache(cmd["headroom"])
        self._edit(cache, cmd["edits"])  # as rank 0 did to its cache since the last forward
        for cache_id in cmd["drop"]:  # batches that rank 0 has finished with (after the edits: a
            self._caches.pop(cache_id, None)  # merged cache is consumed by its merge)
        ids, mask, positions = decode_inputs(cmd, self.device)
        with torch.inference_mode():
            out = forward_step(self.model, ids, mask, positions, cache, cmd["keep_all"])
        return out.logits

    def _edit(self, cache, edits: list[tuple]) -> None:
        """Apply continuous batching's cache edits in rank 0's order (runners.py _CacheHandle)."""
        for edit in edits:
            if edit[0] == "select":  # finished rows leave the KV cache
                cache.batch_select_indices(torch.tensor(edit[1], device=self.device))
            elif edit[0] == "trim":
                kv_merge.trim_front(cache, edit[1])
            elif edit[0] == "merge":  # joined rows: their prefill cache, edited first, appended
                other = self._caches.pop(edit[1])
                self._edit(other, edit[2])
                kv_merge.merge_into(cache, other)
            else:
                raise ValueError(f"unknown KV cache edit {edit[0]!r}")

    # ---- weights -----------------------------------------------------------------------------------
    def update(self, cmd: dict) -> Applied:
        """(Receive,) check, copy into the stage's spares (cmd["defer"]), vote; then write or stage.

        One vote serves a deferred update: every rank holds its copies before it votes, so no rank
        answers before all do (the sender may reuse its shared memory as soon as the answer
        arrives), and the spares are not the parameters, so a refused update has written nothing."""
        defer, version = bool(cmd.get("defer")), cmd.get("weight_version")
        pieces, error, broken = [], None, False
        try:
            pieces = self._pieces(cmd)
            if defer:
                self.stage.accept(version)
                try:
                    pieces = self.stage.copy(pieces)
                except Exception as exc:  # noqa: BLE001  (e.g. out of memory; carried by the vote)
                    raise RuntimeError(f"staging failed ({type(exc).__name__}: {exc})") from exc
            elif self._released and cmd["source"] in _GROUP_SOURCES:  # (other sources: the engine checks first)
                raise ValueError(
                    "weights are released; call /resume_memory_occupation before updating them "
                    "(or send the update with defer=true and commit it after resuming)"
                )
        except ReceiveFailed as exc:
            error, broken = str(exc), True
        except Exception as exc:  # noqa: BLE001  (reported to rank 0 through the vote, never dropped)
            error = str(exc) or repr(exc)
        votes = self._gather((error, broken))
        if any(e for e, _ in votes):
            message = self._describe([e for e, _ in votes])
            # a deferred request's version can no longer be completed; a broken group loses the stage
            newly_discarded = defer and self.stage.poison(version, message)
            if any(b for _, b in votes):
                self.stage.discard(message)
                self.groups.destroy(cmd["group_name"])
                raise UpdateRejected(
                    f"{message}. Nothing was written; the group was destroyed on every rank of "
                    "this engine and any staged update discarded: create a new group with "
                    "/init_weights_update_group and send the whole update again"
                )
            if newly_discarded:
                message += f"; the staged update for weight_version {version!r} was discarded"
            raise UpdateRejected(message)
        if defer:
            self.stage.add(version, pieces)
            return Applied(names_of(pieces), staged=len(pieces))
        return self._write(pieces)

    def commit(self, cmd: dict) -> Applied:
        """Write the stage built for cmd["weight_version"] (check, vote, write, vote); it is emptied either way."""
        pieces, error = [], None
        try:
            pieces = self.stage.take(cmd["weight_version"])
        except ValueError as exc:
            error = str(exc)
        errors = self._vote(error)
        if any(errors):
            raise UpdateRejected(
                f"commit of weight_version {cmd['weight_version']!r} refused, nothing was "
                f"written: {self._describe(errors)}"
            )
        return self._write(pieces, swap=True)

    def abort(self, cmd: dict) -> int:
        """Discard the stage; the number of pieces it held (no collective: nothing can fail)."""
        return self.stage.clear()

    def _pieces(self, cmd: dict) -> list[Piece]:
        source = cmd["source"]
        if source == "reshard":
            group = self.groups.get(cmd["group_name"])
            ranks = cmd.get("ranks")
            if not isinstance(ranks, list) or len(ranks) != self.tp:
                got = len(ranks) if isinstance(ranks, list) else type(ranks).__name__
                raise ReceiveFailed(
                    group.name, f"'ranks' must hold one list of messages per engine rank ({self.tp}), got {got}"
                )
            buffers = receive_messages(group, ranks[self.rank], self.buffers)
            pieces, problems = message_pieces(ranks[self.rank], buffers, self._local_shape)
            _reject_if(problems)
            if self._rename is not None:
                pieces = [Piece(self._rename(p.name), p.box, p.read) for p in pieces]
            return pieces
        if source == "distributed":
            full = receive_full_tensors(self.groups.get(cmd["group_name"]), cmd, self.buffers)
            items = [(n, tuple(t.shape), partial(ShardSpec.take, full=t)) for n, t in full]
        else:
            items = self._update_items(cmd)
        if self._rename is not None:  # the checkpoint's names (what senders export) -> the model's
            items = [(self._rename(name), shape, fetch) for name, shape, fetch in items]
        check_update([(name, shape) for name, shape, _ in items], self.full_shapes, type(self.model).__name__)
        pieces = []
        for name, shape, fetch in items:
            pieces.append(Piece(name, None, partial(fetch, shard_spec(name, shape, self.plan, self.tp, self.rank))))
        return pieces

    def _local_shape(self, name: str) -> tuple[int, ...] | None:
        if self._rename is not None:
            name = self._rename(name)
        if name not in self.full_shapes:
            return None
        return shard_spec(name, self.full_shapes[name], self.plan, self.tp, self.rank).local_shape

    def _update_items(self, cmd: dict) -> list[UpdateItem]:
        source = cmd["source"]
        if source == "named":  # in-process full tensors (tp=1 only; never broadcast)
            return [(n, tuple(t.shape), lambda spec, t=t: spec.take(t)) for n, t in cmd["named"]]
        if source == "payloads":
            from megarl.wire.weights_codec import decode_payload

            payloads = cmd["payloads"]
            entry = payloads[self.rank] if len(payloads) == self.tp else payloads[0]
            named = decode_payload(entry, cmd["load_format"])
            return [(n, tuple(t.shape), lambda spec, t=t: spec.take(t)) for n, t in named]
        if source == "disk":
            return self._file_items(cmd["files"])
        raise ValueError(f"unknown weight source {source!r}")

    def _file_items(self, files: list[str]) -> list[UpdateItem]:
        """Every tensor of the safetensors files, read lazily: a rank reads only its slice."""
        from safetensors import safe_open

        items = []
        for path in files:
            handle = safe_open(path, framework="pt", device="cpu")
            for name in handle.keys():
                part = handle.get_slice(name)
                items.append((name, tuple(part.get_shape()), lambda spec, part=part: part[spec.index()]))
        return items

    def _write(self, pieces: list[Piece], swap: bool = False) -> Applied:
        """Write the pieces (`swap`: staged pieces; whole parameters are swapped in, stage.py), vote."""
        error, covered = None, []
        try:
            covered = covered_names(pieces, self._local_shape)
            write_pieces(self.tensors, self.stage.swap_in(pieces, covered) if swap else pieces)
        except Exception as exc:  # noqa: BLE001  (same: the vote carries it)
            error = f"{type(exc).__name__}: {exc}"
        votes = self._gather((error, covered))
        errors = [e for e, _ in votes]
        if any(errors):
            raise UpdateFailed(
                f"weight update failed while writing ({self._describe(errors)}); ranks may now "
                "hold a mix of old and new weights: send a full update"
            )
        on_every_rank = set.intersection(*(set(c) for _, c in votes))
        return Applied(names_of(pieces), [n for n in covered if n in on_every_rank])

    # ---- update groups -------------------------------------------------------------------------------
    def init_group(self, cmd: dict) -> str:
        """Check, vote, join (blocks until the group is formed), vote: kept on every rank or on none."""
        error = None
        try:
            self.groups.check_new(cmd)
        except ValueError as exc:
            error = str(exc)
        errors = self._vote(error)
        if any(errors):
            raise UpdateRejected(self._describe(errors))
        try:
            group = self.groups.join(cmd)
        except Exception as exc:  # noqa: BLE001  (carried by the vote)
            error = f"rank {self.rank} could not join: {type(exc).__name__}: {exc}"
        errors = self._vote(error)
        if any(errors):
            self.groups.destroy(cmd["group_name"])
            raise UpdateRejected(
                f"weight update group {cmd['group_name']!r} was not formed, no rank kept it: {self._describe(errors)}"
            )
        first = cmd["rank_offset"]
        return (
            f"joined weight update group {group.name!r} as ranks {first}..{first + self.tp - 1} of "
            f"{group.world_size} ({group.backend})"
        )

    def destroy_group(self, cmd: dict) -> str:
        errors = self._vote(
            None
            if self.groups.destroy(cmd["group_name"])
            else f"weight update group {cmd['group_name']!r} does not exist on this engine"
        )
        if any(errors):
            raise UpdateRejected(self._describe(errors))
        return f"destroyed weight update group {cmd['group_name']!r}"

    def _vote(self, error: str | None) -> list[str | None]:
        """Every rank's error (None: fine), in rank order."""
        return self._gather(error)

    def _gather(self, value) -> list:
        if self.tp == 1:
            return [value]
        values = [None] * self.tp
        dist.all_gather_object(values, value)
        return values

    def _describe(self, errors: list[str | None]) -> str:
        distinct = {e for e in errors if e}
        if len(distinct) == 1:  # the usual case: every rank read the same entry
            return distinct.pop()
        return "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)

    def release(self) -> int:
        """Free every parameter's memory on this rank (the layout is kept for `resume`)."""
        self.stage.drop_spares()
        self.buffers.drop()
        for name, param in self.model.named_parameters():
            self._released[name] = (param.shape, param.dtype)
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        return len(self._released)

    def resume(self) -> list[str]:
        """Re-allocate released parameters (uninitialised); returns their names, to be refilled."""
        params = dict(self.model.named_parameters())
        for name, (shape, dtype) in self._released.items():
            params[name].data = torch.empty(shape, dtype=dtype, device=self.device)
        names = list(self._released)
        self._released.clear()
        return names
