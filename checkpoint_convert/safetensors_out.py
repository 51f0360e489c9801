"""A sharded Hugging Face safetensors folder written tensor by tensor, never holding a shard.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, byte range)
and the tensors' bytes. The converter knows every tensor's name and shape before reading any
weight (mbridge's conversion run on the meta model), so the shards and their headers are planned
first and each tensor's bytes are appended to its file as it arrives; memory does not grow with
`max_shard_bytes`. The tensors must arrive in the planned order (checked).
"""

from __future__ import annotations

import json
import os
import struct

import torch

from checkpoint_convert import ConvertError
from checkpoint_convert.hf_files import INDEX

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= int(d)
    return n


class ShardedSafetensorsWriter:
    def __init__(self, out: str, layout: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, max_shard_bytes: int):
        """`layout`: (name, shape) of every tensor in the order they will be written."""
        seen = set()
        for name, _ in layout:
            if name in seen:
                raise ConvertError(f"the export produced tensor '{name}' twice")
            seen.add(name)
        self.out, self.dtype = out, dtype
        shards, size = [[]], 0
        for name, shape in layout:
            nbytes = _nbytes(shape, dtype)
            if shards[-1] and size + nbytes > max_shard_bytes:  # a larger tensor gets a shard of its own
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape)))
            size += nbytes
        self.shards = [s for s in shards if s]
        self.files = [f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors" for i in range(len(self.shards))]
        self._queue = [(i, name, shape) for i, shard in enumerate(self.shards) for name, shape in shard]
        self._next, self._open, self._file = 0, None, None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._queue):
            raise ConvertError(f"the export produced tensor '{name}' that was not planned")
        shard, want, shape = self._queue[self._next]
        if name != want or tuple(tensor.shape) != shape:
            raise ConvertError(
                f"the export produced tensor '{name}' {tuple(tensor.shape)} where '{want}' {shape} was planned"
            )
        if self._open != shard:
            self._start(shard)
        data = tensor.detach().to(self.dtype).contiguous().reshape(-1).view(torch.uint8)
        self._file.write(data.numpy())  # the buffer itself, no copy
        self._next += 1

    def _start(self, shard: int) -> None:
        self._close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in self.shards[shard]:
            end = offset + _nbytes(shape, self.dtype)
            header[name] = {"dtype": _DTYPES[self.dtype], "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._file = open(os.path.join(self.out, self.files[shard]), "wb")
        self._file.write(struct.pack("<Q", len(text)) + text)
        self._open = shard

    def _close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def finish(self) -> set[str]:
        """Close the last shard and write the index; returns the names written."""
        if self._next != len(self._queue):
            raise ConvertError(f"the export stopped before tensor '{self._queue[self._next][1]}'")
        self._close()
        weight_map = {name: self.files[i] for i, name, _ in self._queue}
        total = sum(_nbytes(shape, self.dtype) for _, _, shape in self._queue)
        with open(os.path.join(self.out, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        return set(weight_map)
