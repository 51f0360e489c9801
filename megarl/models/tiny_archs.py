"""Tiny random Hugging Face configs of the other architectures megarl trains through mbridge.

Same conventions as tiny.py's Qwen3-MoE (vocab 64 for the character tokenizer, hidden 64, every
head / expert count divisible by 2 so TP=2 and EP=2 apply). What each preset is there to exercise:

- tiny-qwen2: biases on q/k/v (the only dense family here with `linear_qkv.bias`).
- tiny-qwen3: per-head q/k RMSNorm (`q_layernorm` / `k_layernorm`).
- tiny-llama: plain grouped-query attention, no bias, no qk-norm.
- tiny-deepseek-v3: multi-latent attention with q and kv low-rank projections (K width 24 = nope 16
  + rope 8, V width 12, so K and V head widths differ), one dense layer before the MoE layers
  (first_k_dense_replace=1), a shared expert, a sigmoid router with score-correction bias,
  group-limited routing (n_group=2, topk_group=1, top-2) and routed_scaling_factor 2.5. Top-2 of
  one group: Megatron scores a group by its top (topk // topk_group) = 2 experts, as HF always
  does, so the two agree (megatron-cpu-depth.md).

Initialisation leaves norm weights at 1 and biases (q/k/v bias, e_score_correction_bias) at 0; a
mapping that swapped or dropped them would go unnoticed, so `perturb_constant_tensors` makes them
random too.
"""

from __future__ import annotations

import torch

_COMMON = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_dropout=0.0,
    tie_word_embeddings=False,
    initializer_range=0.02,
    torch_dtype="float32",
    bos_token_id=None,
    eos_token_id=1,
    pad_token_id=0,
)

TINY_QWEN2 = dict(
    _COMMON, architectures=["Qwen2ForCausalLM"], model_type="qwen2", num_hidden_layers=2, use_sliding_window=False
)

TINY_QWEN3 = dict(
    _COMMON,
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    num_hidden_layers=2,
    head_dim=16,
    attention_bias=False,
    use_sliding_window=False,
)

TINY_LLAMA = dict(
    _COMMON,
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    num_hidden_layers=2,
    head_dim=16,
    attention_bias=False,
    mlp_bias=False,
)

TINY_DEEPSEEK_V3 = dict(
    _COMMON,
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    num_hidden_layers=3,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    rope_scaling=None,
    rope_interleave=True,
    attention_bias=False,
)

ARCH_PRESETS = {
    "tiny-qwen2": TINY_QWEN2,
    "tiny-qwen3": TINY_QWEN3,
    "tiny-llama": TINY_LLAMA,
    "tiny-deepseek-v3": TINY_DEEPSEEK_V3,
}


@torch.no_grad()
def perturb_constant_tensors(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give every tensor that init leaves constant (norm weights, biases) random values.

    Norm weights become 1 + N(0, 0.1); biases N(0, 0.02). The router's score-correction bias
    stays small (U(-0.05, 0.05), router scores are sigmoid ~0.5) so every score remains positive:
    HF masks unselected groups to 0, Megatron to -inf, which agree only then.
    """
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if not tensor.is_floating_point() or tensor.numel() < 2 or tensor.unique().numel() > 1:
            continue
        noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        if name.endswith("e_score_correction_bias"):
            tensor.copy_((torch.rand(tensor.shape, generator=generator) - 0.5) * 0.1)
        elif "norm" in name:
            tensor.add_(noise * 0.1)
        elif name.endswith("bias"):
            tensor.add_(noise * 0.02)
