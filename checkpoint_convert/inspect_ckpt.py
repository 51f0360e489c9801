"""What a checkpoint directory holds: format, the layout it was saved with, tensors, dtypes, bytes.

Reads metadata only (torch_dist's `.metadata`, safetensors headers); no weights, no process group.
"""

from __future__ import annotations

import json
import os

import torch

from checkpoint_convert import ConvertError, hf_files


def inspect(path: str) -> dict:
    """A description of the megarl torch_dist or Hugging Face safetensors checkpoint at `path`."""
    if not os.path.isdir(path):
        raise ConvertError(f"{path}: no such directory")
    if os.path.isfile(os.path.join(path, ".metadata")):
        return _torch_dist(path)
    if os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(os.path.join(path, hf_files.INDEX)):
        return _huggingface(path)
    raise ConvertError(f"{path}: neither a torch_dist checkpoint (.metadata) nor a Hugging Face safetensors folder")


def _torch_dist(path: str) -> dict:
    from megatron.core import dist_checkpointing

    from megarl.engine.megatron.checkpoint import MARKER, CheckpointError, read_metadata

    try:
        meta, complete = read_metadata(path), True
    except CheckpointError as e:
        meta, complete = {"problem": str(e)}, False
    tensors = {}
    for key, t in dist_checkpointing.load_tensors_metadata(path).items():
        tensors[key] = dict(
            shape=list(t.global_shape),
            dtype=str(t.dtype).replace("torch.", ""),
            bytes=_numel(t.global_shape) * torch.empty((), dtype=t.dtype).element_size(),
        )
    return dict(
        format="megarl torch_dist" if os.path.isfile(os.path.join(path, MARKER)) else "torch_dist",
        complete=complete,
        metadata=meta,
        **_totals(tensors),
    )


def _huggingface(path: str) -> dict:
    from safetensors import safe_open

    shapes = hf_files.tensor_shapes(path)
    index = os.path.join(path, hf_files.INDEX)
    weight_map = (
        json.load(open(index))["weight_map"] if os.path.isfile(index) else {k: "model.safetensors" for k in shapes}
    )
    tensors = {}
    for name in sorted(shapes):
        with safe_open(os.path.join(path, weight_map[name]), "pt") as f:
            dtype = f.get_slice(name).get_dtype()
        itemsize = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}.get(
            dtype, 0
        )
        tensors[name] = dict(shape=list(shapes[name]), dtype=dtype, bytes=_numel(shapes[name]) * itemsize)
    config = os.path.join(path, "config.json")
    meta = json.load(open(config)) if os.path.isfile(config) else {}
    return dict(
        format="huggingface safetensors",
        complete=True,
        metadata=dict(
            model_type=meta.get("model_type"),
            architectures=meta.get("architectures"),
            files=len(set(weight_map.values())),
        ),
        **_totals(tensors),
    )


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _totals(tensors: dict) -> dict:
    dtypes: dict[str, int] = {}
    for t in tensors.values():
        dtypes[t["dtype"]] = dtypes.get(t["dtype"], 0) + t["bytes"]
    return dict(tensors=tensors, num_tensors=len(tensors), total_bytes=sum(dtypes.values()), bytes_by_dtype=dtypes)


def render(report: dict) -> str:
    """The report as text: a header, one line per tensor, totals."""
    lines = [f"format: {report['format']}" + ("" if report["complete"] else " (INCOMPLETE)")]
    meta = report["metadata"]
    for key in (
        "problem",
        "layout",
        "optimizer",
        "contents",
        "rng",
        "model_path",
        "source",
        "model_type",
        "architectures",
        "files",
    ):
        if key in meta:
            lines.append(f"{key}: {json.dumps(meta[key], sort_keys=True)}")
    width = max((len(k) for k in report["tensors"]), default=0)
    for name, t in sorted(report["tensors"].items()):
        lines.append(f"  {name:<{width}}  {t['dtype']:<8} {str(tuple(t['shape'])):<20} {t['bytes']}")
    by_dtype = ", ".join(f"{d}: {b}" for d, b in sorted(report["bytes_by_dtype"].items()))
    lines.append(f"tensors: {report['num_tensors']}, total bytes: {report['total_bytes']} ({by_dtype})")
    return "\n".join(lines)
