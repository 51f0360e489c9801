"""Fixes for megatron-core bugs and slow paths met on every device (CPU-only patches live in
cpu/compat.py).

Each fix names the version it was found in and the error or the cost; `apply()` is idempotent and
is called when an engine initializes.
"""

from __future__ import annotations

import functools

import torch

_APPLIED = False
megatron_thd_rope = None  # megatron's own per-sequence THD RoPE, kept for the equality test


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    _fix_expert_bias_padding_mask()
    _vectorize_thd_rope()
    _APPLIED = True


def _fix_expert_bias_padding_mask() -> None:
    # megatron-core 0.19.2, TopKRouter.routing: the padding mask is flattened to [tokens] and then
    # `routing_map & ~padding_mask` is taken against routing_map [tokens, experts]: "Attempting to
    # broadcast a dimension of length T" whenever a padding mask is passed and the router keeps an
    # expert bias (DeepSeek-V3). The mask must drop whole rows of the routing map.
    from megatron.core.transformer.moe.router import TopKRouter

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    TopKRouter._apply_expert_bias = _apply_expert_bias


def _vectorize_thd_rope() -> None:
    # megatron-core 0.19.2, rope_utils._apply_rotary_pos_emb_thd (the unfused packed-sequence RoPE,
    # used wherever TE's fused kernel is not): one slice, cos, sin, two muls and a cat per sequence,
    # per layer, for q and for k. On a 16 x 256-token packed micro-batch of a 4-layer model that
    # loop was ~13% of the forward (128 cos/sin calls). Positions restart at 0 in every sequence,
    # so gathering the frequencies of each token's position and rotating the whole stream at once
    # gives the same numbers with one call. The offset mode (frequencies for the whole packed
    # batch, freqs.size(0) == cu_seqlens[-1]) stays with megatron's own code.
    from megatron.core.models.common.embeddings import rope_utils

    global megatron_thd_rope
    original = megatron_thd_rope = rope_utils._apply_rotary_pos_emb_thd

    def _apply_rotary_pos_emb_thd(
        t,
        cu_seqlens,
        freqs,
        rotary_interleaved=False,
        mla_rotary_interleaved=False,
        mscale=1.0,
        cp_group=None,
        multi_latent_attention=None,
    ):
        if cp_group is None or multi_latent_attention is not None or freqs.size(0) == int(cu_seqlens[-1]):
            return original(
                t,
                cu_seqlens,
                freqs,
                rotary_interleaved=rotary_interleaved,
                mla_rotary_interleaved=mla_rotary_interleaved,
                mscale=mscale,
                cp_group=cp_group,
                multi_latent_attention=multi_latent_attention,
            )
        positions = thd_positions(tuple(cu_seqlens.tolist()), cp_group.size(), cp_group.rank())
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1),
            freqs[positions.to(freqs.device)],
            rotary_interleaved=rotary_interleaved,
            mla_rotary_interleaved=mla_rotary_interleaved,
            mscale=mscale,
        ).squeeze(1)

    rope_utils._apply_rotary_pos_emb_thd = _apply_rotary_pos_emb_thd


@functools.lru_cache(maxsize=16)
def thd_positions(cu_seqlens: tuple[int, ...], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Each local token's position within its own sequence, for a packed stream split over CP
    (context_parallel.cp_positions per sequence). Cached: every layer asks again, for q and k."""
    from megarl.engine.megatron.context_parallel import cp_positions

    return torch.cat(
        [cp_positions(end - start, cp_size, cp_rank) for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    )
