"""Build Megatron-core GPT models from Hugging Face configs through mbridge.

mbridge owns the architecture facts (TransformerConfig from the HF config, parameter-name mapping,
fused-QKV / gated-MLP formats). This module adapts it to what megarl runs: the local
(TransformerEngine-free) layer spec, fusions off where no CUDA kernels exist, and SequentialMLP
experts (named `local_experts.{i}.linear_fcX.weight`) instead of grouped-GEMM ones.

mbridge's DeepSeek-V3 bridge assumes the TransformerEngine spec; with the local spec it needs
(megatron-cpu-depth.md): the MLA config's name for the RoPE length, names for the q/kv latent
norms (TE fuses them into the up projections), the block spec so the first k layers are dense,
group-limited routing passed on (mbridge drops n_group / topk_group: SILENTLY different routing),
and LocalMLASelfAttention (mla.py: otherwise TP>1 gradients are SILENTLY wrong).
"""

from __future__ import annotations

import re

import torch

_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")

# Kernels that exist only with CUDA / TransformerEngine / apex. Switched off by config, not by
# editing call sites (DESIGN.md "Engines").
NO_FUSION_ARGS = dict(
    use_cpu_initialization=True,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    gradient_accumulation_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    bias_activation_fusion=False,
    moe_permute_fusion=False,
    moe_grouped_gemm=False,
    cross_entropy_loss_fusion=False,
    moe_shared_expert_overlap=False,  # overlaps on a second CUDA stream
    # The spec is local whatever mbridge asks for (DeepSeek-V3: "fused"). Megatron pins the choice
    # in process-wide NVTE_* variables and asserts when a later model in the process differs.
    attention_backend="local",
)

# The local spec keeps MLA's latent norms as modules of their own.
_MLA_NORM_MAPPING = {
    "self_attention.q_layernorm.weight": ["model.layers.{layer_number}.self_attn.q_a_layernorm.weight"],
    "self_attention.kv_layernorm.weight": ["model.layers.{layer_number}.self_attn.kv_a_layernorm.weight"],
}


def local_expert_to_grouped(name: str) -> str:
    """`...experts.local_experts.3.linear_fc1.weight` -> `...experts.linear_fc1.weight3`."""
    return _LOCAL_EXPERT.sub(lambda m: f".mlp.experts.{m.group(2)}.weight{m.group(1)}", name)


def grouped_expert_index(name: str) -> int | None:
    m = _GROUPED_EXPERT.search(name)
    return int(m.group(2)) if m else None


def _local_spec_mixin(base: type) -> type:
    from megatron.core.transformer import MLATransformerConfig

    is_mla = issubclass(getattr(base, "TransformerConfigClass", object), MLATransformerConfig)

    class LocalSpecBridge(base):
        # The local spec keeps layer norms as modules of their own (TE fuses them into linears).
        _OTHER_MAPPING = {
            **getattr(base, "_OTHER_MAPPING", {}),
            "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"],
        }
        _MLP_MAPPING = {
            **base._MLP_MAPPING,
            "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
        }

        if is_mla:
            _ATTENTION_MAPPING = {**base._ATTENTION_MAPPING, **_MLA_NORM_MAPPING}

        def _adjust_mapping_for_shared_weights(self):
            # mbridge's Qwen2 bridge maps a tied output layer to the embedding by writing into the
            # CLASS dict, shared by every later Qwen2 / Qwen3 bridge of the process: an untied model
            # built after a tied one would read and export its output layer as the embedding
            self._DIRECT_MAPPING = dict(getattr(self, "_DIRECT_MAPPING", {}))
            super()._adjust_mapping_for_shared_weights()

        def _build_config(self):
            self.extra_args = {
                **NO_FUSION_ARGS,
                **_routing_args(self.hf_config),
                **_mtp_args(self.hf_config),
                **self._megarl_overrides,
                **self.extra_args,
            }
            return super()._build_config()

        def _build_base_config(self, text_config_key=None, **kwargs):
            if is_mla and "max_position_embeddings" in kwargs:
                # mbridge passes the rope's original length under the dense config's name
                kwargs["original_max_position_embeddings"] = kwargs.pop("max_position_embeddings")
            return super()._build_base_config(text_config_key, **kwargs)

        def _get_transformer_layer_spec(self, vp_stage=None):
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

            from megarl.engine.megatron.cpu.attention import use_cpu_core_attention

            self.has_vp_stage = True  # read by mbridge's model providers (megatron-core >= 0.13)
            # the block spec follows moe_layer_freq (DeepSeek-V3's first k layers are dense); our
            # core attention: the stock local one refuses context parallelism and MLA widths
            spec = get_gpt_decoder_block_spec(
                self.config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
            )
            return use_local_mla(use_cpu_core_attention(spec))

    LocalSpecBridge.__name__ = f"Local{base.__name__}"
    return LocalSpecBridge


def _routing_args(hf_config) -> dict:
    """Group-limited routing (DeepSeek-V3's n_group / topk_group), which mbridge does not pass."""
    n_group, topk_group = getattr(hf_config, "n_group", None), getattr(hf_config, "topk_group", None)
    if not n_group or not topk_group or topk_group >= n_group:
        return {}  # every group selected: no restriction
    topk = hf_config.num_experts_per_tok
    if topk // topk_group != 2:
        # HF scores a group by its top-2 experts, Megatron by its top (topk // topk_group)
        raise ValueError(
            f"model.path: num_experts_per_tok={topk} / topk_group={topk_group} != 2: Megatron would "
            "score expert groups differently from Hugging Face (by their top "
            f"{max(topk // topk_group, 1)} experts instead of 2); use a config where they agree "
            "(DeepSeek-V3: 8 / 4)"
        )
    return dict(moe_router_num_groups=n_group, moe_router_group_topk=topk_group)


def _mtp_args(hf_config) -> dict:
    # mbridge builds multi-token-prediction layers with the TransformerEngine spec; RL does not
    # train them, so they are not built (their checkpoint tensors are not loaded or exported).
    return {"mtp_num_layers": None} if getattr(hf_config, "num_nextn_predict_layers", 0) else {}


def pipeline_split_args(p) -> dict:
    """Megatron's uneven pipeline split from a ParallelConfig (validate_pipeline.py checks it).
    Layer numbers, and so every weight name, follow from it (weights.py reads layer_number)."""
    args = {
        "num_layers_in_first_pipeline_stage": p.first_stage_layers,
        "num_layers_in_last_pipeline_stage": p.last_stage_layers,
    }
    return {k: v for k, v in args.items() if v is not None}


def use_local_mla(block_spec):
    """Swap MLASelfAttention for LocalMLASelfAttention (mla.py) in every layer, in place."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megarl.engine.megatron.mla import LocalMLASelfAttention

    for spec in block_spec.layer_specs:
        if spec.submodules.self_attention.module is MLASelfAttention:
            spec.submodules.self_attention.module = LocalMLASelfAttention
    return block_spec


# actor.recompute / critic.recompute -> Megatron's activation-recompute options (schema.py says what
# each saves and costs). "selective" keeps recompute_modules at Megatron's default (["core_attn"]).
RECOMPUTE_ARGS = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
}


def recompute_args(recompute: str) -> dict:
    """Megatron's TransformerConfig options for a recompute setting."""
    if recompute not in RECOMPUTE_ARGS:
        raise ValueError(
            f"recompute={recompute!r} (actor.recompute / critic.recompute) is not supported; "
            f"use one of {list(RECOMPUTE_ARGS)}"
        )
    return dict(RECOMPUTE_ARGS[recompute])


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def precision_dtype(precision: str) -> torch.dtype:
    """The parameter dtype of actor.precision. bf16 parameters and activations: Megatron's optimizer
    keeps fp32 master weights (engine._build_optimizer), DDP reduces gradients in fp32 and the
    log-prob head upcasts the logits (logprob.py), as Megatron's mixed-precision training does."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"actor.precision={precision!r} is not supported; use one of "
            f"{sorted(PRECISIONS)} (fp16 needs loss scaling, which megarl does not do)"
        )
    return PRECISIONS[precision]


def make_bridge(hf_config, dtype: torch.dtype = torch.float32, **config_overrides):
    """An mbridge bridge for `hf_config` that builds local-spec models.

    `config_overrides` go into Megatron's TransformerConfig (e.g. sequence_parallel=True).
    Parallel sizes come from megatron's parallel_state, which must be initialised first.
    """
    from mbridge.core.bridge import _MODEL_REGISTRY

    model_type = hf_config.model_type
    if model_type not in _MODEL_REGISTRY:
        raise ValueError(
            f"model.path: model_type '{model_type}' is not supported by mbridge; supported: {sorted(_MODEL_REGISTRY)}"
        )
    cls = _local_spec_mixin(_MODEL_REGISTRY[model_type])
    cls._megarl_overrides = dict(config_overrides)
    return cls(hf_config, dtype=dtype)
