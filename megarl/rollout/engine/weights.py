"""The generation engine's weights: updates (tensor, disk, update groups), the deferred-update stage,
release and resume. A mixin of `GenerationEngine` (generation.py), split out as its own concern.

Every call runs under the engine's model lock, i.e. between forward steps, and goes to the runner
(runner/runners.py), which executes it on every TP rank in lockstep. Bookkeeping kept here:
`weight_version` changes when an update is written (a deferred one: at its commit); `_unfilled`
(parameters re-allocated by resume, still holding no values) loses a parameter once one update or
one commit wrote its whole shard on every rank.

Updates received over an update group are checked only after the bytes are in (a sender must never
be left blocked), so released weights are refused by the ranks after receiving, not here.
"""

from __future__ import annotations

import torch

from megarl.rollout.engine.protocol import WeightsUnavailable
from megarl.rollout.engine.runner.rank import Applied


class EngineWeights:
    # set by GenerationEngine.__init__: runner, model, device, weight_version, _model_lock, _cond,
    # _tensors_by_name, _unfilled, _weights_resident

    def update_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], weight_version: str | None = None, defer: bool = False
    ) -> str:
        """Copy full HF-named tensors into the model between forward steps (each TP rank its slice);
        all are checked, on every rank, before any is written (or staged, with `defer`)."""
        return self._updated(
            lambda: self.runner.load_named(named_tensors, defer, weight_version), weight_version, defer
        )

    def update_weights_from_payloads(
        self,
        payloads: list[str],
        load_format: str | None = None,
        weight_version: str | None = None,
        defer: bool = False,
    ) -> str:
        """SGLang's `serialized_named_tensors`: TP rank r decodes entry r; a single entry is decoded
        by every rank (so is entry 0 by a tp=1 engine, whatever the count). Staged values are copies:
        the sender may reuse its shared memory as soon as this returns."""
        return self._updated(
            lambda: self.runner.load_payloads(payloads, load_format, defer, weight_version), weight_version, defer
        )

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> str:
        """Every rank reads its own slices of the safetensors files in `model_path`."""
        from pathlib import Path

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in model_path={model_path!r}")
        applied = self._apply(lambda: self.runner.load_files([str(f) for f in files]), weight_version)
        self.model_path = str(model_path)
        return (
            f"updated {len(applied.names)} tensors; weight_version={self.weight_version} "
            f"from {len(files)} file(s) in {model_path}"
        )

    def update_weights_from_distributed(
        self, request: dict, weight_version: str | None = None, defer: bool = False
    ) -> str:
        """request: group_name, names, dtypes, shapes, load_format; full tensors broadcast from group rank 0."""
        request = {**request, "weight_version": weight_version, "defer": defer}
        return self._updated(lambda: self.runner.load_distributed(request), weight_version, defer, resident=False)

    def update_weights_from_reshard(
        self, group_name: str, ranks: list, weight_version: str | None = None, defer: bool = True
    ) -> str:
        """Each TP rank r receives the messages listed in ranks[r]: boxes of its own shard, point to point."""
        request = {"group_name": group_name, "ranks": ranks, "weight_version": weight_version, "defer": defer}
        return self._updated(lambda: self.runner.load_reshard(request), weight_version, defer, resident=False)

    def commit_weight_update(self, weight_version: str) -> tuple[str, int]:
        """Write what was staged for `weight_version` on every rank; (message, tensors written).
        A stage built for another version is discarded and the commit refused."""
        applied = self._apply(lambda: self.runner.commit(weight_version), weight_version)
        return f"committed {len(applied.names)} tensors; weight_version={self.weight_version}", len(applied.names)

    def abort_weight_update(self) -> str:
        with self._model_lock:
            count = self.runner.abort()
        return f"discarded {count} staged pieces" if count else "nothing was staged"

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str | None = None,
    ) -> str:
        """Every TP rank r joins as group rank rank_offset + r; returns once the group is formed."""
        request = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
            "group_name": group_name,
            "backend": backend or ("nccl" if self.device.type == "cuda" else "gloo"),
        }
        with self._model_lock:
            return self.runner.init_update_group(request)

    def destroy_weights_update_group(self, group_name: str) -> str:
        with self._model_lock:
            return self.runner.destroy_update_group(group_name)

    def _updated(self, load, weight_version: str | None, defer: bool, resident: bool = True) -> str:
        applied = self._apply(load, weight_version, resident and not defer)
        if applied.staged:
            return (
                f"staged {applied.staged} pieces of {len(applied.names)} tensors for weight_version "
                f"{weight_version!r}; /commit_weight_update applies them"
            )
        return f"updated {len(applied.names)} tensors; weight_version={self.weight_version}"

    def _apply(self, load, weight_version: str | None, resident: bool = True) -> Applied:
        with self._model_lock, torch.no_grad():
            if resident and not self._weights_resident:
                raise WeightsUnavailable("weights are released; call /resume_memory_occupation before updating them")
            applied = load()
            if applied.staged:  # nothing written yet: version and refill state wait for the commit
                return applied
            # the version changes before the model lock is let go: every forward step reads the
            # version of exactly the weights it runs with (per-token weight_versions)
            with self._cond:
                self._unfilled.difference_update(self._canonical_names(applied.covered))
                if weight_version is not None:
                    self.weight_version = str(weight_version)
                self._cond.notify_all()
        return applied

    def release_weights(self) -> str:
        """Free every parameter's memory (on every rank); generation is refused until resume + a full update."""
        with self._model_lock, self._cond:
            if not self._weights_resident:
                return "weights were already released"
            count = self.runner.release_weights()
            self._weights_resident = False
        return f"released {count} parameter tensors"

    def resume_weights(self) -> str:
        """Re-allocate released parameters (uninitialised); an update must fill all of them."""
        with self._model_lock, self._cond:
            if self._weights_resident:
                return "weights are resident; nothing to resume"
            self._unfilled = set(self.runner.resume_weights())
            self._weights_resident = True
        return (
            f"re-allocated {len(self._unfilled)} parameter tensors; they hold no values until "
            "/update_weights_from_tensor or /update_weights_from_disk fills every one"
        )

    def _weights_state_message(self) -> str:
        if not self._weights_resident:
            return "weights released; call /resume_memory_occupation then update weights"
        return (
            f"weights resumed but {len(self._unfilled)} parameters were not refilled yet "
            f"(e.g. {sorted(self._unfilled)[:3]}); update them before generating"
        )

    def _canonical_names(self, names) -> set[str]:
        by_identity = {id(p): n for n, p in self.model.named_parameters()}
        return {by_identity[id(self._tensors_by_name[n])] for n in names if id(self._tensors_by_name[n]) in by_identity}


def read_checkpoint_tensors(model_path: str, names: list[str], rename=None) -> dict[str, torch.Tensor]:
    """`names` from the safetensors files of the checkpoint at `model_path` (KeyError naming the
    first one that none of them holds). `rename` (hf_names.checkpoint_renamer): a name and a file
    key match when they rename alike, so the loaded model's names find the checkpoint's tensors."""
    from pathlib import Path

    from safetensors import safe_open

    own = rename or (lambda name: name)
    wanted, found = {own(n): n for n in names}, {}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                if own(key) in wanted:
                    found[wanted[own(key)]] = f.get_tensor(key)
    missing = sorted(set(names) - set(found))
    if missing:
        raise KeyError(f"{missing[0]} is in none of the safetensors files of {model_path}")
    return found
