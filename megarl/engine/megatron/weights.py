"""Move weights between Hugging Face checkpoints and Megatron shards (TP / EP / PP aware).

mbridge supplies the facts about names and layouts (`_weight_name_mapping_mcore_to_hf`, fused
QKV and gated-MLP formats, how a tensor splits across TP); this module owns the distributed part:
which rank holds which slice, and the collectives that put full tensors back together. Every
rank calls these functions (they contain collectives); all ranks see the same stream of names.

A rank's model is a list of chunks, one per virtual pipeline stage (a list of one without VPP):
functions taking `models` walk every chunk, each with its own layer offset.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl.engine.megatron.model import grouped_expert_index, local_expert_to_grouped


def _mesh():
    from megatron.core import parallel_state as ps

    return ps


def _is_expert(global_name: str) -> bool:
    return ".mlp.experts.linear_fc" in global_name


def local_to_global_names(model) -> dict[str, str]:
    """Map this rank's state-dict names to global mcore names (mbridge's naming).

    Global names use the model-wide layer index (PP / VPP offset) and the grouped-expert form
    `...experts.linear_fc1.weight{global_expert_id}` (EP offset) that mbridge maps to HF.
    """
    ps = _mesh()
    # a vision-language model's pipelined decoder is its language model's (vlm.py); its vision
    # tower's layers sit whole on the first stage and keep their indices
    lm = getattr(model, "language_model", model)
    layers = "language_model.decoder.layers." if lm is not model else "decoder.layers."
    layer_offset = (
        {i: layer.layer_number - 1 for i, layer in enumerate(lm.decoder.layers)} if hasattr(lm, "decoder") else {}
    )
    ep_size, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    names = {}
    for name in model.state_dict():
        if "_extra_state" in name:
            continue
        g = name
        if layers in g:
            idx = int(g.split(layers)[1].split(".")[0])
            g = g.replace(f"{layers}{idx}.", f"{layers}{layer_offset[idx]}.", 1)
        g = local_expert_to_grouped(g)
        expert = grouped_expert_index(g)
        if expert is not None and ep_size > 1:
            per_rank = model.config.num_moe_experts // ep_size
            g = g[: g.rindex("weight")] + f"weight{expert + per_rank * ep_rank}"
        names[name] = g
    return names


def global_tensors(models) -> list[tuple[str, torch.Tensor]]:
    """(global mcore name, live tensor) for every weight of this rank's model chunks.

    named_parameters keeps megatron's attributes (tensor_model_parallel, partition_dim); state_dict
    adds buffers that are weights too (the router's expert_bias).
    """
    out = []
    for model in models:
        tensors = {**model.state_dict(), **dict(model.named_parameters())}
        # LoRA adapters (lora.py) are not weights of the model: they are merged into the ones they adapt
        out.extend((g, tensors[local]) for local, g in local_to_global_names(model).items() if ".lora." not in local)
    return out


def _tp_split(global_name: str) -> tuple[int, int, object]:
    """(size, rank, group) of the tensor-parallel split that applies to this parameter."""
    ps = _mesh()
    if _is_expert(global_name):
        return (
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_group(),
        )
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_group(),
    )


def _is_tp_partitioned(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


class SafetensorsDir:
    """Lazy reader for the tensors of an HF checkpoint directory (single or sharded)."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = str(path)
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(index):
            weight_map = json.load(open(index))["weight_map"]
        else:
            single = os.path.join(self.path, "model.safetensors")
            if not os.path.exists(single):
                raise FileNotFoundError(f"model.path={self.path}: no model.safetensors or model.safetensors.index.json")
            with safe_open(single, "pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        self.weight_map = weight_map
        self._open = safe_open

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"tensor '{name}' is missing from checkpoint {self.path}")
        with self._open(os.path.join(self.path, self.weight_map[name]), "pt") as f:
            return f.get_tensor(name)


@torch.no_grad()
def load_hf_weights(bridge, models, path: str | os.PathLike, skip_prefix: str | None = None) -> None:
    """Fill this rank's shards of its model chunks from the HF checkpoint at `path`.

    Each rank reads what it needs from the (shared) filesystem and keeps its slice, so no
    collective is needed; shapes are checked so a wrong mapping fails loudly, never silently.
    Parameters whose local name starts with `skip_prefix` (a critic's value head) are left alone.
    """
    ckpt = SafetensorsDir(path)
    for global_name, param in global_tensors(models):
        if skip_prefix is not None and global_name.startswith(skip_prefix):
            continue
        hf_names = _checkpoint_names(bridge, global_name, ckpt)
        full = bridge._weight_to_mcore_format(global_name, [ckpt.get(n) for n in hf_names])
        size, rank, _ = _tp_split(global_name)
        if size > 1 and (_is_tp_partitioned(param) or full.shape != param.shape):
            full = bridge._weight_split_across_tp(global_name, full, param, size)[rank]
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(
                f"{global_name} (from {hf_names}): checkpoint shape {tuple(full.shape)} does not "
                f"match the Megatron shard {tuple(param.shape)}"
            )
        param.copy_(full)


def _checkpoint_names(bridge, global_name: str, ckpt: SafetensorsDir) -> list[str]:
    """The HF tensors `global_name` is read from. With tied embeddings transformers saves only
    the embedding, but under PP the last stage has an output layer of its own (Megatron keeps it
    equal to the first stage's embedding): it is read from the embedding."""
    hf_names = bridge._weight_name_mapping_mcore_to_hf(global_name)
    if (
        global_name == "output_layer.weight"
        and hf_names[0] not in ckpt.weight_map
        and getattr(bridge.hf_config, "tie_word_embeddings", False)
    ):
        return bridge._weight_name_mapping_mcore_to_hf("embedding.word_embeddings.weight")
    return hf_names


def _gather_tp(bridge, global_name: str, tensor: torch.Tensor) -> torch.Tensor:
    size, _, group = _tp_split(global_name)
    if size == 1 or not _is_tp_partitioned(tensor):
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    if _is_expert(global_name):
        return _merge_expert_tp(global_name, parts, tensor)
    return bridge._weight_merge_across_tp(global_name, parts, tensor)


def _merge_expert_tp(global_name, parts, param):
    # mbridge's merge keys off the dense TP size; experts split over expert-TP instead.
    if "linear_fc1" in global_name:
        gates, ups = zip(*(p.chunk(2) for p in parts))
        return torch.cat([torch.cat(gates), torch.cat(ups)])
    return torch.cat(parts, dim=1)


EP_GATHER_BYTES = 64 << 20  # local expert bytes per coalesced all-gather (x EP size received)


def _gather_ep(tensors: list[tuple[str, torch.Tensor]], num_experts: int):
    """All experts' copies of some local-expert tensors (one dtype), with their global names, in
    ONE all-gather over the expert-parallel group: a collective per tensor cost ~4% of a
    quickstart rank's samples in weight sync (2 ranks waiting on each other 8 times a step)."""
    ps = _mesh()
    ep_size = ps.get_expert_model_parallel_world_size()
    if ep_size == 1:
        yield from tensors
        return
    flat = torch.cat([t.detach().reshape(-1) for _, t in tensors])
    parts = [torch.empty_like(flat) for _ in range(ep_size)]
    dist.all_gather(parts, flat, group=ps.get_expert_model_parallel_group())
    per_rank = num_experts // ep_size
    offset = 0
    for global_name, tensor in tensors:
        n = tensor.numel()
        local_id = grouped_expert_index(global_name) % per_rank
        prefix = global_name[: global_name.rindex("weight")]
        for r, part in enumerate(parts):
            yield f"{prefix}weight{local_id + per_rank * r}", part[offset : offset + n].view(tensor.shape)
        offset += n


def _full_mcore_tensors(bridge, models, named=None) -> Iterator[tuple[str, torch.Tensor]]:
    """This PP stage's parameters (all its virtual stages; `named`: those (global name, local
    tensor) instead) as full (TP- and EP-gathered) mcore tensors, in parameter order: each run of
    consecutive expert tensors is EP-gathered in chunks (_expert_chunks), so the order stays that of
    the parameters."""
    num_experts = models[0].config.num_moe_experts or 0
    named = global_tensors(models) if named is None else named
    full = ((name, _gather_tp(bridge, name, local)) for name, local in named)
    for expert, run in itertools.groupby(full, key=lambda item: _is_expert(item[0])):
        if not expert:
            yield from ((name, tensor.detach()) for name, tensor in run)
            continue
        for chunk in _expert_chunks(run):
            yield from _gather_ep(chunk, num_experts)


def _expert_chunks(run) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive (name, tensor) of one dtype and up to EP_GATHER_BYTES each (a tensor that
    crosses the cap ends its chunk): one all-gather apiece."""
    chunk, size = [], 0
    for name, tensor in run:
        if chunk and (tensor.dtype != chunk[0][1].dtype or size >= EP_GATHER_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    if chunk:
        yield chunk


@torch.no_grad()
def export_hf_weights(bridge, models, named=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for the whole model (`named`: for those of this rank's
    (global name, local tensor), the same selection on every rank), on every rank.

    Pipeline stages take turns: stage s announces its names and shapes (those of all its virtual
    stages), then broadcasts each tensor from its rank in this rank's PP group.
    """
    ps = _mesh()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    pp_group = ps.get_pipeline_model_parallel_group()
    for stage in range(pp_size):
        mine = list(_full_mcore_tensors(bridge, models, named)) if stage == pp_rank else None
        if pp_size > 1:
            meta = [[(n, tuple(t.shape), t.dtype) for n, t in mine] if mine is not None else None]
            src = dist.get_global_rank(pp_group, stage)
            dist.broadcast_object_list(meta, src=src, group=pp_group)
            if mine is None:
                mine = [(n, torch.empty(s, dtype=d)) for n, s, d in meta[0]]
            for _, t in mine:
                dist.broadcast(t, src=src, group=pp_group)
        for mcore_name, tensor in mine:
            hf_names, hf_tensors = bridge._weight_to_hf_format(mcore_name, tensor)
            yield from zip(hf_names, hf_tensors)


def _owned_params(models, named=None) -> list[tuple[str, torch.Tensor, bool]]:
    """(global name, live tensor, expert?) of the parameters this rank takes part in sending in the
    distributed transport: dense ones on the data-parallel-0 replica of its stage, experts on the
    expert-data-parallel-0 replica. Dense first, then experts (as slime): a rank that helps gather
    dense tensors for its TP-0 peer never waits on the bucket lock while that peer needs it."""
    ps = _mesh()
    dense = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    experts = ps.get_expert_data_parallel_rank() == 0
    names = [(g, t, _is_expert(g)) for g, t in (global_tensors(models) if named is None else named)]
    return [n for n in names if not n[2] and dense] + [n for n in names if n[2] and experts]


def sends_owned_weights(models, named=None) -> bool:
    """Whether export_owned_hf_weights yields anything on this rank (no communication)."""
    return any(_tp_split(g)[1] == 0 for g, _, _ in _owned_params(models, named))


@torch.no_grad()
def export_owned_hf_weights(bridge, models, named=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) of what this rank owns: its stage's dense weights on the TP-0 rank of
    the data-parallel-0 replica, each EP rank's own experts on its expert-TP-0 rank. Tensors are
    gathered over TP / expert-TP as the stream is consumed (bucket by bucket), nothing crosses
    pipeline stages or EP ranks, and no rank ever holds more than its stage's share."""
    for global_name, local, _ in _owned_params(models, named):
        tensor = _gather_tp(bridge, global_name, local)
        if _tp_split(global_name)[1] != 0:
            continue  # a gather helper: its TP-0 peer sends
        hf_names, hf_tensors = bridge._weight_to_hf_format(global_name, tensor.detach())
        yield from zip(hf_names, hf_tensors)
