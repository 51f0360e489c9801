"""Distributed checkpoints of a Megatron engine: model, optimizer and RNG state, written atomically.

The format is megatron-core's `torch_dist` (dist_checkpointing): every rank writes its own shards
and the checkpoint describes tensors by their GLOBAL shape and offsets, so it loads into a different
TP / PP / EP layout. The distributed optimizer's state (Adam moments, fp32 main params) is saved
in the `fully_reshardable` format, which maps each moment to its model parameter rather than to
this run's flat buffers, so it reshards along with the weights. The step count rides in the
optimizer's param groups (the plain optimizer's, actor.optim.use_distributed_optimizer=false, in
megatron's `common_step` beside its per-parameter state). RNG state (python, numpy, torch, Megatron's tensor-parallel tracker) is
per rank and means something only for the same layout; it is restored only then.

Atomicity: every rank writes into `<path>.partial`; after a barrier rank 0 adds `megarl_ckpt.json`
(layout, contents, `"complete": true`) and renames the directory to `<path>`. A crash before the
rename leaves only the `.partial` directory; `load` refuses any directory without the marker.
All ranks must see the same file system (as torch_dist requires anyway).
"""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

MARKER = "megarl_ckpt.json"
FORMAT_VERSION = 1
# Optimizer format: per-parameter (model-space) state, reshardable across TP / PP / EP / DP.
OPTIM_SHARDING = "fully_reshardable"


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded (missing, incomplete, or lacking a part)."""


def layout(engine) -> dict:
    """The mesh a checkpoint was written from; RNG states are restored only into the same one."""
    c = engine.mesh_coord()
    return dict(
        world_size=dist.get_world_size(),
        tp=c["tp_size"],
        pp=c["pp_size"],
        cp=c["cp_size"],
        ep=c["ep_size"],
        etp=engine.spec.parallel.etp,
        dp=c["dp_size"],
        vpp=getattr(engine.spec.parallel, "vpp", 1),
    )


def read_metadata(path: str) -> dict:
    """The checkpoint's marker; raises CheckpointError unless `path` is a complete checkpoint."""
    marker = os.path.join(path, MARKER)
    if path.rstrip("/").endswith(".partial"):
        raise CheckpointError(
            f"{path} is the staging directory of a save that did not finish "
            "renaming it; load the checkpoint by its final name"
        )
    if not os.path.isdir(path):
        partial = (
            " (a `.partial` directory next to it is an interrupted save)" if os.path.isdir(path + ".partial") else ""
        )
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist{partial}")
    if not os.path.isfile(marker):
        raise CheckpointError(
            f"{path} is not a complete megarl checkpoint: {MARKER} is missing, so the save that "
            "wrote it did not finish (or it was not written by MegatronEngine.save_checkpoint). "
            "Resume from an earlier checkpoint."
        )
    with open(marker) as f:
        meta = json.load(f)
    if not meta.get("complete"):
        raise CheckpointError(f"{marker} does not mark the checkpoint complete")
    if meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {meta.get('version')}, this megarl reads version {FORMAT_VERSION}"
        )
    return meta


# ------------------------------------------------------------------------------------ save


def save(engine, path: str, rng: bool = True, extra: dict | None = None, sharded_strategy=None) -> dict:
    """Write `engine`'s model, optimizer (if it trains) and RNG to `path`. A collective.

    rng=False: weights only (checkpoint_convert), marked so `load` does not look for RNG state.
    `extra` is merged into the marker (the converter's source config). `sharded_strategy`: a
    torch_dist save strategy of megatron's (checkpoint_convert's lazy one builds each tensor as it
    is written, for a model built on the meta device)."""
    from megatron.core import dist_checkpointing

    path = os.path.abspath(path)
    partial = path + ".partial"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted save
        os.makedirs(partial)
    dist.barrier()
    with_optimizer = engine.optimizer is not None
    state = _sharded_state_dict(engine, with_optimizer, rng=rng, is_loading=False)
    dist_checkpointing.save(state, partial, sharded_strategy=sharded_strategy, content_metadata=_content_metadata())
    dist.barrier()  # every rank's shards are on disk
    meta = dict(
        version=FORMAT_VERSION,
        complete=True,
        format="torch_dist",
        layout=layout(engine),
        optimizer=OPTIM_SHARDING if with_optimizer else None,
        model_path=engine.spec.model_path,
        rng=rng,
        lora=_lora_meta(engine),
        **(extra or {}),
    )
    if rank == 0:
        _write_json(os.path.join(partial, MARKER), meta)
        _replace_dir(partial, path)
    dist.barrier()  # nobody returns before the checkpoint exists under its final name
    return meta


def _replace_dir(src: str, dst: str) -> None:
    """Rename `src` to `dst`; an existing `dst` (a re-save of the same step) is replaced."""
    old = dst + ".replaced"
    if os.path.exists(dst):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
    os.rename(src, dst)
    fsync_dir(os.path.dirname(dst))
    shutil.rmtree(old, ignore_errors=True)


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------ load


def load(engine, path: str, load_optimizer: bool = True) -> dict:
    """Load `path` into `engine` (any layout). A collective. Returns what was restored."""
    from megatron.core import dist_checkpointing

    path = os.path.abspath(path)
    meta = read_metadata(path)
    with_optimizer = load_optimizer and engine.optimizer is not None
    if with_optimizer and meta.get("optimizer") != OPTIM_SHARDING:
        raise CheckpointError(
            f"{path} holds no optimizer state (saved by a forward-only engine); load it with "
            "load_optimizer=False to take the weights and start the optimizer fresh"
        )
    _check_lora(meta, engine, path)
    same_layout = meta["layout"] == layout(engine) and meta.get("rng", True)
    state = _sharded_state_dict(engine, with_optimizer, rng=same_layout, is_loading=True)
    loaded = dist_checkpointing.load(state, path)
    if engine.spec.lora is not None:
        from megarl.engine.megatron import lora_io

        lora_io.load_sharded(engine.bare_chunks(), loaded["model"])
    else:
        for i, chunk in enumerate(engine.bare_chunks()):
            chunk.load_state_dict(loaded["model"][f"chunk{i}"], strict=True)
    if with_optimizer:
        engine.optimizer.load_state_dict(_optimizer_state(state["optimizer"], loaded["optimizer"]))
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    return dict(path=path, saved_layout=meta["layout"], optimizer=with_optimizer, rng=same_layout)


# ------------------------------------------------------------------------------------ state


def _lora_meta(engine) -> dict | None:
    spec = engine.spec.lora
    if spec is None:
        return None
    return dict(rank=spec.rank, alpha=spec.alpha, target_modules=list(spec.target_modules), base=engine.spec.model_path)


def _check_lora(meta: dict, engine, path: str) -> None:
    """A LoRA checkpoint holds adapters for a named base; a full one holds every weight."""
    saved, mine = meta.get("lora"), _lora_meta(engine)
    if (saved is None) != (mine is None):
        what = "LoRA adapters" if saved is not None else "full weights"
        raise CheckpointError(
            f"{path} holds {what}, but this engine {'has' if mine else 'has no'} actor.lora; resume with the "
            "same actor.lora setting it was saved with"
        )
    if saved is not None:
        differ = {k: (saved[k], mine[k]) for k in ("rank", "alpha", "target_modules") if saved[k] != mine[k]}
        if differ:
            raise CheckpointError(f"{path}: actor.lora differs from the checkpoint's (saved, now): {differ}")


def _content_metadata() -> dict:
    # How the optimizer's sharded state dict is laid out; the same on save and load. No prefix
    # per chained optimizer (dense / expert): keys then depend only on the model's parameters,
    # not on how many optimizers this layout happens to build.
    return dict(distrib_optim_sharding_type=OPTIM_SHARDING, chained_optim_avoid_prefix=True)


def _sharded_state_dict(engine, with_optimizer: bool, rng: bool, is_loading: bool) -> dict:
    from megatron.core import parallel_state as ps

    metadata = dict(_content_metadata(), dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True))
    # the bare GPTModels hold the same Parameter objects DDP and the optimizer refer to. One entry
    # per virtual pipeline chunk: the nesting is this run's own (tensors are found by their global
    # sharded keys), so a checkpoint saved with one VPP size loads into another.
    if engine.spec.lora is not None:  # the adapters only: the frozen base is named (model_path), not copied
        from megarl.engine.megatron import lora_io

        state = {"model": lora_io.sharded_state_dict(engine.bare_chunks())}
    else:
        state = {
            "model": {
                f"chunk{i}": chunk.sharded_state_dict(metadata=metadata) for i, chunk in enumerate(engine.bare_chunks())
            }
        }
    if with_optimizer:
        state["optimizer"] = engine.optimizer.sharded_state_dict(
            state["model"], is_loading=is_loading, metadata=metadata
        )
    if rng:
        state["rng_state"] = _rng_sharded_object()
    return state


def _optimizer_state(template: dict, loaded: dict) -> dict:
    """The optimizer state dict to load: this run's structure, the checkpoint's tensors and step.

    How many optimizers megatron chains (dense / expert) depends on the layout: TP=2 with ETP=1
    gives the experts a data-parallel group of their own and a second optimizer, TP=1 on the same
    ranks does not. dist_checkpointing returns the SAVED structure for the non-tensor part (param
    groups) merged with this run's structure for the tensors, which megatron cannot load when the
    two differ. The tensors are keyed by model parameter, so take them at this run's paths, keep
    this run's param groups (hyperparameters come from the config), and carry the step over.
    """
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    steps = _param_group_steps(loaded)
    if len(steps) > 1:
        raise CheckpointError(f"the checkpoint's optimizers disagree on the step count: {sorted(steps)}")

    def fill(node, got):
        if isinstance(node, LocalNonpersistentObject):  # this run's own value, never saved (the
            return node.unwrap()  # plain optimizer's param ids): the bare value, as load() gives it
        if isinstance(node, ShardedBase):
            if got is None:  # megatron would skip it silently and keep a fresh moment
                raise CheckpointError(f"optimizer tensor {node.key} was not loaded from the checkpoint")
            return got
        if isinstance(node, dict):
            out = {k: fill(v, got.get(k) if isinstance(got, dict) else None) for k, v in node.items()}
            if isinstance(got, dict) and "common_step" in got:  # the plain optimizer's step, which
                out["common_step"] = got["common_step"]  # megatron keeps beside the per-parameter state
            return out
        if isinstance(node, list) and _holds_sharded(node):
            return [fill(v, got[i] if isinstance(got, list) and i < len(got) else None) for i, v in enumerate(node)]
        return node

    state = fill(template, loaded)
    if steps:
        for group in _param_groups(state):
            group["step"] = next(iter(steps))
    return state


def _holds_sharded(node) -> bool:
    """A saved tensor or a wrapped local value somewhere in `node` (fill must go in)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    if isinstance(node, (ShardedBase, LocalNonpersistentObject)):
        return True
    values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    return any(_holds_sharded(v) for v in values)


def _param_groups(node) -> list[dict]:
    """Every param group in a (nested) optimizer state dict."""
    if not isinstance(node, dict):
        return []
    found = list(node["param_groups"]) if isinstance(node.get("param_groups"), list) else []
    for key, value in node.items():
        if key != "param_groups":
            found += _param_groups(value)
    return found


def _param_group_steps(node) -> set:
    return {int(g["step"]) for g in _param_groups(node) if g.get("step") is not None}


def _rng_sharded_object():
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rng = dict(
        python=random.getstate(),
        numpy=np.random.get_state(),
        torch=torch.get_rng_state(),
        tracker=tensor_parallel.get_cuda_rng_tracker().get_states(),
    )
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    # one object per global rank: the rank's place in an identical layout owns the same streams
    return ShardedObject("rng_state", rng, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _set_rng_state(rng: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
