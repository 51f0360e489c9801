"""Megatron's load-balanced context-parallel layout, on plain torch (no TransformerEngine).

With CP size c, each sequence of length S is cut into 2c equal chunks and CP rank r holds chunks
r and 2c-1-r (so every rank gets the same amount of causal-attention work). Megatron slices RoPE
itself in this layout (`get_pos_emb_on_this_cp_rank`); the input split, the attention mask and the
re-assembly of per-token outputs are ours, and all three must use the same positions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def cp_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions (in local order) of the tokens CP rank `cp_rank` holds: [seq_len / cp]."""
    if cp_size == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"context parallel: sequence length {seq_len} must divide by 2*cp="
            f"{2 * cp_size}; pad it (MegatronEngine._padded_length does)"
        )
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


def all_positions(seq_len: int, cp_size: int) -> torch.Tensor:
    """Global positions of an all-gather over the CP group, in rank order: [seq_len]."""
    return torch.cat([cp_positions(seq_len, cp_size, r) for r in range(cp_size)])


def stream_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """cp_positions for a packed stream: every sequence [cu[i], cu[i+1]) is split on its own, and
    this rank's pieces follow each other in sequence order (the THD layout Megatron's RoPE reads)."""
    cu = cu_seqlens.tolist()
    return torch.cat([start + cp_positions(end - start, cp_size, cp_rank) for start, end in zip(cu[:-1], cu[1:])])


def _positions(seq_len: int, size: int, rank: int, cu_seqlens) -> torch.Tensor:
    if cu_seqlens is None:
        return cp_positions(seq_len, size, rank)
    return stream_positions(cu_seqlens, size, rank)


def split_for_cp(t: torch.Tensor, group, dim: int = 1, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's tokens of a full-sequence tensor (sequence on `dim`); with `cu_seqlens`, of a
    packed stream of sequences, each split on its own."""
    size = _size(group)
    if size == 1:
        return t
    pos = _positions(t.shape[dim], size, dist.get_rank(group), cu_seqlens)
    return t.index_select(dim, pos.to(t.device))


class _GatherSeq(torch.autograd.Function):
    """All-gather per-token values [b, s/c] into global order [b, s].

    Backward keeps only this rank's positions, without summing over ranks: every CP rank computes
    the SAME loss from the gathered tensor, so summing would count each token's gradient c times.
    Each token's gradient flows back exactly once, on the rank that owns the token.
    """

    @staticmethod
    def forward(ctx, x, group, cu_seqlens):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        seq_len = x.shape[1] * size
        full = x.new_empty(x.shape[0], seq_len, *x.shape[2:])
        gathered = torch.cat([_positions(seq_len, size, r, cu_seqlens) for r in range(size)])
        full[:, gathered.to(x.device)] = torch.cat(parts, dim=1)
        ctx.own = _positions(seq_len, size, rank, cu_seqlens).to(x.device)
        return full

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.own], None, None


def gather_from_cp(x: torch.Tensor, group, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """[b, s/c, ...] local (CP layout) -> [b, s, ...] global order; identity without CP. With
    `cu_seqlens`, x is this rank's part of a packed stream (split_for_cp's layout)."""
    if _size(group) == 1:
        return x
    return _GatherSeq.apply(x, group, cu_seqlens)


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)
