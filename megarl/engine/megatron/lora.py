"""LoRA adapters on the Megatron engine's linear layers, partitioned like the weights they adapt.

PEFT's LoRA: a targeted HF linear `W` [out, in] becomes `W + (alpha / r) * B @ A` with `A` [r, in]
and `B` [out, r] trained, `W` frozen. Megatron fuses HF linears (q/k/v into `linear_qkv`,
gate/up into `linear_fc1`) and splits them over tensor parallel; each targeted HF linear gets an
adapter of its own on the fused layer, partitioned so that the adapted shard equals the shard
of the adapted weight:
- column-parallel layer (`W` split by output rows): `A` whole on every rank, `B` split by the same
  HF rows as `W`; the adapter's output lands at the local rows mbridge's fused layout puts them;
- row-parallel layer (`W` split by input columns): `A` split by the same columns, `B` whole.
Which HF rows a rank holds and where they sit in its shard are read from mbridge's own conversions
(index tensors, as shards.py does), never restated by hand.

Collectives follow the base layer's: a column adapter reduces its `h = A x` gradient over TP (its
`B` shards each contribute), a row adapter reduces `h` in forward; with sequence parallel the
`[tokens, r]` activations are gathered / reduce-scattered instead, and the replicated factor's
gradient, partial over the sequence, is summed by Megatron's own finalize step (the
`sequence_parallel` attribute, as for layer norms). Experts whose layer communicates explicitly
(the dispatcher sums over expert-TP) keep partial outputs and sum the replicated factor's gradient.

Adapters live as a child module (`.lora`) of the layer they adapt, so base weight names (dist
checkpoints, mbridge mapping, the bridge) are unchanged; a forward hook adds their output.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megarl.config.validate_lora import SUPPORTED, matches
from megarl.engine.megatron.shards import _index_tensor
from megarl.engine.megatron.weights import _is_tp_partitioned, _tp_split, local_to_global_names


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _layout(bridge, global_name: str, param: torch.Tensor, dim: int, size: int, rank: int):
    """For each HF tensor of `global_name`: (hf name, HF indices along `dim` this rank holds,
    their positions in the local shard), from mbridge's split and HF conversion of index tensors."""
    full = list(param.shape)
    sharded = size > 1 and _is_tp_partitioned(param)
    if sharded:
        full[dim] *= size
        reduced = torch.empty(tuple(1 if d != dim else param.shape[d] for d in range(param.dim())), device="meta")
        held = bridge._weight_split_across_tp(global_name, _index_tensor(tuple(full), dim, True), reduced, size)[rank]
        held = held.reshape(-1).tolist()
    else:
        held = list(range(full[dim]))
    local = {m: i for i, m in enumerate(held)}
    names = bridge._weight_name_mapping_mcore_to_hf(global_name)
    _, outs = bridge._weight_to_hf_format(global_name, _index_tensor(tuple(full), dim, False))
    out = []
    for name, o in zip(names, outs):
        rows = (o.select(1 - dim, 0) if o.dim() == 2 else o.reshape(-1)).tolist()
        mine = [(h, local[m]) for h, m in enumerate(rows) if m in local]
        hf_rows = torch.tensor([h for h, _ in mine], dtype=torch.long)
        out.append((name, hf_rows, torch.tensor([p for _, p in mine], dtype=torch.long), len(rows)))
    return out


def _init_a(name: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """PEFT's A initialisation (kaiming-uniform, a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), from a
    generator keyed by the HF module name: the same A whatever the layout, on every replica."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=g, dtype=torch.float64) * 2 - 1) * bound


class LoraPart(torch.nn.Module):
    """One HF linear's adapter on a (possibly fused) Megatron layer.

    `index`: the HF indices along the split dim this rank stores, in storage order (column: B's
    rows; row: A's columns). `pos` (column): the local output rows they land on."""

    def __init__(self, hf_module: str, kind: str, a: torch.Tensor, b: torch.Tensor, index, pos, full: int):
        super().__init__()
        self.hf_module, self.kind, self.full = hf_module, kind, full
        self.lora_A = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Parameter(b)
        self.register_buffer("index", index, persistent=False)
        self.register_buffer("pos", pos, persistent=False)


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron linear layer (`layer.lora`), added to its output by a hook."""

    def __init__(self, layer, kind: str, parts: list[LoraPart], spec: LoraSpec, sequence_parallel: bool):
        super().__init__()
        self.kind, self.scale, self.dropout = kind, spec.scale, spec.dropout
        self.parts = torch.nn.ModuleList(parts)
        self.group = layer.tp_group
        self.tp = layer.tp_group.size()
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self.explicit = bool(getattr(layer, "explicit_expert_comm", False)) and self.tp > 1
        self.out_local = layer.weight.shape[0]
        self.enabled = True

    def _x(self, x):
        return F.dropout(x, self.dropout, self.training) if self.dropout else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings as tpm

        g = self.group
        if self.kind == "column":
            outs = []
            for part in self.parts:
                a = tpm.copy_to_tensor_model_parallel_region(part.lora_A, group=g) if self.explicit else part.lora_A
                h = F.linear(self._x(x), a)
                if self.sequence_parallel:  # x is this rank's tokens; B's rows need every token
                    h = tpm.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=g)
                elif self.tp > 1 and not self.explicit:  # x replicated: sum the B shards' dh
                    h = tpm.copy_to_tensor_model_parallel_region(h, group=g)
                outs.append(F.linear(h, part.lora_B))
            if len(self.parts) == 1 and self.parts[0].pos.numel() == self.out_local:
                y = outs[0].index_select(-1, torch.argsort(self.parts[0].pos))
            else:
                pos = torch.cat([p.pos for p in self.parts])
                y = x.new_zeros(*outs[0].shape[:-1], self.out_local).index_copy(-1, pos, torch.cat(outs, -1))
            return y * self.scale
        (part,) = self.parts
        h = F.linear(self._x(x), part.lora_A)
        b = part.lora_B
        if self.explicit:  # partial sums, reduced by the dispatcher; B's gradient summed here
            b = tpm.copy_to_tensor_model_parallel_region(b, group=g)
        elif self.sequence_parallel:
            h = tpm.reduce_scatter_to_sequence_parallel_region(h, group=g)
        elif self.tp > 1:
            h = tpm.reduce_from_tensor_model_parallel_region(h, group=g)
        return F.linear(h, b) * self.scale

    def weight_delta(self) -> torch.Tensor:
        """scale * B @ A in the local weight's layout, differentiable: for a layer whose weight is
        read directly (the output layer under the log-prob head), not through its forward. A's
        gradient is summed over TP (each rank's B rows contribute): here, or with sequence
        parallel by Megatron's finalize step (A is marked for it)."""
        from megatron.core.tensor_parallel import mappings as tpm

        assert self.kind == "column"
        rows = []
        for part in self.parts:
            a = part.lora_A
            if self.tp > 1 and not self.sequence_parallel:
                a = tpm.copy_to_tensor_model_parallel_region(a, group=self.group)
            rows.append(part.lora_B @ a)
        pos = torch.cat([p.pos for p in self.parts])
        base = rows[0].new_zeros(self.out_local, rows[0].shape[1])
        return base.index_copy(0, pos, torch.cat(rows)) * self.scale

    def delta(self, weight: torch.Tensor) -> torch.Tensor:
        """scale * B @ A in the layout of this rank's shard of `weight` (fp32)."""
        if self.kind == "row":
            (part,) = self.parts
            return self.scale * part.lora_B.float() @ part.lora_A.float()
        out = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for part in self.parts:
            out[part.pos] = self.scale * part.lora_B.float() @ part.lora_A.float()
        return out


def _hook(layer, args, output):
    adapter = layer.lora
    if not adapter.enabled:
        return output
    y, bias = output
    return y + adapter(args[0]).to(y.dtype), bias


def _linear_layers(model):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for name, module in model.named_modules():
        if (
            isinstance(module, (ColumnParallelLinear, RowParallelLinear))
            and getattr(module, "weight", None) is not None
        ):
            yield name, module, "column" if isinstance(module, ColumnParallelLinear) else "row"


def attach(bridge, models: list, spec: LoraSpec, seed: int) -> dict[str, list[str]]:
    """Put adapters on every targeted linear of each model chunk and freeze everything else.
    Returns {HF module: [its adapter parameters' local names]} of this rank."""
    attached = {}
    for model in models:
        globals_ = local_to_global_names(model)
        for name, layer, kind in list(_linear_layers(model)):
            global_name = globals_[f"{name}.weight" if name else "weight"]
            parts = _parts(bridge, global_name, layer, kind, spec, seed)
            if not parts:
                continue
            layer.add_module(
                "lora", LoraAdapter(layer, kind, parts, spec, bool(getattr(layer, "sequence_parallel", False)))
            )
            _mark(layer.lora, layer)
            layer.register_forward_hook(_hook)
            attached.update({p.hf_module: [f"{name}.lora.parts.{i}" for i in range(len(parts))] for p in parts})
    if not attached:  # the optimizer would have nothing to hold on this rank
        raise ValueError(
            f"actor.lora.target_modules={list(spec.target_modules)} adapts no layer of this rank's pipeline "
            "stage; target a module every stage has (e.g. all-linear)"
        )
    for model in models:
        for pname, param in model.named_parameters():
            param.requires_grad_(".lora." in pname)
        if getattr(model, "embedding", None) is not None:
            model.embedding.register_forward_hook(_input_requires_grad)
    return attached


def _input_requires_grad(module, args, output):
    """The frozen embedding's output requires grad: a recomputed layer (actor.recompute=full,
    Megatron's reentrant checkpoint) whose inputs need no gradient would give its adapters none
    (PEFT's enable_input_require_grads, for the same reason)."""
    return output.requires_grad_(True)


def _parts(bridge, global_name, layer, kind, spec: LoraSpec, seed: int) -> list[LoraPart]:
    size, rank, _ = _tp_split(global_name)
    dim = 0 if kind == "column" else 1
    layout = _layout(bridge, global_name, layer.weight, dim, size, rank)
    targeted = [item for item in layout if matches(item[0].removesuffix(".weight"), spec.target_modules)]
    if not targeted:
        return []
    module = targeted[0][0].removesuffix(".weight")
    if module.rsplit(".", 1)[-1] not in SUPPORTED:  # validation refuses it first (validate_lora.py)
        raise NotImplementedError(f"actor.lora.target_modules: {module} cannot carry an adapter yet")
    if kind == "row" and len(layout) > 1:
        raise NotImplementedError(f"actor.lora: {global_name} is a fused row-parallel layer; not supported yet")
    dtype, r = layer.weight.dtype, spec.rank
    parts = []
    for hf_name, index, pos, full in targeted:
        hf_module = hf_name.removesuffix(".weight")
        if kind == "column":
            a = _init_a(hf_module, r, layer.weight.shape[1], seed)
            b = torch.zeros(len(index), r, dtype=torch.float64)
        else:  # storage order = local column order
            index = index[torch.argsort(pos)]
            assert len(index) == layer.weight.shape[1], f"{global_name}: a row-parallel shard's columns are not all HF"
            a = _init_a(hf_module, r, full, seed)[:, index]
            b = torch.zeros(layer.weight.shape[0], r, dtype=torch.float64)
        part = LoraPart(hf_module, kind, a.to(dtype), b.to(dtype), index, pos, full)
        parts.append(part.to(layer.weight.device))
    return parts


def _mark(adapter: LoraAdapter, layer) -> None:
    """Megatron's parameter attributes: what is split over TP (counted once per shard in the grad
    norm), what is an expert's (reduced over expert data parallel), what finalize must sum over TP."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    expert = not getattr(layer.weight, "allreduce", True)
    for part in adapter.parts:
        split, whole = (part.lora_B, part.lora_A) if adapter.kind == "column" else (part.lora_A, part.lora_B)
        set_tensor_model_parallel_attributes(split, True, 0 if adapter.kind == "column" else 1, 1)
        if adapter.sequence_parallel:
            whole.sequence_parallel = True
        if expert:
            part.lora_A.allreduce = part.lora_B.allreduce = False


def adapters(models: list):
    """(model chunk, layer name, adapter) of every adapted layer."""
    for model in models:
        for name, module in model.named_modules():
            if isinstance(getattr(module, "lora", None), LoraAdapter):
                yield model, name, module.lora


@contextlib.contextmanager
def disabled(models: list):
    """The base model: every adapter off (the reference policy of a LoRA actor)."""
    found = [a for _, _, a in adapters(models)]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a in found:
            a.enabled = True


def merged_tensors(models: list, named: list[tuple[str, torch.Tensor]], adapted_only: bool):
    """`named` (global name, live tensor) with each adapted weight replaced by W + scale * B @ A in
    its own dtype; adapted_only: just those (the frozen rest is what the engines loaded already)."""
    deltas, names = {}, {}
    for model, name, adapter in adapters(models):
        if id(model) not in names:
            names[id(model)] = local_to_global_names(model)
        deltas[names[id(model)][f"{name}.weight"]] = adapter
    out = []
    for global_name, tensor in named:
        adapter = deltas.get(global_name)
        if adapter is None:
            if not adapted_only:
                out.append((global_name, tensor))
            continue
        merged = (tensor.detach().float() + adapter.delta(tensor)).to(tensor.dtype)
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(tensor, attr):
                setattr(merged, attr, getattr(tensor, attr))
        out.append((global_name, merged))
    return out
