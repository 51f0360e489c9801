"""The engine's handle on the model: `LocalRunner` (tp=1, the model in this process) and
`TPRunner` (rank 0 of a tensor-parallel mesh). Both offer the same calls:

    new_cache(headroom) -> cache    forward(ids, mask, positions, cache, keep_all) -> .logits, .past_key_values
    (LocalRunner.forward also takes a vision-language prefill's `images`: engine/vision.py)
    load_named(named, ...) / load_payloads(payloads, load_format, ...) / load_files(files) -> Applied
    load_distributed(request) / load_reshard(request) -> Applied    (received over an update group)
    commit(weight_version) -> Applied      abort() -> pieces discarded      (the stage of defer=True updates)
    init_update_group(request) -> message  destroy_update_group(name) -> message
    release_weights() -> count      resume_weights() -> names to refill      layout() -> dict     close()

`Applied` (worker.py) names what was written or staged and which parameters were written whole.

    merge_caches(into, other)       trim_cache(cache, columns)        (continuous batching, kv_merge.py)

`cache.batch_select_indices(index)` drops finished rows from a batch's KV cache, as on HF caches;
`merge_caches` appends the rows of another batch's cache (the narrower left-padded), `trim_cache`
drops leading columns that are padding for every row. Under TP every rank holds its own cache of
its heads: these edits are recorded on rank 0's handle and travel, in order, with the next forward
command, which every rank applies before its forward (no extra broadcast); a batch's caches are
freed on all ranks with the first command after rank 0 let go of the batch.
The engine serialises calls (its model lock), so a runner never sees two at once.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from types import SimpleNamespace

import torch

from megarl.models.hf_names import model_to_checkpoint
from megarl.rollout.engine import kv_merge
from megarl.rollout.engine.attn_mask import forward_step
from megarl.rollout.engine.runner.channel import CommandChannel
from megarl.rollout.engine.runner.rank import Applied, RankWorker, UpdateFailed, UpdateRejected, encode_inputs
from megarl.rollout.engine.runner.sharding import parameter_layout

log = logging.getLogger(__name__)


class _WeightCommands:
    """The update-group and stage commands, the same for both runners (`_run` executes one on every rank)."""

    def _run(self, cmd: dict):
        raise NotImplementedError

    def load_distributed(self, request: dict) -> Applied:
        """request: group_name, names, dtypes, shapes, load_format, defer, weight_version."""
        return self._run({**request, "op": "update", "source": "distributed"})

    def load_reshard(self, request: dict) -> Applied:
        """request: group_name, ranks (rank r reads entry r), defer, weight_version."""
        return self._run({**request, "op": "update", "source": "reshard"})

    def commit(self, weight_version: str) -> Applied:
        return self._run({"op": "commit", "weight_version": str(weight_version)})

    def abort(self) -> int:
        return self._run({"op": "abort"})

    def init_update_group(self, request: dict) -> str:
        """request: master_address, master_port, rank_offset, world_size, group_name, backend."""
        return self._run({**request, "op": "init_group"})

    def destroy_update_group(self, group_name: str) -> str:
        return self._run({"op": "destroy_group", "group_name": group_name})


class LocalRunner(_WeightCommands):
    """tp=1: the model lives in this process and is called exactly as before the mesh existed."""

    tp_size = nnodes = 1

    def __init__(self, model_path: str, dtype: str, device: torch.device):
        self.device = device
        model_class = _model_class(model_path)
        self.model = model_class.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.full_shapes = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        self._worker = RankWorker(self.model, {}, self.full_shapes, tp=1, rank=0, device=device)

    def new_cache(self, headroom: int):
        from megarl.rollout.engine.kv_cache import new_engine_cache

        return new_engine_cache(headroom)

    def forward(self, ids, mask, positions, cache, keep_all: bool, images=None):
        """`images`: a vision-language prefill's images (engine/vision.py PrefillImages), which
        then takes 3-D positions [3, rows, width]."""
        if images is not None:
            from megarl.rollout.engine.vision import vision_forward

            return vision_forward(self.model, ids, mask, positions, cache, keep_all, images)
        return forward_step(self.model, ids, mask, positions, cache, keep_all)

    def merge_caches(self, into, other) -> None:
        kv_merge.merge_into(into, other)

    def trim_cache(self, cache, columns: int) -> None:
        kv_merge.trim_front(cache, columns)

    def load_named(self, named, defer: bool = False, weight_version: str | None = None) -> Applied:
        return self._run(
            {"op": "update", "source": "named", "named": named, "defer": defer, "weight_version": weight_version}
        )

    def load_payloads(
        self, payloads: list[str], load_format: str | None, defer: bool = False, weight_version: str | None = None
    ) -> Applied:
        """One rank: it reads entry 0, whatever the number of entries (as SGLang with tp=1)."""
        from megarl.wire.weights_codec import decode_payload

        return self.load_named(decode_payload(payloads[0], load_format), defer, weight_version)

    def load_files(self, files: list[str]) -> Applied:
        return self._run({"op": "update", "source": "disk", "files": files})

    def _run(self, cmd: dict):
        return self._worker.execute(cmd)

    def release_weights(self) -> int:
        return self._worker.release()

    def resume_weights(self) -> list[str]:
        return self._worker.resume()

    def layout(self) -> dict:
        """Under the checkpoint's names (hf_names.py): the names a sender exports."""
        saved = model_to_checkpoint(self.model, self.full_shapes)
        return parameter_layout({saved[n]: shape for n, shape in self.full_shapes.items()}, {}, 1)

    def close(self) -> None:
        pass


def _model_class(model_path: str):
    """transformers' image-text class for a vision-language checkpoint (models/vision.py), else
    its causal LM class."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from megarl.models.vision import VisionSpec

    vision = VisionSpec.of(AutoConfig.from_pretrained(model_path)) is not None
    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


class _CacheHandle:
    """Rank 0's name for one batch's KV caches (one per rank, held by each rank's worker).

    Edits (row selections, merges, trims) are recorded in order and travel with the next forward
    command, so dropping finished rows or merging joined ones costs no extra broadcast. A merge
    holds the other handle until it is sent, so the other cache cannot be freed before it is merged.
    """

    def __init__(self, cache_id: int, headroom: int):
        self.id, self.headroom = cache_id, headroom
        self.pending: list[tuple] = []

    def batch_select_indices(self, index: torch.Tensor) -> None:
        self.pending.append(("select", index.tolist()))

    def take_pending(self) -> list[tuple]:
        """The recorded edits as the worker applies them: ("select", rows), ("trim", columns) and
        ("merge", other id, the other cache's own pending edits)."""
        ops, self.pending = self.pending, []
        return [("merge", op[1].id, op[1].take_pending()) if op[0] == "merge" else op for op in ops]


class TPRunner(_WeightCommands):
    """Rank 0 of a TP mesh: each call is broadcast as a command, then run here on rank 0's shard.

    An exception that may have left the ranks out of lockstep (a dead peer, a failed forward) is
    fatal: `on_fatal` ends the engine, since a half-executed collective cannot be recovered.
    """

    def __init__(self, worker: RankWorker, channel: CommandChannel, nnodes: int, on_fatal: Callable[[str], None]):
        self._worker, self._channel, self._on_fatal = worker, channel, on_fatal
        self.model, self.device = worker.model, worker.device
        self.tp_size, self.nnodes = worker.tp, nnodes
        self.full_shapes = worker.full_shapes
        head = self.model.get_output_embeddings().weight  # rank 0's shard: count the full rows
        self.vocab_size = next(self.full_shapes[n][0] for n, t in worker.tensors.items() if t is head)
        self._ids = itertools.count()
        self._dropped: list[int] = []  # caches whose handles were garbage-collected
        self._lock = threading.Lock()
        self._closed = False

    def new_cache(self, headroom: int) -> _CacheHandle:
        handle = _CacheHandle(next(self._ids), headroom)
        weakref.finalize(handle, self._dropped.append, handle.id)
        return handle

    def forward(self, ids, mask, positions, cache: _CacheHandle, keep_all: bool):
        dropped = []
        while self._dropped:  # finalizers may append from any thread meanwhile
            dropped.append(self._dropped.pop())
        cmd = {
            "op": "forward",
            "cache": cache.id,
            "headroom": cache.headroom,
            "edits": cache.take_pending(),
            "drop": dropped,
            "keep_all": keep_all,
            **encode_inputs(ids, mask, positions),
        }
        return SimpleNamespace(logits=self._run(cmd), past_key_values=cache)

    def merge_caches(self, into: _CacheHandle, other: _CacheHandle) -> None:
        into.pending.append(("merge", other))

    def trim_cache(self, cache: _CacheHandle, columns: int) -> None:
        cache.pending.append(("trim", int(columns)))

    def load_named(self, named, defer: bool = False, weight_version: str | None = None) -> Applied:
        """Full tensors held here: sent as one shared-memory payload that every rank reads."""
        from megarl.wire.weights_codec import serialize_named_tensors

        return self.load_payloads([serialize_named_tensors(named)], None, defer, weight_version)

    def load_payloads(
        self, payloads: list[str], load_format: str | None, defer: bool = False, weight_version: str | None = None
    ) -> Applied:
        """SGLang's rule: rank r reads entry r; a single entry is read by every rank."""
        if len(payloads) not in (1, self.tp_size):
            raise UpdateRejected(
                f"serialized_named_tensors has {len(payloads)} entries for a tp={self.tp_size} "
                f"engine: give one per TP rank (rank r reads entry r) or one that every rank reads"
            )
        return self._run(
            {
                "op": "update",
                "source": "payloads",
                "payloads": payloads,
                "load_format": load_format,
                "defer": defer,
                "weight_version": weight_version,
            }
        )

    def load_files(self, files: list[str]) -> Applied:
        """Every rank opens the files itself and reads only its slices (the path must be visible to all)."""
        return self._run({"op": "update", "source": "disk", "files": files})

    def release_weights(self) -> int:
        return self._run({"op": "release"})

    def resume_weights(self) -> list[str]:
        return self._run({"op": "resume"})

    def layout(self) -> dict:
        return parameter_layout(self.full_shapes, self._worker.plan, self.tp_size, self.nnodes)

    def close(self) -> None:
        """Tell the followers to exit (they also exit on their own if rank 0 disappears)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._channel.send({"op": "shutdown"})
            except RuntimeError as exc:  # a follower already gone: nothing left to tell
                log.warning("could not send shutdown to the TP followers: %s", exc)

    def _run(self, cmd: dict):
        with self._lock:
            if self._closed:
                raise RuntimeError("the TP engine is shut down")
            try:
                self._channel.send(cmd)
                return self._worker.execute(cmd)
            except (UpdateRejected, UpdateFailed):
                raise  # every rank took part in the votes: the mesh is still in lockstep
            except Exception as exc:
                self._on_fatal(f"TP command {cmd['op']!r} failed on rank 0, the mesh is out of lockstep: {exc!r}")
                raise
