"""Conversion one piece of the model at a time: host memory follows the largest piece, not the model.

The Megatron model is built on the `meta` device (shapes, names and sharding metadata, no storage).
The model is then walked in pieces: the embedding, each decoder layer, the final norm with the
output layer. For each piece only its modules are given real (host) storage, filled, written or
read, and returned to `meta` before the next piece is touched.

hf -> mcore: a piece's tensors are read lazily from the safetensors files (`safe_open`), converted
by mbridge's per-parameter mapping (the engine's own loader, `weights.load_hf_weight`), and saved
by megatron's `dist_checkpointing.save` as a torch_dist checkpoint of that piece alone. Megatron's
writer takes one state dict per call, so the pieces are saved as separate torch_dist checkpoints
and then MERGED: their `.distcp` files move into one directory under distinct names, and their
PyTorch DCP `.metadata` are combined (each tensor's chunk list is the union of the pieces' chunks,
each storage entry points at its renamed file). A decoder layer is one slice of megatron's
layer-stacked tensors (`decoder.layers.*` has a leading layer axis), so a piece is exactly a set
of chunks of the global tensors, and the merged checkpoint is what one save of the whole model
writes, loadable into any TP / PP / EP layout. What it costs: one megatron save call per piece
(the per-call planning and validation), and renaming files; no tensor is copied twice.

mcore -> hf: for each piece, `dist_checkpointing.load` reads only that piece's chunks (reading a
subset of a checkpoint is allowed; the rest stays on disk), mbridge converts them to HF tensors,
and the safetensors writer flushes a file whenever a shard is full, so the writer holds at most
one shard (`--max-shard-size`) besides the piece.

`peak_piece_bytes` records the most bytes of model storage materialised at once, so a test can
check the bound rather than trust it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import pickle
import shutil

import torch

from checkpoint_convert import ConvertError

peak_piece_bytes = 0  # the largest piece materialised by this process (bytes of params + buffers)


@dataclasses.dataclass
class Piece:
    name: str
    modules: list
    prefixes: tuple[str, ...]  # state-dict keys of the piece start with one of these


def meta_engine(model_path: str):
    """A forward-only engine whose model has no storage (every parameter on `meta`)."""
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    engine = MegatronEngine(EngineSpec(model_path=model_path, optim=None, load_hf=False))
    build = engine._build_chunks

    def build_on_meta():
        with torch.device("meta"):
            return build()

    engine._build_chunks = build_on_meta
    engine.initialize()
    if len(engine.bare_chunks()) != 1:
        raise ConvertError("the converter builds one model chunk (no virtual pipeline)")
    # megatron creates a few buffers with an explicit device (the router's expert bias): on meta too
    engine.bare_chunks()[0].to_empty(device="meta")
    return engine


def pieces(chunk) -> list[Piece]:
    """The model in the order it is converted; every state-dict key belongs to exactly one piece."""
    out = [Piece("embedding", [chunk.embedding], ("embedding.",))]
    for i, layer in enumerate(chunk.decoder.layers):
        out.append(Piece(f"layer {i}", [layer], (f"decoder.layers.{i}.",)))
    tail = [m for m in (chunk.decoder.final_layernorm, getattr(chunk, "output_layer", None)) if m is not None]
    out.append(Piece("final norm and output layer", tail, ("decoder.final_layernorm.", "output_layer.")))
    keys = [k for k in chunk.state_dict(keep_vars=True)]
    unclaimed = [k for k in keys if sum(k.startswith(p) for piece in out for p in piece.prefixes) != 1]
    if unclaimed:
        raise ConvertError(f"the streaming converter does not know where {unclaimed[:3]} belong "
                           f"({len(unclaimed)} keys); this architecture needs a piece for them")
    return out


@contextlib.contextmanager
def materialised(piece: Piece):
    """The piece's modules with real host storage (uninitialised; buffers zeroed, as megatron
    initialises them) for the duration of the block, back on `meta` afterwards."""
    global peak_piece_bytes
    nbytes = 0
    for module in piece.modules:
        module.to_empty(device="cpu")
        with torch.no_grad():
            for buffer in module.buffers():
                buffer.zero_()
        nbytes += sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    peak_piece_bytes = max(peak_piece_bytes, nbytes)
    try:
        yield nbytes
    finally:
        for module in piece.modules:
            module.to_empty(device="meta")


def piece_state_dict(chunk, piece: Piece) -> tuple[dict, dict]:
    """The piece's entries of the chunk's sharded state dict, nested as checkpoint.py saves them:
    (the state dict as megatron builds it, the same with its factories applied and every tensor
    in the layout `dist_checkpointing` can save or load in part).

    Megatron stores a decoder layer's tensor as one shard of a layer-stacked global tensor
    (`prepend_axis_num` leading axes). For such shards its torch_dist strategy assumes a regular
    grid whose missing cells belong to OTHER ranks; with one rank and one layer that assumption
    breaks ("Number of local shards (1) does not match ..."). The same shard, stated with its
    leading axes as ordinary axes of length 1 (`prepend_axis_num=0`), takes the strategy's general
    path, which writes and reads any set of chunks. The bytes on disk are the same: the global
    tensor's key, shape, and this chunk's offsets and sizes."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megarl.engine.megatron import checkpoint

    state = checkpoint._sharded_state_dict_of(chunk)
    built = {k: v for k, v in state.items() if k.startswith(piece.prefixes)}
    original = dict(built)
    apply_factories(built)

    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, list):
            return [plain(v) for v in x]
        if isinstance(x, ShardedTensor) and x.prepend_axis_num:
            shape = (1,) * x.prepend_axis_num + tuple(x.local_shape)
            return dataclasses.replace(x, data=None if x.data is None else x.data.view(shape),
                                       local_shape=shape, prepend_axis_num=0)
        return x

    return {"model": {"chunk0": original}}, {"model": {"chunk0": plain(built)}}


def _unplain(loaded, built):
    """Loaded tensors back in the shapes megatron's factories and modules expect."""
    if isinstance(loaded, dict):
        return {k: _unplain(v, built[k]) for k, v in loaded.items()}
    if isinstance(loaded, list):
        return [_unplain(v, b) for v, b in zip(loaded, built)]
    if isinstance(loaded, torch.Tensor):
        return loaded.view(tuple(built.local_shape)) if built.prepend_axis_num else loaded
    return loaded


def _materialised_tensors(engine):
    return [(name, t) for name, t in _global_tensors(engine) if t.device.type != "meta"]


def _global_tensors(engine):
    from megarl.engine.megatron.weights import global_tensors

    return global_tensors(engine.bare_chunks())


# ---------------------------------------------------------------------------- hf -> mcore

def hf_to_mcore_pieces(engine, hf: str, stage: str) -> list[str]:
    """Save every piece of the HF checkpoint at `hf` as its own torch_dist checkpoint under
    `stage`; returns their directories in order."""
    from megatron.core import dist_checkpointing

    from megarl.engine.megatron import checkpoint
    from megarl.engine.megatron.weights import SafetensorsDir, load_hf_weight

    ckpt = SafetensorsDir(hf)
    chunk = engine.bare_chunks()[0]
    parts = []
    for k, piece in enumerate(pieces(chunk)):
        with materialised(piece):
            for global_name, param in _materialised_tensors(engine):
                load_hf_weight(engine.bridge, ckpt, global_name, param)
            part = os.path.join(stage, f"piece{k:05d}")
            os.makedirs(part)
            dist_checkpointing.save(piece_state_dict(chunk, piece)[1], part,
                                    content_metadata=checkpoint._content_metadata(),
                                    validate_access_integrity=False)  # a piece covers part of each tensor
            parts.append(part)
    return parts


def merge_torch_dist(parts: list[str], out: str) -> None:
    """Merge torch_dist checkpoints that hold disjoint chunks of one model into `out`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    merged = Metadata(state_dict_metadata={}, storage_data={})
    common: dict = {}
    for k, part in enumerate(parts):
        md = FileSystemReader(part).read_metadata()
        renamed = {name: f"p{k:05d}{name}" for name in os.listdir(part) if name.endswith(".distcp")}
        same_objects = set()  # objects every piece writes alike (megatron's common state)
        for fqn, meta in md.state_dict_metadata.items():
            have = merged.state_dict_metadata.get(fqn)
            if have is None:
                merged.state_dict_metadata[fqn] = meta
            elif isinstance(meta, BytesStorageMetadata) or isinstance(have, BytesStorageMetadata):
                if _read_object(out, merged, fqn) != _read_object(part, md, fqn):
                    raise ConvertError(f"merging pieces: object '{fqn}' differs between pieces")
                same_objects.add(fqn)
            elif (have.size, have.properties.dtype) != (meta.size, meta.properties.dtype):
                raise ConvertError(f"merging pieces: '{fqn}' is {tuple(have.size)} {have.properties.dtype} in one "
                                   f"piece and {tuple(meta.size)} {meta.properties.dtype} in another")
            else:
                have.chunks.extend(meta.chunks)
        for index, info in md.storage_data.items():
            if index.fqn in same_objects:
                continue
            if index in merged.storage_data:
                raise ConvertError(f"merging pieces: chunk {index} was written by two pieces")
            merged.storage_data[index] = dataclasses.replace(info, relative_path=renamed[info.relative_path])
        for name, new_name in renamed.items():
            os.rename(os.path.join(part, name), os.path.join(out, new_name))
        common_pt = os.path.join(part, "common.pt")
        if os.path.exists(common_pt):
            common.update(torch.load(common_pt, weights_only=False))
    for fqn, meta in merged.state_dict_metadata.items():  # a tensor must be covered exactly once
        if isinstance(meta, BytesStorageMetadata):
            continue
        covered = sum(int(torch.Size(c.sizes).numel()) for c in meta.chunks)
        if covered != meta.size.numel():
            raise ConvertError(f"merging pieces: '{fqn}' has {covered} of its {meta.size.numel()} elements")
    with open(os.path.join(out, ".metadata"), "wb") as f:
        pickle.dump(merged, f)
        f.flush()
        os.fsync(f.fileno())
    if common:
        torch.save(common, os.path.join(out, "common.pt"))
    shutil.copy(os.path.join(parts[0], "metadata.json"), os.path.join(out, "metadata.json"))
    for part in parts:
        shutil.rmtree(part)


def _read_object(directory: str, md, fqn: str):
    """A bytes item (megatron writes `torch.save([objects])`) of a torch_dist checkpoint."""
    import io

    (info,) = [v for k, v in md.storage_data.items() if k.fqn == fqn]
    with open(os.path.join(directory, info.relative_path), "rb") as f:
        f.seek(info.offset)
        return torch.load(io.BytesIO(f.read(info.length)), weights_only=False)


# ---------------------------------------------------------------------------- mcore -> hf

@torch.no_grad()
def mcore_to_hf_tensors(engine, mcore: str):
    """Yield (hf_name, tensor) for the checkpoint at `mcore`, one piece read at a time."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory, apply_factories, apply_factory_merges

    from megarl.engine.megatron.weights import _full_mcore_tensors

    chunk = engine.bare_chunks()[0]
    for piece in pieces(chunk):
        with materialised(piece):
            original, plain = piece_state_dict(chunk, piece)
            built = copy.copy(original["model"]["chunk0"])
            apply_factories(built)
            loaded = dist_checkpointing.load(plain, mcore, validate_access_integrity=False)["model"]["chunk0"]
            factories, _ = extract_matching_values(original["model"]["chunk0"],
                                                   lambda x: isinstance(x, ShardedTensorFactory))
            loaded = apply_factory_merges(_unplain(loaded, built), factories)
            missing, unexpected = chunk.load_state_dict(loaded, strict=False)
            if unexpected or any(k.startswith(piece.prefixes) and "_extra_state" not in k for k in missing):
                raise ConvertError(f"{mcore}: {piece.name} did not load (missing "
                                   f"{[k for k in missing if k.startswith(piece.prefixes)][:3]}, unexpected {unexpected[:3]})")
            for mcore_name, tensor in _full_mcore_tensors(engine.bridge, [chunk]):
                if tensor.device.type == "meta":
                    continue
                hf_names, hf_tensors = engine.bridge._weight_to_hf_format(mcore_name, tensor)
                for name, t in zip(hf_names, hf_tensors):
                    yield name, t  # the writer copies it before the piece goes back to meta
