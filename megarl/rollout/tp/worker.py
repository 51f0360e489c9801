"""What every rank does with a command: forward on its shard with its own KV caches, load its
slices of a weight update, release and re-allocate its parameters.

Rank 0 runs the very commands it broadcasts (runner.py), so all ranks execute the same code on
the same inputs. A command that uses collectives runs them unconditionally on every rank: a
weight update that one rank cannot apply still goes through both votes everywhere, so the mesh
stays in lockstep and the update is refused on all ranks (nothing written). Any other exception
out of `execute` means the ranks may have diverged; the callers treat it as fatal.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from megarl.rollout.tp.sharding import ShardSpec, shard_spec


# (HF name, full shape, fetch this rank's slice given its ShardSpec)
UpdateItem = tuple[str, tuple[int, ...], Callable[[ShardSpec], torch.Tensor]]


class UpdateRejected(ValueError):
    """A weight update failed its checks on some rank; no rank wrote anything."""


class UpdateFailed(RuntimeError):
    """A checked weight update failed while writing on some rank; ranks may hold mixed weights."""


def check_update(shapes: list[tuple[str, tuple[int, ...]]], full_shapes: dict, model_name: str) -> None:
    """All-or-nothing check of (name, full shape) pairs against the model's full HF shapes."""
    problems = []
    for name, shape in shapes:
        expected = full_shapes.get(name)
        if expected is None:
            problems.append(f"{name!r} is not a parameter of {model_name}")
        elif tuple(shape) != tuple(expected):
            problems.append(f"{name!r} has shape {tuple(shape)}, the model expects {tuple(expected)}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UpdateRejected("weight update rejected, nothing was written: " + "; ".join(problems[:5]) + more)


def encode_inputs(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> dict:
    """Model inputs in a compact, picklable form (the 0/1 mask bit-packed: it grows every step)."""
    mask = mask.cpu().numpy()
    return {"ids": ids.cpu().numpy(), "positions": positions.cpu().numpy(),
            "mask": np.packbits(mask.astype(bool), axis=-1), "mask_width": mask.shape[-1]}


def decode_inputs(cmd: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = np.unpackbits(cmd["mask"], axis=-1, count=cmd["mask_width"])
    return (torch.from_numpy(cmd["ids"]).to(device), torch.from_numpy(mask).long().to(device),
            torch.from_numpy(cmd["positions"]).to(device))


class RankWorker:
    def __init__(self, model, plan: dict[str, str], full_shapes: dict[str, tuple[int, ...]], tp: int,
                 rank: int, device: torch.device):
        self.model, self.plan, self.full_shapes = model, plan, full_shapes
        self.tp, self.rank, self.device = tp, rank, device
        self.tensors = model.state_dict(keep_vars=True)  # HF name -> this rank's Parameter/buffer
        self._caches: dict[int, object] = {}  # cache id -> this rank's DynamicCache (local heads)
        self._released: dict[str, tuple[torch.Size, torch.dtype]] = {}

    def execute(self, cmd: dict):
        op = cmd["op"]
        if op == "forward":
            return self.forward(cmd)
        if op == "update":
            return self.update(cmd)
        if op == "release":
            return self.release()
        if op == "resume":
            return self.resume()
        raise ValueError(f"unknown TP command {op!r}")

    # ---- forward -----------------------------------------------------------------------------------
    def forward(self, cmd: dict) -> torch.Tensor:
        """Logits for the command's inputs: full-vocab on rank 0, this rank's part elsewhere."""
        from transformers import DynamicCache

        for cache_id in cmd["drop"]:  # batches that rank 0 has finished with
            self._caches.pop(cache_id, None)
        cache = self._caches.get(cmd["cache"])
        if cache is None:  # the first step of a new batch
            cache = self._caches[cmd["cache"]] = DynamicCache()
        if cmd["keep"] is not None:  # finished rows leave the KV cache, as on rank 0
            cache.batch_select_indices(torch.tensor(cmd["keep"], device=self.device))
        ids, mask, positions = decode_inputs(cmd, self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                             use_cache=True, logits_to_keep=0 if cmd["keep_all"] else 1)
        return out.logits

    # ---- weights -----------------------------------------------------------------------------------
    def update(self, cmd: dict) -> list[str]:
        """Check, vote, write, vote. Returns the HF names written (the same on every rank)."""
        items, error = [], None
        try:
            items = self._update_items(cmd)
            check_update([(name, shape) for name, shape, _ in items], self.full_shapes, type(self.model).__name__)
        except Exception as exc:  # noqa: BLE001  (reported to rank 0 through the vote, never dropped)
            error = str(exc) or repr(exc)
        errors = self._vote(error)
        if any(errors):
            raise UpdateRejected(self._describe(errors))
        try:
            self._write(items)
        except Exception as exc:  # noqa: BLE001  (same: the vote carries it)
            error = f"{type(exc).__name__}: {exc}"
        errors = self._vote(error)
        if any(errors):
            raise UpdateFailed(f"weight update failed while writing ({self._describe(errors)}); ranks may now "
                               "hold a mix of old and new weights: send a full update")
        return [name for name, _, _ in items]

    def _update_items(self, cmd: dict) -> list[UpdateItem]:
        source = cmd["source"]
        if source == "named":  # in-process full tensors (tp=1 only; never broadcast)
            return [(n, tuple(t.shape), lambda spec, t=t: spec.take(t)) for n, t in cmd["named"]]
        if source == "payloads":
            from megarl.rollout.weights_codec import decode_payload

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

    def _write(self, items: list[UpdateItem]) -> None:
        with torch.no_grad():
            for name, shape, fetch in items:
                self.tensors[name].data.copy_(fetch(shard_spec(name, shape, self.plan, self.tp, self.rank)))

    def _vote(self, error: str | None) -> list[str | None]:
        """Every rank's error (None: fine), in rank order."""
        if self.tp == 1:
            return [error]
        errors: list[str | None] = [None] * self.tp
        dist.all_gather_object(errors, error)
        return errors

    def _describe(self, errors: list[str | None]) -> str:
        distinct = {e for e in errors if e}
        if len(distinct) == 1:  # the usual case: every rank read the same entry
            return distinct.pop()
        return "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)

    def release(self) -> int:
        """Free every parameter's memory on this rank (the layout is kept for `resume`)."""
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
