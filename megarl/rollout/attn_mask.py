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
bit-for-bit the same (tests/test_attn_mask.py, every tiny architecture).

Where HF needs no mask (no padding) or builds something else (sliding-window or chunked
layers, other attention kernels), the 2-D mask goes through as before.
"""

from __future__ import annotations

import torch


def model_attention_mask(config, mask: torch.Tensor, q_len: int, dtype: torch.dtype) -> torch.Tensor:
    """`mask` [rows, past + q_len] (1: the column holds one of the row's tokens) -> the mask to
    pass as `attention_mask` for a forward of `q_len` new tokens per row."""
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager") or _has_local_attention(config) or bool(mask.all()):
        return mask
    width = mask.shape[1]
    keys = torch.arange(width, device=mask.device)
    queries = torch.arange(width - q_len, width, device=mask.device)
    allowed = mask.bool()[:, None, None, :] & (keys[None, :] <= queries[:, None])[None, None]
    if impl == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def _has_local_attention(config) -> bool:
    """Sliding-window or chunked layers get their own masks from HF (a 4-D mask would be used
    for them as is, wrongly)."""
    layer_types = getattr(config, "layer_types", None) or []
    return (any(t != "full_attention" for t in layer_types) or bool(getattr(config, "use_sliding_window", False))
            or getattr(config, "attention_chunk_size", None) is not None)


def forward_step(model, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache, keep_all: bool):
    """One engine forward (prefill or decode) of the HF model on `cache`; every rank calls this."""
    attention_mask = model_attention_mask(model.config, mask, ids.shape[1], model.dtype)
    return model(input_ids=ids, attention_mask=attention_mask, position_ids=positions, past_key_values=cache,
                 use_cache=True, logits_to_keep=0 if keep_all else 1)
