"""hf-to-mcore and mcore-to-hf on one gloo rank, one piece of the model at a time (streaming.py).

Memory: the Megatron model is built on the `meta` device and only one piece (the embedding, a
decoder layer, or the final norm with the output layer) has real storage at a time, so peak host
memory follows the largest piece (plus one safetensors shard when writing HF), not the model
(benchmarks/RESULTS.md has the measured figures). Outputs are staged in a sibling directory and
renamed into place, so a failed conversion never leaves a partial target.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import torch

from checkpoint_convert import ConvertError
from checkpoint_convert import hf_files, streaming

HF_SUBDIR = "hf"  # config and tokenizer files kept next to a converted checkpoint's shards
DEFAULT_SHARD_BYTES = 5 * 1024 ** 3


@contextlib.contextmanager
def one_rank():
    """A world of one gloo rank (joined here unless the caller already did), model parallel torn
    down afterwards so a process can convert several models in turn."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    own = not dist.is_initialized()
    store = tempfile.mkdtemp(prefix="checkpoint_convert_")
    if own:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise ConvertError(f"the converter runs on one rank; this process group has {dist.get_world_size()}")
    try:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        yield
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if own:
            dist.destroy_process_group()
        shutil.rmtree(store, ignore_errors=True)


@contextlib.contextmanager
def staged(target: str, overwrite: bool):
    """Yield a fresh staging directory that becomes `target` if the block succeeds."""
    target = os.path.abspath(target)
    if os.path.exists(target) and not overwrite:
        raise ConvertError(f"{target} exists; choose a new directory or pass --overwrite")
    stage = f"{target}.converting{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    try:
        yield stage
        if os.path.exists(target):
            shutil.rmtree(target)
        os.rename(stage, target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(stage + ".partial", ignore_errors=True)


def hf_to_mcore(hf: str, out: str, overwrite: bool = False) -> dict:
    """Convert the Hugging Face checkpoint `hf` into a model-only torch_dist checkpoint at `out`."""
    from megarl.engine.megatron import checkpoint
    from megarl.engine.megatron.weights import global_tensors

    hf = os.path.abspath(hf)
    config = hf_files.load_config(hf)
    dropped = hf_files.check_tensors(hf, config)
    with staged(out, overwrite) as stage, one_rank():
        engine = streaming.meta_engine(hf)
        read = {n for g, _ in global_tensors(engine.bare_chunks())
                for n in engine.bridge._weight_name_mapping_mcore_to_hf(g)}
        unread = sorted(set(hf_files.tensor_shapes(hf)) - read - set(dropped) - {"lm_head.weight"})
        if unread:  # mbridge maps no Megatron parameter to them: converting would lose them
            raise ConvertError(f"{hf}: tensors {hf_files._names(unread)} have no Megatron parameter "
                               "(mbridge does not map them); refusing to drop them")
        source = dict(kind="huggingface", path=hf, model_type=config.model_type,
                      dtype=str(getattr(config, "torch_dtype", None) or "float32").replace("torch.", ""),
                      dropped_tensors=dropped)
        os.makedirs(stage)
        parts = streaming.hf_to_mcore_pieces(engine, hf, stage)
        streaming.merge_torch_dist(parts, stage)
        hf_files.copy_side_files(hf, os.path.join(stage, HF_SUBDIR))
        meta = dict(version=checkpoint.FORMAT_VERSION, complete=True, format="torch_dist",
                    layout=checkpoint.layout(engine), optimizer=None, model_path=hf, rng=False,
                    contents="model", source=source, pieces=len(parts))
        checkpoint._write_json(os.path.join(stage, checkpoint.MARKER), meta)  # last: the dir is complete
    return dict(meta, path=os.path.abspath(out))


def resolve_hf_config(mcore: str, hf_config: str | None) -> str:
    """The directory whose config.json (and tokenizer) describe `mcore`: --hf-config, else the files
    stored at conversion time, else the model the trainer was started from."""
    from megarl.engine.megatron import checkpoint

    if hf_config:
        return os.path.dirname(hf_config) if hf_config.endswith(".json") else hf_config
    stored = os.path.join(mcore, HF_SUBDIR)
    if os.path.isfile(os.path.join(stored, "config.json")):
        return stored
    model_path = checkpoint.read_metadata(mcore).get("model_path")
    if model_path and os.path.isfile(os.path.join(model_path, "config.json")):
        return model_path
    raise ConvertError(f"{mcore}: no Hugging Face config stored with the checkpoint and its model_path "
                       f"({model_path}) has no config.json; pass --hf-config PATH")


def mcore_to_hf(mcore: str, out: str, hf_config: str | None = None, overwrite: bool = False,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES, dtype: str | None = None) -> dict:
    """Convert a megarl torch_dist checkpoint (converted or saved by the trainer, any layout) into a
    sharded Hugging Face safetensors folder at `out`."""
    from megarl.engine.megatron import checkpoint

    mcore = os.path.abspath(mcore)
    try:
        checkpoint.read_metadata(mcore)
    except checkpoint.CheckpointError as e:
        raise ConvertError(str(e)) from None
    config_dir = resolve_hf_config(mcore, hf_config)
    config = hf_files.load_config(config_dir)
    out_dtype = _dtype(dtype or str(getattr(config, "torch_dtype", None) or "float32"))
    with staged(out, overwrite) as stage, one_rank():
        engine = streaming.meta_engine(config_dir)
        os.makedirs(stage)
        try:
            names = _write_safetensors(streaming.mcore_to_hf_tensors(engine, mcore), stage, max_shard_bytes, out_dtype)
        except checkpoint.CheckpointError as e:
            raise ConvertError(str(e)) from None
        hf_files.check_exported(names, config)
        hf_files.copy_side_files(config_dir, stage)
    return dict(path=os.path.abspath(out), tensors=len(names), config=config_dir)


def _dtype(name: str) -> torch.dtype:
    name = name.replace("torch.", "")
    if name not in ("float32", "bfloat16", "float16"):
        raise ConvertError(f"--dtype {name}: choose float32, bfloat16 or float16")
    return getattr(torch, name)


def _write_safetensors(tensors, out: str, max_shard_bytes: int, dtype: torch.dtype) -> set[str]:
    """Write (name, tensor) pairs as shards of at most `max_shard_bytes` (a larger single tensor gets
    a shard of its own) plus model.safetensors.index.json. Returns the names written."""
    import json

    from safetensors.torch import save_file

    shards, current, size, total = [], {}, 0, 0

    def flush():
        nonlocal current, size
        if current:
            name = f"part{len(shards):05d}.safetensors"
            save_file(current, os.path.join(out, name), metadata={"format": "pt"})
            shards.append((name, list(current)))
            current, size = {}, 0

    for name, tensor in tensors:
        if name in current or any(name in keys for _, keys in shards):
            raise ConvertError(f"the export produced tensor '{name}' twice")
        t = tensor.detach().to(dtype).contiguous().clone()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        current[name] = t
        size += nbytes
        total += nbytes
    flush()
    weight_map = {}
    for i, (name, keys) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.rename(os.path.join(out, name), os.path.join(out, final))
        weight_map.update({k: final for k in keys})
    with open(os.path.join(out, hf_files.INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return set(weight_map)
