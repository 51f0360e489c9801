"""The live policy as a Hugging Face folder: sharded safetensors + config + tokenizer, atomically.

Every rank walks the engine's HF export (a collective: TP / PP / EP gathers); rank 0 appends each
full tensor to the current shard and writes the shard when it reaches `max_shard_bytes`, so rank 0
holds one shard, not the model. The folder is staged next to its target and renamed into place:
a crash leaves the previous export (or none), never half of one. `AutoModelForCausalLM
.from_pretrained(out)` loads it; its log-probs are the trainer's (tests/trainer/test_durability.py).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator

import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".index.json")
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3


def copy_side_files(src: str, dst: str) -> list[str]:
    """Copy config, generation config and tokenizer files (everything that is not weights)."""
    copied = []
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        full = os.path.join(src, name)
        if (
            not os.path.isfile(full)
            or name.endswith(WEIGHT_SUFFIXES)
            or name.startswith("megarl_")
            or name.startswith(".")
        ):
            continue
        shutil.copy2(full, os.path.join(dst, name))
        copied.append(name)
    return copied


def write_hf_folder(
    named: Iterable[tuple[str, torch.Tensor]],
    out: str,
    config_dir: str,
    write: bool,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> dict:
    """Consume `named` (every rank must: it is a collective); rank `write` stages and renames the
    folder. Tied embeddings (config.tie_word_embeddings) keep the embedding only, as transformers
    saves them. Returns {"path", "tensors", "bytes", "shards"} on the writing rank, {} elsewhere."""
    if not write:
        for _ in named:
            pass
        return {}
    with open(os.path.join(config_dir, "config.json")) as f:
        tied = bool(json.load(f).get("tie_word_embeddings", False))
    out = os.path.abspath(out)
    stage = f"{out}.exporting{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    os.makedirs(stage)
    try:
        files, total, count = _write_shards(_skip_tied(named, tied), stage, max_shard_bytes)
        copy_side_files(config_dir, stage)
        old = f"{out}.replaced{os.getpid()}"
        if os.path.exists(out):
            os.rename(out, old)
        os.rename(stage, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return {"path": out, "tensors": count, "bytes": total, "shards": files}


def _skip_tied(named: Iterable[tuple[str, torch.Tensor]], tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named:
        if not (tied and name == "lm_head.weight"):
            yield name, tensor


def _write_shards(named, stage: str, max_shard_bytes: int) -> tuple[int, int, int]:
    """Shards model-0000k.safetensors as they fill, renamed to HF's -of-N names at the end."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    shard_bytes, total, count, written, weight_map = 0, 0, 0, [], {}

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(written) + 1:05d}.safetensors"
            save_file(shard, os.path.join(stage, name), metadata={"format": "pt"})
            written.append((name, list(shard)))
        shard, shard_bytes = {}, 0

    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor.detach().to("cpu").contiguous().clone()  # own storage: no shared views
        shard_bytes, total, count = shard_bytes + nbytes, total + nbytes, count + 1
    flush()
    if len(written) == 1:
        os.rename(os.path.join(stage, written[0][0]), os.path.join(stage, "model.safetensors"))
        return 1, total, count
    for k, (name, names) in enumerate(written, start=1):
        final = f"model-{k:05d}-of-{len(written):05d}.safetensors"
        os.rename(os.path.join(stage, name), os.path.join(stage, final))
        weight_map.update(dict.fromkeys(names, final))
    with open(os.path.join(stage, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
    return len(written), total, count
