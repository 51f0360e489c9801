"""What each tensor-parallel rank holds: the TP plan, its validation, and the slice of every HF tensor.

The plan is transformers' own (`config.base_model_tp_plan`), rewritten to the plain-tensor styles
of transformers' TP machinery: `local_colwise` / `local_rowwise` keep each shard an ordinary
tensor, and one `gather` (an all-reduce) per attention / MLP block sums the row-parallel partial
outputs — once per block, not once per expert. Two styles are added here, registered with
transformers' `ParallelInterface`, because transformers has none for them: a vocab-parallel
embedding (rows split by token id, each rank embeds the ids it owns, one all-reduce) and a
vocab-parallel LM head (rows split, the logit shards gathered to rank 0).

Which slice a rank holds is a pure function of (HF name, full shape, plan, tp, rank):
`shard_spec`. The loader, weight updates, `/update_weights_from_disk` and the layout endpoint all
use it, and `load_sharded_model` checks it against what transformers actually loaded.
Shards are contiguous and equal (sizes must divide by tp; `validate_tp` says which does not).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.models.vision import VisionSpec

VOCAB_EMBEDDING = "megarl_vocab_embedding"
VOCAB_HEAD = "megarl_vocab_head"
BLOCK_GATHER = "gather"  # transformers' GatherParallel: all-reduce a block's first output
_COLWISE, _ROWWISE = "local_colwise", "local_rowwise"
# config keys whose values are split across ranks (heads split whole; sizes split evenly)
_SPLIT_CONFIG_KEYS = (
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def tp_plan_for(config) -> dict[str, str]:
    """The model class's transformers TP plan in plain-tensor form, keyed as in `model.tp_plan`.

    colwise/rowwise (or their local_ forms) become local_colwise/local_rowwise; every other style
    (replicated routers, DTensor-only styles) is dropped, i.e. those tensors stay whole on every
    rank. A `gather` goes on each `layers.*.<block>` that holds a row-parallel layer.
    """
    base = getattr(type(config), "base_model_tp_plan", None) or {}
    if not base:
        raise ValueError(
            f"{type(config).__name__} has no tensor-parallel plan in transformers "
            f"(base_model_tp_plan is empty); this model can only run with --tp 1"
        )
    plan: dict[str, str] = {}
    for pattern, style in base.items():
        kind = style.removeprefix("local_")
        if kind not in ("colwise", "rowwise"):
            continue
        plan[f"model.{pattern}"] = _COLWISE if kind == "colwise" else _ROWWISE
        if kind == "rowwise":
            parts = pattern.split(".")
            if parts[:2] != ["layers", "*"] or len(parts) < 4:
                raise ValueError(
                    f"row-parallel layer {pattern!r} of {type(config).__name__} is not inside a "
                    "'layers.*.<block>' module, so there is no block to all-reduce after it"
                )
            plan["model." + ".".join(parts[:3])] = BLOCK_GATHER
    plan["model.embed_tokens"] = VOCAB_EMBEDDING
    plan["lm_head"] = VOCAB_HEAD
    return plan


def validate_tp(config, tp: int) -> None:
    """ValueError naming the config key that tp does not divide (heads are never split inside)."""
    if tp < 1:
        raise ValueError(f"--tp {tp} must be >= 1")
    if tp > 1 and VisionSpec.of(config) is not None:  # the mesh shards and runs text models only
        raise ValueError(
            f"--tp {tp}: vision-language models ({config.model_type}) run with tp=1 in the embedded "
            "engine (its tensor-parallel ranks shard and feed text models only); start it with --tp 1, "
            "or more engines behind the router"
        )
    for key in _SPLIT_CONFIG_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value % tp:
            raise ValueError(
                f"--tp {tp} does not divide the model's {key}={value}; choose a tp that divides "
                f"num_attention_heads, num_key_value_heads, vocab_size and the MLP sizes"
            )


@dataclass(frozen=True)
class ShardSpec:
    """Rank `rank`'s part of one full HF tensor: `full[start:stop]` along `dim`, or all of it."""

    name: str
    global_shape: tuple[int, ...]
    dim: int | None  # None: replicated, the rank holds the whole tensor
    start: int
    stop: int

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.global_shape
        return tuple(self.stop - self.start if d == self.dim else s for d, s in enumerate(self.global_shape))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor (a view)."""
        return full if self.dim is None else full.narrow(self.dim, self.start, self.stop - self.start)

    def index(self) -> tuple[slice, ...]:
        """The slice as an index, e.g. for safetensors' `get_slice(name)[index]`."""
        if self.dim is None:
            return tuple(slice(None) for _ in self.global_shape)
        return tuple(
            slice(self.start, self.stop) if d == self.dim else slice(None) for d in range(len(self.global_shape))
        )


def style_of(name: str, plan: dict[str, str]) -> str | None:
    """The plan entry for a parameter: its module's style (digits are wildcards), as transformers matches."""
    generic = re.sub(r"\d+", "*", name)
    if generic in plan:
        return plan[generic]
    return plan.get(generic.rsplit(".", 1)[0]) if "." in generic else None


def shard_dim(name: str, ndim: int, plan: dict[str, str]) -> int | None:
    """Which dim of the full tensor is split across ranks (None: replicated)."""
    style, is_bias = style_of(name, plan), name.endswith(".bias")
    if style in (_COLWISE, VOCAB_HEAD):  # output features split: weight rows (dim -2), bias
        dim = -1 if is_bias else -2
    elif style == VOCAB_EMBEDDING:
        dim = 0
    elif style == _ROWWISE:
        if is_bias:
            raise ValueError(
                f"{name}: a row-parallel layer with a bias is not supported (every rank would "
                "add the bias before the all-reduce)"
            )
        dim = -1
    else:
        return None
    return dim % ndim


def shard_spec(name: str, global_shape, plan: dict[str, str], tp: int, rank: int) -> ShardSpec:
    shape = tuple(int(s) for s in global_shape)
    dim = shard_dim(name, len(shape), plan) if tp > 1 else None
    if dim is None:
        return ShardSpec(name, shape, None, 0, shape[0] if shape else 0)
    if shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of shape {shape} does not divide by tp={tp}")
    size = shape[dim] // tp
    return ShardSpec(name, shape, dim, rank * size, (rank + 1) * size)


def parameter_layout(full_shapes: dict[str, tuple[int, ...]], plan: dict[str, str], tp: int, nnodes: int = 1) -> dict:
    """The engine's layout, as `GET /get_parallelism_config` answers it (JSON-ready):

        {"tp_size": 2, "nnodes": 1,
         "ranks": [{"rank": 0, "node_rank": 0,
                    "params": {"model.layers.0.self_attn.q_proj.weight":
                                   {"global_shape": [64, 64], "dim": 0, "range": [0, 32], "local_shape": [32, 64]},
                               "model.norm.weight":
                                   {"global_shape": [64], "dim": null, "range": null, "local_shape": [64]},
                               ...}},
                   {"rank": 1, ...}]}

    Rank r holds `full.narrow(dim, range[0], range[1] - range[0])` (stop exclusive) of each HF
    tensor, or the whole tensor where `dim` is null. Ranks r*tp/nnodes .. (r+1)*tp/nnodes - 1
    run on node r. Tied names (an LM head sharing the embedding) are listed under both names.
    """
    per_node = tp // nnodes
    ranks = []
    for rank in range(tp):
        params = {}
        for name, shape in full_shapes.items():
            spec = shard_spec(name, shape, plan, tp, rank)
            params[name] = {
                "global_shape": list(spec.global_shape),
                "dim": spec.dim,
                "range": None if spec.dim is None else [spec.start, spec.stop],
                "local_shape": list(spec.local_shape),
            }
        ranks.append({"rank": rank, "node_rank": rank // per_node, "params": params})
    return {"tp_size": tp, "nnodes": nnodes, "ranks": ranks}


# ---- the two styles transformers lacks -------------------------------------------------------------
def _register_styles() -> None:
    from transformers.integrations.tensor_parallel import ParallelInterface, TensorParallelLayer, get_tensor_shard

    class _VocabParallel(TensorParallelLayer):
        use_dtensor = False

        def partition_tensor(self, param, empty_param, param_type, dtype, to_contiguous, rank, device_mesh):
            dim = -1 if param_type == "bias" else 0
            shard = get_tensor_shard(param, empty_param, device_mesh, rank, dim).to(dtype)
            shard = shard.contiguous() if to_contiguous else shard
            return torch.nn.Parameter(shard, requires_grad=False)

    class VocabParallelEmbedding(_VocabParallel):
        """Each rank embeds the ids in its vocab range (zeros elsewhere); an all-reduce sums them."""

        def prepare_module_tp(self, module, device_mesh):
            per_rank = module.num_embeddings // device_mesh.size()
            rank = device_mesh.get_local_rank()
            module._megarl_vocab_range = (rank * per_rank, (rank + 1) * per_rank)
            module.padding_idx = None  # a training-only hint, and it may index past the local rows
            module.register_forward_pre_hook(_embed_local_ids)
            module.register_forward_hook(_sum_embeddings)

    class VocabParallelHead(_VocabParallel):
        """Each rank scores its vocab range; rank 0 gathers the full-vocab logits."""

        def prepare_module_tp(self, module, device_mesh):
            module.register_forward_hook(_gather_logits_to_rank0)

    ParallelInterface.register(VOCAB_EMBEDDING, VocabParallelEmbedding())
    ParallelInterface.register(VOCAB_HEAD, VocabParallelHead())


def _embed_local_ids(module, args):
    ids, (lo, hi) = args[0], module._megarl_vocab_range
    outside = (ids < lo) | (ids >= hi)
    module._megarl_outside = outside
    return ((ids - lo).masked_fill(outside, 0), *args[1:])


def _sum_embeddings(module, args, out):
    out = out.masked_fill(module._megarl_outside[..., None], 0.0)
    dist.all_reduce(out)
    return out


def _gather_logits_to_rank0(module, args, out):
    out = out.contiguous()
    if dist.get_rank() != 0:
        dist.gather(out, None, dst=0)
        return out  # followers never read logits
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.gather(out, parts, dst=0)
    return torch.cat(parts, dim=-1)


def load_sharded_model(model_path: str, dtype: torch.dtype, device: torch.device, tp: int):
    """transformers' TP loader with this plan: each rank reads only its slices from safetensors.

    The default process group must be up, with exactly tp ranks. Returns (model, plan, full
    shapes of every HF name).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    _register_styles()
    config = AutoConfig.from_pretrained(model_path)
    validate_tp(config, tp)
    plan = tp_plan_for(config)
    if dist.get_world_size() != tp:
        raise RuntimeError(f"the process group has {dist.get_world_size()} ranks, tp={tp}")
    # transformers builds `model.tp_plan` from config.base_model_tp_plan (prefixing "model.") and
    # drops the class's lm_head entry, so the head is listed unprefixed here as well.
    config.base_model_tp_plan = {k.removeprefix("model."): v for k, v in plan.items()}
    kwargs = {}
    if device.type != "cpu":  # on CPU transformers' own mesh works; an explicit one breaks its loader
        kwargs["device_mesh"] = dist.device_mesh.init_device_mesh(device.type, (tp,))
    elif torch._C._get_accelerator().type != "cpu":
        raise ValueError(
            "--device cpu with --tp > 1 on a machine with an accelerator: transformers' TP "
            "loader would place the shards on the accelerator; use --device cuda"
        )
    model = AutoModelForCausalLM.from_pretrained(
        model_path, config=config, dtype=dtype, tp_plan="auto", tp_size=tp, **kwargs
    ).eval()
    shapes = full_shapes(config)
    for name, tensor in model.state_dict().items():
        expected = shard_spec(name, shapes[name], plan, tp, dist.get_rank()).local_shape
        assert tuple(tensor.shape) == expected, f"{name}: loaded {tuple(tensor.shape)}, plan says {expected}"
    return model, plan, shapes


def full_shapes(config) -> dict[str, tuple[int, ...]]:
    """Full HF shapes of every state_dict entry (tied names included), from a weightless model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}
