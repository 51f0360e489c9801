"""Parameter counts and FLOPs of the models megarl trains, from their Hugging Face config alone.

Pure arithmetic (no torch, no Megatron): MFU logging calls it every step and `megarl plan` calls
it for a 671B model on a laptop. Supported `model_type`s: llama, qwen2, qwen3 (dense, gated MLP),
qwen3_moe, deepseek_v3 (multi-latent attention, MoE with shared experts and first-k dense layers).

Parameters are counted the way model cards count them: embeddings and LM head included (tied
embeddings counted once), every routed expert in the total and the top-k in the activated count,
norms, biases, router weights. Not counted:

- DeepSeek-V3's multi-token-prediction module (num_nextn_predict_layers): the card's 671B is the
  main model; the 14B MTP module is on top of it (685B in the checkpoint). Transformers does not
  build it either.
- DeepSeek-V3's router score-correction bias (n_routed_experts per MoE layer, 14,848 in all): it
  is a buffer updated by the load-balancing rule, not a trained weight (a buffer in transformers
  and in Megatron alike).

FLOPs use the usual model-FLOPs convention: 2 FLOPs per multiply-add of every activated weight
matrix (attention projections, MLP / experts, router, LM head; not the embedding lookup, not norms,
biases, activations or softmax), plus the causal attention term per layer and sequence,
2 * n_heads * (qk_head_dim + v_head_dim) * L*(L+1)/2 (QK^T and AV; grouped-query attention
shares K/V heads but not these products, so it does not reduce the term). MLA is counted in its
training (non-absorbed) form with qk_head_dim = nope + rope and v_head_dim. Sliding-window
attention is not modelled: a config that enables it is refused rather than over-counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")


@dataclass(frozen=True)
class Counts:
    """Per-model parameter tallies. `matmul_active`: weight-matrix parameters one token multiplies."""

    total: int
    active: int
    matmul_active: int


def _as_dict(hf_config) -> dict:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):  # a transformers PretrainedConfig
        return hf_config.to_dict()
    raise TypeError(f"expected an HF config dict, got {type(hf_config).__name__}")


def _model_type(cfg: dict) -> str:
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise ValueError(f"FLOPs model: model_type={mt!r} is not supported; supported: {', '.join(SUPPORTED)}")
    if cfg.get("use_sliding_window"):
        raise ValueError(
            f"FLOPs model: {mt} with use_sliding_window=true is not modelled "
            "(full causal attention would over-count); set use_sliding_window=false"
        )
    return mt


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _attention_dims(cfg: dict) -> tuple[int, int, int]:
    """(n_heads, qk_head_dim, v_head_dim) of the score and value products."""
    if cfg["model_type"] == "deepseek_v3":
        return (cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"])
    hd = _head_dim(cfg)
    return cfg["num_attention_heads"], hd, hd


def _attention_params(cfg: dict) -> tuple[int, int]:
    """(matmul weights, other params: biases and norms) of one attention block."""
    h, mt = cfg["hidden_size"], cfg["model_type"]
    bias = bool(cfg.get("attention_bias", False))
    if mt == "deepseek_v3":
        n, qk, v = _attention_dims(cfg)
        qr, kvr, rope = cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        if qr:  # low-rank q: q_a_proj (+bias), q_a_layernorm, q_b_proj
            mm, other = h * qr + qr * n * qk, qr + (qr if bias else 0)
        else:
            mm, other = h * n * qk, 0
        mm += h * (kvr + rope) + kvr * n * (qk - rope + v) + n * v * h  # kv_a, kv_b, o_proj
        other += kvr + ((kvr + rope) + h if bias else 0)  # kv_a_layernorm, kv_a / o biases
        return mm, other
    n, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], _head_dim(cfg)
    mm = h * n * hd + 2 * h * kv * hd + n * hd * h
    if mt == "qwen2":  # q/k/v always biased, o never
        other = n * hd + 2 * kv * hd
    else:
        other = (n * hd + 2 * kv * hd + h) if bias else 0
    if mt in ("qwen3", "qwen3_moe"):  # per-head q/k RMSNorm
        other += 2 * hd
    return mm, other


def _is_moe_layer(cfg: dict, i: int) -> bool:
    mt = cfg["model_type"]
    if mt == "qwen3_moe":
        return (
            i not in (cfg.get("mlp_only_layers") or [])
            and cfg.get("num_experts", 0) > 0
            and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0
        )
    if mt == "deepseek_v3":
        return (
            cfg.get("n_routed_experts") is not None
            and i >= cfg.get("first_k_dense_replace", 0)
            and i % cfg.get("moe_layer_freq", 1) == 0
        )
    return False


def _mlp_params(cfg: dict, i: int) -> Counts:
    """Counts of layer i's MLP (dense gated MLP, or router + experts + shared experts)."""
    h = cfg["hidden_size"]
    if not _is_moe_layer(cfg, i):
        mm = 3 * h * cfg["intermediate_size"]
        other = (2 * cfg["intermediate_size"] + h) if cfg.get("mlp_bias") else 0
        return Counts(mm + other, mm + other, mm)
    n_exp = cfg["num_experts"] if cfg["model_type"] == "qwen3_moe" else cfg["n_routed_experts"]
    expert = 3 * h * cfg["moe_intermediate_size"]
    router = n_exp * h
    shared = 3 * h * cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0)
    active = router + shared + cfg["num_experts_per_tok"] * expert
    return Counts(router + shared + n_exp * expert, active, active)


def count_params(hf_config) -> Counts:
    """Total, activated and activated-matmul parameter counts (see the module docstring)."""
    cfg = _as_dict(hf_config)
    _model_type(cfg)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    attn_mm, attn_other = _attention_params(cfg)
    tied = bool(cfg.get("tie_word_embeddings", False))
    total = vocab * h * (1 if tied else 2) + h  # embeddings, LM head, final norm
    active = total
    matmul = vocab * h  # LM head multiplies whether tied or not; the lookup does not
    for i in range(cfg["num_hidden_layers"]):
        mlp = _mlp_params(cfg, i)
        layer_fixed = attn_mm + attn_other + 2 * h  # + input / post-attention norms
        total += layer_fixed + mlp.total
        active += layer_fixed + mlp.active
        matmul += attn_mm + mlp.matmul_active
    return Counts(total, active, matmul)


def param_counts(hf_config: dict) -> tuple[int, int]:
    """(total parameters, parameters activated per token), counted as model cards count them."""
    c = count_params(hf_config)
    return c.total, c.active


def _causal_pairs(lengths: Iterable[int]) -> int:
    """Sum over sequences of L*(L+1)/2: the (query, key) pairs of causal attention."""
    return sum(int(n) * (int(n) + 1) // 2 for n in lengths)


def _check_lens(name: str, lens: Sequence[int]) -> list[int]:
    out = [int(n) for n in lens]
    if any(n < 0 for n in out):
        raise ValueError(f"{name} must be non-negative token counts, got {out}")
    return out


def attention_flops_per_pair(hf_config: dict) -> float:
    """FLOPs of QK^T and AV for one (query, key) pair, summed over layers and heads."""
    cfg = _as_dict(hf_config)
    _model_type(cfg)
    n, qk, v = _attention_dims(cfg)
    return 2.0 * n * (qk + v) * cfg["num_hidden_layers"]


def forward_flops(hf_config: dict, seq_lens: Sequence[int]) -> float:
    """Forward FLOPs of independent causal sequences of these lengths, packed (no padding)."""
    lens = _check_lens("seq_lens", seq_lens)
    c = count_params(hf_config)
    return 2.0 * c.matmul_active * sum(lens) + attention_flops_per_pair(hf_config) * _causal_pairs(lens)


def train_flops(hf_config: dict, seq_lens: Sequence[int], recompute: bool = False) -> float:
    """Forward + backward (backward = 2x forward); full activation recompute adds one forward."""
    return (4.0 if recompute else 3.0) * forward_flops(hf_config, seq_lens)


def generation_flops(hf_config: dict, prompt_lens: Sequence[int], response_lens: Sequence[int]) -> float:
    """FLOPs to generate the responses with a KV cache: prefill of each prompt, then one decode
    step per fed-back response token, each attending to its whole prefix (no prefix recompute).

    The prefill already yields the first response token and the last one is never fed back, so a
    response of R >= 1 tokens costs R - 1 decode steps; in all, the forward passes cover the
    positions 1 .. P + R - 1 of each sequence, once each.
    """
    prompts = _check_lens("prompt_lens", prompt_lens)
    responses = _check_lens("response_lens", response_lens)
    if len(prompts) != len(responses):
        raise ValueError(f"prompt_lens ({len(prompts)}) and response_lens ({len(responses)}) differ in length")
    c = count_params(hf_config)
    per_pair = attention_flops_per_pair(hf_config)
    total = 0.0
    for p, r in zip(prompts, responses):
        fed = p + max(r - 1, 0)  # positions that go through the model
        total += 2.0 * c.matmul_active * fed + per_pair * fed * (fed + 1) // 2
    return total


@dataclass(frozen=True)
class LayerParams:
    """Layer i's parameters by how a Megatron layout splits them (the planner's unit).

    attn / mlp: matrices sharded by tensor parallel (attention q/k/v/o and MLA's up-projections;
    a dense MLP or the shared experts); replicated: copied on every tensor-parallel rank (norms, biases,
    the router, MLA's low-rank down-projections q_a / kv_a); expert: one routed expert (sharded by
    expert parallel, then by expert tensor parallel); experts: how many this layer has (0: dense).
    """

    attn: int
    mlp: int
    replicated: int
    expert: int
    experts: int


def layer_params(hf_config, i: int) -> LayerParams:
    cfg = _as_dict(hf_config)
    _model_type(cfg)
    h = cfg["hidden_size"]
    attn_mm, attn_other = _attention_params(cfg)
    replicated = attn_other + 2 * h  # + input / post-attention norms
    if cfg["model_type"] == "deepseek_v3":  # q_a / kv_a are not split (Megatron's MLA)
        down = h * (cfg.get("q_lora_rank") or 0) + h * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
        attn_mm, replicated = attn_mm - down, replicated + down
    if not _is_moe_layer(cfg, i):
        mlp = _mlp_params(cfg, i)
        return LayerParams(attn_mm, mlp.matmul_active, replicated + mlp.total - mlp.matmul_active, 0, 0)
    n_exp = cfg["num_experts"] if cfg["model_type"] == "qwen3_moe" else cfg["n_routed_experts"]
    expert = 3 * h * cfg["moe_intermediate_size"]
    shared = expert * (cfg.get("n_shared_experts") or 0)
    return LayerParams(attn_mm, shared, replicated + n_exp * h, expert, n_exp)
