"""hf-to-mcore and mcore-to-hf on one gloo rank, streaming: memory follows a chunk, not the model.

Both directions build the engine's model on the meta device (meta_model.py: the trainer's mbridge
bridge and layer spec, no storage) for the names, shapes and torch_dist keys, and make tensors real
a piece at a time:
- hf-to-mcore: ONE `dist_checkpointing.save` (through the engine's `checkpoint.save`: same keys,
  marker, staging) whose writer asks for each Megatron parameter as it writes it (lazy_save.py);
  the parameter is built from its Hugging Face tensors (read with `safe_open`) by mbridge's
  `_weight_to_mcore_format`, as the engine's loader does, and freed before the next.
- mcore-to-hf: chunks of at most `chunk_bytes` of parameters are loaded by one partial DCP read
  each (partial_load.py; optimizer / RNG entries of a trainer's checkpoint are never read),
  converted by mbridge's `_weight_to_hf_format` and appended to safetensors shards whose headers
  were planned from the meta model (safetensors_out.py), so no shard is held in memory either.
HeldBytes (held.py) counts the tensor bytes alive at once; benchmarks/RESULTS.md has peak RSS.
Outputs are staged in a sibling directory and renamed into place, so a failed conversion never
leaves a partial target.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import torch

from checkpoint_convert import ConvertError, hf_files
from checkpoint_convert.held import HeldBytes
from checkpoint_convert.lazy_save import LazyTorchDistSave
from checkpoint_convert.meta_model import MetaModel
from checkpoint_convert.partial_load import load_sharded_tensors
from checkpoint_convert.safetensors_out import ShardedSafetensorsWriter
from megarl.engine.megatron.hf_export import copy_side_files

HF_SUBDIR = "hf"  # config and tokenizer files kept next to a converted checkpoint's shards
DEFAULT_SHARD_BYTES = 5 * 1024**3
DEFAULT_CHUNK_BYTES = 1024**3  # Megatron parameters loaded at once by mcore-to-hf


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
    """Convert the Hugging Face checkpoint `hf` into a model-only torch_dist checkpoint at `out`,
    one Megatron parameter at a time (LazyTorchDistSave asks for each as it writes it)."""
    from megarl.engine.megatron import checkpoint

    hf = os.path.abspath(hf)
    config = hf_files.load_config(hf)
    dropped = hf_files.check_tensors(hf, config)
    held = HeldBytes()
    with staged(out, overwrite) as stage, one_rank():
        meta = MetaModel(hf)
        read = {n for p in meta.params for n in meta.bridge._weight_name_mapping_mcore_to_hf(p.global_name)}
        unread = sorted(set(hf_files.tensor_shapes(hf)) - read - set(dropped) - {"lm_head.weight"})
        if unread:  # mbridge maps no Megatron parameter to them: converting would lose them
            raise ConvertError(
                f"{hf}: tensors {hf_files._names(unread)} have no Megatron parameter "
                "(mbridge does not map them); refusing to drop them"
            )
        source = dict(
            kind="huggingface",
            path=hf,
            model_type=config.model_type,
            dtype=str(getattr(config, "torch_dtype", None) or "float32").replace("torch.", ""),
            dropped_tensors=dropped,
        )
        strategy = LazyTorchDistSave(_HFParameters(meta, hf, held))
        with _unwrapped_convert_errors():
            marker = checkpoint.save(
                meta.engine, stage, rng=False, sharded_strategy=strategy, extra=dict(contents="model", source=source)
            )
        copy_side_files(hf, os.path.join(stage, HF_SUBDIR))
    return dict(marker, path=os.path.abspath(out), peak_held_bytes=held.peak, model_bytes=meta.nbytes)


class _HFParameters:
    """The Megatron parameter a sharded tensor belongs to, built from its Hugging Face tensors by
    mbridge (the engine's loader's conversion) when the writer asks for it. The last parameter is
    kept: megatron saves a gated MLP's fc1 as two halves, asked for one after the other."""

    def __init__(self, meta: MetaModel, hf: str, held: HeldBytes):
        from megarl.engine.megatron.weights import SafetensorsDir

        self.meta, self.ckpt, self.held = meta, SafetensorsDir(hf), held
        self._param, self._full = None, None

    def __call__(self, sharded) -> torch.Tensor:
        param = self.meta.owner(sharded.data)
        if param is not self._param:
            self._param, self._full = None, None  # free the previous parameter before reading the next
            self._full, self._param = self._build(param), param
        view = sharded.data
        return torch.as_strided(
            self._full, view.shape, view.stride(), view.storage_offset() - param.tensor.storage_offset()
        )

    def _build(self, param) -> torch.Tensor:
        from megarl.engine.megatron.weights import _checkpoint_names

        bridge = self.meta.bridge
        names = _checkpoint_names(bridge, param.global_name, self.ckpt)
        full = bridge._weight_to_mcore_format(param.global_name, [self.held.track(self.ckpt.get(n)) for n in names])
        full = self.held.track(full.to(param.tensor.dtype).contiguous())
        if full.shape != param.tensor.shape:
            raise ConvertError(
                f"Megatron parameter '{param.global_name}' (from {names}): the checkpoint gives "
                f"{tuple(full.shape)}, the model built from config.json has {tuple(param.tensor.shape)}"
            )
        return full


@contextlib.contextmanager
def _unwrapped_convert_errors():
    """DCP reports a failed plan, read or write as CheckpointException(rank -> error); a refusal
    raised inside (by a planner or while producing a tensor) is re-raised as itself (one line),
    anything else as it came."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        for failure in e.failures.values():
            error = failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback)
            if isinstance(error, ConvertError):
                raise error from None
        raise


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
    raise ConvertError(
        f"{mcore}: no Hugging Face config stored with the checkpoint and its model_path "
        f"({model_path}) has no config.json; pass --hf-config PATH"
    )


def mcore_to_hf(
    mcore: str,
    out: str,
    hf_config: str | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: str | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> dict:
    """Convert a megarl torch_dist checkpoint (converted or saved by the trainer, any layout) into a
    sharded Hugging Face safetensors folder at `out`: chunks of at most `chunk_bytes` of Megatron
    parameters are loaded (only their keys; optimizer and RNG entries are never read), converted
    by mbridge and appended to the planned shards."""
    from megarl.engine.megatron import checkpoint

    mcore = os.path.abspath(mcore)
    try:
        saved = checkpoint.read_metadata(mcore)
    except checkpoint.CheckpointError as e:
        raise ConvertError(str(e)) from None
    if saved.get("lora"):  # adapters only: merged onto the base they name
        from checkpoint_convert.lora_export import lora_to_hf

        return lora_to_hf(mcore, out, saved, hf_config, overwrite)
    config_dir = resolve_hf_config(mcore, hf_config)
    config = hf_files.load_config(config_dir)
    out_dtype = _dtype(dtype or str(getattr(config, "torch_dtype", None) or "float32"))
    held = HeldBytes()
    with staged(out, overwrite) as stage, one_rank():
        meta = MetaModel(config_dir)
        bridge = meta.bridge
        layout = [
            (n, tuple(t.shape))
            for p in meta.params  # mbridge's conversion on meta: names, shapes
            for n, t in zip(*bridge._weight_to_hf_format(p.global_name, p.tensor))
        ]
        hf_files.check_exported({n for n, _ in layout}, config)  # before any weight is read
        os.makedirs(stage)
        writer = ShardedSafetensorsWriter(stage, layout, out_dtype, max_shard_bytes)
        template = meta.sharded_state_dict(is_loading=True)["model"]["chunk0"]
        for chunk in meta.chunks(chunk_bytes):  # a function call per chunk: nothing outlives it
            _convert_chunk(mcore, template, chunk, bridge, writer, held)
        names = writer.finish()
        copy_side_files(config_dir, stage)
    return dict(
        path=os.path.abspath(out),
        tensors=len(names),
        config=config_dir,
        peak_held_bytes=held.peak,
        model_bytes=meta.nbytes,
    )


def _convert_chunk(mcore: str, template: dict, chunk: list, bridge, writer, held: HeldBytes) -> None:
    tensors = _load_chunk(mcore, template, chunk, held)
    for p in chunk:
        for name, t in zip(*bridge._weight_to_hf_format(p.global_name, tensors.pop(p.local_name))):
            writer.add(name, t)


def _load_chunk(mcore: str, template: dict, chunk: list, held: HeldBytes) -> dict[str, torch.Tensor]:
    """local name -> loaded tensor for the parameters of `chunk`: the meta model's sharded entries
    (ShardedTensors, and factories that save a gated MLP's fc1 as two halves) over new real
    tensors, the factories' halves being views of them, filled by one partial DCP load."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    tensors = {p.local_name: held.track(torch.empty(p.tensor.shape, dtype=p.tensor.dtype)) for p in chunk}
    parts = {}
    for name, t in tensors.items():
        if template[name].data.shape != t.shape:  # TP = 1: every entry covers its whole parameter
            raise AssertionError(
                f"{name}: sharded entry {tuple(template[name].data.shape)}, parameter {tuple(t.shape)}"
            )
        parts[name] = replace(template[name], data=t)
    apply_factories(parts)
    with _unwrapped_convert_errors():
        load_sharded_tensors(mcore, [sh for sh in nested_values(parts) if isinstance(sh, ShardedTensor)])
    return tensors


def _dtype(name: str) -> torch.dtype:
    name = name.replace("torch.", "")
    if name not in ("float32", "bfloat16", "float16"):
        raise ConvertError(f"--dtype {name}: choose float32, bfloat16 or float16")
    return getattr(torch, name)
