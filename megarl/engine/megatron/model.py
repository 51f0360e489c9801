"""Build Megatron-core GPT models from Hugging Face configs through mbridge.

mbridge owns the architecture facts (TransformerConfig from the HF config, parameter-name mapping,
fused-QKV / gated-MLP formats). This module adapts it to what megarl runs: the local
(TransformerEngine-free) layer spec, fusions off where no CUDA kernels exist, and SequentialMLP
experts (named `local_experts.{i}.linear_fcX.weight`) instead of grouped-GEMM ones.
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
)


def local_expert_to_grouped(name: str) -> str:
    """`...experts.local_experts.3.linear_fc1.weight` -> `...experts.linear_fc1.weight3`."""
    return _LOCAL_EXPERT.sub(lambda m: f".mlp.experts.{m.group(2)}.weight{m.group(1)}", name)


def grouped_expert_index(name: str) -> int | None:
    m = _GROUPED_EXPERT.search(name)
    return int(m.group(2)) if m else None


def _local_spec_mixin(base: type) -> type:
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

        def _build_config(self):
            self.extra_args = {**NO_FUSION_ARGS, **self._megarl_overrides, **self.extra_args}
            return super()._build_config()

        def _get_transformer_layer_spec(self, vp_stage=None):
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

            from megarl.engine.megatron.cpu_attention import use_cpu_core_attention

            cfg = self.config
            # mbridge's provider passes vp_stage on to GPTModel only when this is set (its own
            # version of this method sets it); GPTModel then builds this virtual stage's layers.
            # The local spec is one layer spec for every layer, so it needs no vp_stage itself.
            self.has_vp_stage = True
            # our core attention: the stock local one refuses context parallelism and MLA widths
            return use_cpu_core_attention(get_gpt_layer_local_spec(
                num_experts=cfg.num_moe_experts,
                moe_grouped_gemm=False,
                qk_layernorm=cfg.qk_layernorm,
                normalization="RMSNorm",
            ))

    LocalSpecBridge.__name__ = f"Local{base.__name__}"
    return LocalSpecBridge


def make_bridge(hf_config, dtype: torch.dtype = torch.float32, **config_overrides):
    """An mbridge bridge for `hf_config` that builds local-spec models.

    `config_overrides` go into Megatron's TransformerConfig (e.g. sequence_parallel=True).
    Parallel sizes come from megatron's parallel_state, which must be initialised first.
    """
    from mbridge.core.bridge import _MODEL_REGISTRY

    model_type = hf_config.model_type
    if model_type not in _MODEL_REGISTRY:
        raise ValueError(
            f"model.path: model_type '{model_type}' is not supported by mbridge; "
            f"supported: {sorted(_MODEL_REGISTRY)}"
        )
    cls = _local_spec_mixin(_MODEL_REGISTRY[model_type])
    cls._megarl_overrides = dict(config_overrides)
    return cls(hf_config, dtype=dtype)
