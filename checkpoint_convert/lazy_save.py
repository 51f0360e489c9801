"""One torch_dist save whose tensors are produced one at a time while the file is written.

megatron-core's own writer (FileSystemWriterAsync) resolves every tensor of the plan up front
(`prepare_write_data`), so a state dict saved in one call is held whole. PyTorch's FileSystemWriter
with one thread asks the planner for each tensor only when it writes it (`_SerialCpuLoader`, in
plan order), so a planner whose `resolve_data` builds the tensor on demand keeps one tensor alive
(two while the next is produced) however large the model. Everything else is megatron's: the
sharded keys, the ShardedTensor -> torch ShardedTensor translation (layer / expert axes), the
metadata.json and common state written by `dist_checkpointing.save`; the files are the same format
as the engine's own checkpoints (one `__0_0.distcp` instead of one per writer thread).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.planner import WriteItemType

# ShardedTensor (its `data` a meta tensor) -> a real tensor shaped like its `data`
Produce = Callable[[ShardedTensor], torch.Tensor]


class LazyTorchDistSave(TorchDistSaveShardedStrategy):
    """Pass as `sharded_strategy` to `dist_checkpointing.save`; ShardedTensors may be on `meta`."""

    def __init__(self, produce: Produce):
        super().__init__("torch_dist", 1, thread_count=1)
        self.produce = produce

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint import save as dcp_save

        flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        sources = {
            (sh.key, tuple(sh.global_offset)): sh
            for shards in flat.values()
            for sh in shards
            if isinstance(sh, ShardedTensor)
        }
        planner = _LazyPlanner(sources, self.produce, flatten_state_dict=False, flatten_sharded_tensors=False)
        writer = FileSystemWriter(str(checkpoint_dir), thread_count=1, single_file_per_rank=True)
        dcp_save(mcore_to_pyt_state_dict(flat, False), storage_writer=writer, planner=planner)

    def async_save(self, *args, **kwargs):
        # Deliberately refused, not a placeholder: the lazy planner must produce each tensor while
        # the writer runs, which an async save (staging everything first) would defeat.
        raise NotImplementedError(
            "LazyTorchDistSave writes synchronously (dist_checkpointing.save with async_sharded_save=False)"
        )


class _LazyPlanner(MCoreSavePlanner):
    def __init__(self, sources: dict, produce: Produce, **kwargs):
        super().__init__(**kwargs)
        self.sources, self.produce = sources, produce

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:  # ShardedObjects (common state): already bytes
            return super().resolve_data(write_item)
        sh = self.sources[(write_item.index.fqn, tuple(write_item.index.offset))]
        tensor = self.produce(sh)
        if tuple(tensor.shape) != tuple(sh.data.shape) or tensor.dtype != sh.dtype:
            raise AssertionError(
                f"{sh.key}: produced {tuple(tensor.shape)} {tensor.dtype}, the checkpoint "
                f"expects {tuple(sh.data.shape)} {sh.dtype}"
            )
        # the torch ShardedTensor carries megatron's prepended (layer / expert) axes as size-1 dims
        return tensor.reshape(write_item.tensor_data.chunk.sizes)
