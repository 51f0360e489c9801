"""The 4-D attention mask the engine hands the HF model when rows are padded.

Continuous batching left-pads every row to the running batch's widest (kv_merge.py), so almost
every forward of a busy engine carries padding. Given the 2-D padding mask, transformers 4.57
builds the 4-D mask itself with `torch.vmap` over its mask functions (masking_utils
`sdpa_mask_recent_torch`), which is pure overhead at the sizes a CPU engine runs: measured at
29-41% of the forward's time in a fully_async run of `benchmarks/bench_async.py` (py-spy),
and 0% in the sync loop, whose batches are not padded. The same mask is two broadcast
comparisons: key column j is visible to query i of row b when the row has a token there and
j <= past + i. HF passes a 4-D mask through unchanged, so the model sees the identical
boolean tensor (sdpa) or additive float mask (eager) it would have built: the outputs are
bit-for-bit the same (tests/rollout/engine/test_attn_mask.py, every tiny architecture).

Where HF needs no mask (no padding) or builds something else (sliding-window or chunked
layers, other attention kernels), the 2-D mask goes through as before.

Grouped KV heads. With a mask, transformers' sdpa path copies the key and value heads up to
the query heads (`repeat_kv`, a copy of the whole cache per layer and step) because on CUDA
SDPA's GQA falls back to the math kernel there; CPU's flash kernel takes the mask and the
groups as they are. `prepare_model` switches a CPU model to `megarl_sdpa`: HF's sdpa with
`enable_gqa` also under a mask, bit-for-bit the same outputs (tests/rollout/engine/test_attn_mask.py) and
31 -> 24 ms for a decode step of 256 rows over 190 cached columns (tiny Qwen3-MoE, 1 thread).
"""

from __future__ import annotations

import torch

ENGINE_SDPA = "megarl_sdpa"
_REGISTERED = False


def prepare_model(model) -> None:
    """A CPU model on transformers' sdpa attention switches to ENGINE_SDPA (module doc)."""
    global _REGISTERED
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or model.device.type != "cpu":
        return
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionInterface.register(ENGINE_SDPA, _sdpa_gqa)
        AttentionMaskInterface.register(ENGINE_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        _REGISTERED = True
    model.set_attn_implementation(ENGINE_SDPA)


def _sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa_attention_forward, with grouped KV heads passed as they are under a mask."""
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    groups = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal, **groups
    )
    return out.transpose(1, 2).contiguous(), None


def model_attention_mask(config, mask: torch.Tensor, q_len: int, dtype: torch.dtype) -> torch.Tensor:
    """`mask` [rows, past + q_len] (1: the column holds one of the row's tokens) -> the mask to
    pass as `attention_mask` for a forward of `q_len` new tokens per row."""
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", ENGINE_SDPA, "eager") or _has_local_attention(config) or bool(mask.all()):
        return mask
    width = mask.shape[1]
    keys = torch.arange(width, device=mask.device)
    queries = torch.arange(width - q_len, width, device=mask.device)
    allowed = mask.bool()[:, None, None, :] & (keys[None, :] <= queries[:, None])[None, None]
    if impl != "eager":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def _has_local_attention(config) -> bool:
    """Sliding-window or chunked layers get their own masks from HF (a 4-D mask would be used
    for them as is, wrongly)."""
    layer_types = getattr(config, "layer_types", None) or []
    return (
        any(t != "full_attention" for t in layer_types)
        or bool(getattr(config, "use_sliding_window", False))
        or getattr(config, "attention_chunk_size", None) is not None
    )


def forward_step(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache, keep_all: bool):
    """One engine forward (prefill or decode) of the HF model on `cache`; every rank calls this."""
    attention_mask = model_attention_mask(model.config, mask, ids.shape[1], model.dtype)
    return model(
        input_ids=ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=0 if keep_all else 1,
    )
