"""Load a chosen part of a torch_dist checkpoint: a list of megatron ShardedTensors, nothing else.

megatron's `dist_checkpointing.load` cannot load part of a layer-stacked key on a one-rank world:
its ShardedTensor -> torch ShardedTensor translation describes the fragments this rank does not
hold as belonging to "another" rank ((rank + 1) % world_size, i.e. itself), and torch refuses
(`Number of local shards (1) does not match number of local shards metadata ... (2)`). PyTorch
DCP itself reads any box of a saved tensor, so this planner asks DCP for exactly the targets'
boxes (global key, offsets with megatron's layer / expert axes, sizes) and DCP copies the bytes
into them. Optimizer, RNG and common-state entries are never read.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan

from checkpoint_convert import ConvertError


def load_sharded_tensors(path: str, tensors: list[ShardedTensor]) -> None:
    """Fill each ShardedTensor's `data` (a real tensor; may be a view) from the checkpoint at `path`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    targets = {}
    for sh in tensors:  # DCP's chunks carry megatron's prepended axes as size-1 dims
        box = sh.data.view((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        targets[(sh.key, tuple(sh.global_offset))] = (sh, box)
    dcp_load({}, storage_reader=FileSystemReader(path), planner=_BoxesPlanner(path, targets))


class _BoxesPlanner(DefaultLoadPlanner):
    def __init__(self, path: str, targets: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.path, self.targets = path, targets

    def create_local_plan(self) -> LoadPlan:
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        saved = self.metadata.state_dict_metadata
        items = []
        for (key, offsets), (sh, box) in self.targets.items():
            md = saved.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise ConvertError(
                    f"{self.path}: tensor '{key}' is not in the checkpoint (does config.json "
                    "describe the model that was saved?)"
                )
            if tuple(md.size) != tuple(sh.global_shape):
                raise ConvertError(
                    f"{self.path}: shape mismatch for tensor '{key}': {tuple(md.size)} in the "
                    f"checkpoint, {tuple(sh.global_shape)} expected from config.json"
                )
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=box.shape)
            found = create_read_items_for_chunk_list(key, md, [chunk])
            if sum(i.lengths.numel() for i in found) != box.numel():
                raise ConvertError(f"{self.path}: tensor '{key}' at offsets {offsets} is not fully saved")
            items += found
        return LoadPlan(items)

    def resolve_tensor(self, read_item) -> torch.Tensor:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        _, box = self.targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        return narrow_tensor_by_index(box, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # DCP copied into a view of the target
