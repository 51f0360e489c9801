"""LoRA adapters in and out of the engine: full PEFT-named tensors, PEFT adapter folders, the
adapters' part of a distributed checkpoint, and the weight stream a sync sends.

PEFT names an adapter `base_model.model.<HF module>.lora_A.weight` / `lora_B.weight`, full size
([r, in] and [out, r]). Each rank holds its pieces (lora.py: a column layer's B rows, a row
layer's A columns, the other factor whole); a piece is sent by the first TP rank (when whole) of
the first data-parallel replica (expert data-parallel for experts), so every element comes once.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megarl.engine.megatron.lora import LoraSpec, adapters, merged_tensors
from megarl.engine.megatron.weights import export_hf_weights, export_owned_hf_weights, global_tensors
from megarl.engine.megatron.weights import sends_owned_weights as _sends_owned

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def peft_key(hf_module: str, factor: str) -> str:
    return f"base_model.model.{hf_module}.lora_{factor}.weight"


def _pieces(part, kind: str):
    """(factor, parameter, split dim or None) of one part: which factor is split, along what."""
    if kind == "column":
        return (("A", part.lora_A, None), ("B", part.lora_B, 0))
    return (("A", part.lora_A, 1), ("B", part.lora_B, None))


def _replica_rank(param) -> int:
    from megatron.core import parallel_state as ps

    if not getattr(param, "allreduce", True):  # an expert's: replicated over expert data parallel
        return ps.get_expert_data_parallel_rank()
    return ps.get_data_parallel_rank(with_context_parallel=True)


def _local_pieces(models):
    """(key, full shape, split dim, HF indices, tensor, tp rank, replica rank) of this rank."""
    for _, _, adapter in adapters(models):
        tp_rank = dist.get_rank(adapter.group) if adapter.tp > 1 else 0
        for part in adapter.parts:
            for factor, param, dim in _pieces(part, adapter.kind):
                shape = list(param.shape)
                if dim is not None:
                    shape[dim] = part.full
                yield (
                    peft_key(part.hf_module, factor),
                    tuple(shape),
                    dim,
                    part.index,
                    param,
                    tp_rank,
                    _replica_rank(param),
                )


@torch.no_grad()
def adapter_state(models) -> dict[str, torch.Tensor]:
    """Every adapter tensor, full and PEFT-named, on every rank (a collective over the world)."""
    mine = [
        (key, shape, dim, index, param.detach().cpu().clone())
        for key, shape, dim, index, param, tp_rank, replica in _local_pieces(models)
        if replica == 0 and (dim is not None or tp_rank == 0)
    ]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    state: dict[str, torch.Tensor] = {}
    for key, shape, dim, index, tensor in (piece for rank_pieces in everyone for piece in rank_pieces):
        if dim is None:
            state[key] = tensor
            continue
        full = state.setdefault(key, torch.zeros(shape, dtype=tensor.dtype))
        full.index_copy_(dim, index, tensor)
    return state


@torch.no_grad()
def load_adapter_state(models, state: dict[str, torch.Tensor]) -> None:
    """Set this rank's adapter pieces from full PEFT-named tensors (any layout wrote them)."""
    for key, shape, dim, index, param, _, _ in _local_pieces(models):
        if key not in state:
            raise KeyError(f"adapter tensor {key} is missing")
        full = state[key]
        if tuple(full.shape) != shape:
            raise ValueError(f"adapter tensor {key}: shape {tuple(full.shape)}, this model needs {shape}")
        param.copy_(full if dim is None else full.index_select(dim, index.to(full.device)))


def sharded_state_dict(models) -> dict:
    """The adapters of each model chunk as dist-checkpoint tensors keyed by their PEFT names (the
    base weights are not in it: the checkpoint names its base). The ShardedTensors hold the
    parameters themselves, which is how Megatron's optimizer finds each one's state."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for i, model in enumerate(models):
        chunk = {}
        for key, shape, dim, index, param, tp_rank, replica in _local_pieces([model]):
            if dim is None:
                chunk[key] = ShardedTensor.from_rank_offsets(key, param, replica_id=(tp_rank, replica))
                continue
            n = param.shape[dim]
            lo = int(index[0])
            if not torch.equal(index.cpu(), torch.arange(lo, lo + n)) or lo % n or shape[dim] % n:
                raise NotImplementedError(
                    f"{key}: this rank's rows are not an equal contiguous slice; cannot checkpoint"
                )
            chunk[key] = ShardedTensor.from_rank_offsets(
                key, param, (dim, lo // n, shape[dim] // n), replica_id=(0, replica)
            )
        out[f"chunk{i}"] = chunk
    return out


@torch.no_grad()
def load_sharded(models, loaded: dict) -> None:
    """Copy what dist_checkpointing.load returned for sharded_state_dict(models) into the adapters."""
    for i, model in enumerate(models):
        got = loaded[f"chunk{i}"]
        for key, _, _, _, param, _, _ in _local_pieces([model]):
            param.copy_(got[key])


def adapter_config(spec: LoraSpec, base: str, modules: list[str]) -> dict:
    """PEFT's adapter_config.json: `target_modules` are the short names of the adapted modules."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def write_peft_folder(models, spec: LoraSpec, base: str, out_dir: str, write: bool) -> dict:
    """The adapters as a folder `peft.PeftModel.from_pretrained(base_model, out_dir)` loads; a
    collective, `write` on one rank. Returns {tensors, bytes}."""
    from safetensors.torch import save_file

    state = adapter_state(models)
    modules = sorted({k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in state})
    if write:
        os.makedirs(out_dir, exist_ok=True)
        tmp = os.path.join(out_dir, ADAPTER_FILE + ".partial")
        save_file({k: v.contiguous() for k, v in state.items()}, tmp)
        os.replace(tmp, os.path.join(out_dir, ADAPTER_FILE))
        with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
            json.dump(adapter_config(spec, base, modules), f, indent=1, sort_keys=True)
    return {"tensors": len(state), "bytes": sum(v.numel() * v.element_size() for v in state.values())}


class AdaptedWeights:
    """What a weight sync sends for a LoRA actor: the adapted weights only, merged (W + scale B A),
    in the engine's export interface. The rollout engines loaded the same frozen base, and the
    rest never changes."""

    def __init__(self, engine):
        self.engine = engine

    def _named(self):
        models = self.engine.bare_chunks()
        return merged_tensors(models, global_tensors(models), adapted_only=True)

    def export_weights(self):
        return export_hf_weights(self.engine.bridge, self.engine.bare_chunks(), self._named())

    def export_owned_weights(self):
        return export_owned_hf_weights(self.engine.bridge, self.engine.bare_chunks(), self._named())

    def sends_owned_weights(self) -> bool:
        return _sends_owned(self.engine.bare_chunks(), self._named())

    def export_adapter(self) -> tuple[dict, dict]:
        """(adapter_config.json, every adapter tensor full and PEFT-named) on every rank: what the
        adapter transport sends. A collective."""
        models, spec = self.engine.bare_chunks(), self.engine.spec
        state = adapter_state(models)
        modules = sorted({k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in state})
        return adapter_config(spec.lora, spec.model_path, modules), state

    def local_pieces(self):
        raise NotImplementedError(
            "bridge.transport=reshard does not send LoRA-merged weights yet; use tensor, distributed or disk"
        )
