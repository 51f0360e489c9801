"""Core attention for the local (TransformerEngine-free) layer spec, with context parallelism.

Megatron's local `DotProductAttention` refuses CP ("only supported by TEDotProductAttention") and
takes its K/V widths from the config, which breaks MLA (separate K and V head dims). This module
takes every width from the tensors it is given, runs torch's fused `scaled_dot_product_attention`
with an explicit mask, and under CP all-gathers K/V over the CP group and masks causally by GLOBAL
position (context_parallel.py: rank r holds chunks r and 2c-1-r). Memory is O(S^2 / c): there is
no ring overlap, which is fine for CPU-sized sequences.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl.engine.megatron.context_parallel import all_positions, cp_positions


class _GatherKV(torch.autograd.Function):
    """All-gather [s/c, ...] over the CP group along dim 0 (rank order).

    Backward: every rank's queries used every rank's keys, so a key's gradient is the sum over
    ranks; gloo has no reduce_scatter, hence all-reduce then keep this rank's slice.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        n = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * n : (rank + 1) * n], None


class CpuCoreAttention(torch.nn.Module):
    """Drop-in `core_attention` submodule: [sq, b, np, hk] x [sk, b, ng, hk] x [sk, b, ng, hv]
    -> [sq, b, np * hv]."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        **_widths,
    ):
        # `_widths`: MLA passes k_channels / v_channels; the tensors carry them, so they are unused.
        super().__init__()
        from megatron.core import parallel_state as ps

        self.config = config
        self.attn_mask_type = attn_mask_type
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"softmax_type={config.softmax_type!r}: CpuCoreAttention implements "
                "only 'vanilla'; use the TransformerEngine spec on GPU"
            )
        if getattr(config, "window_size", None) is not None:
            raise ValueError(
                "window_size is set: CpuCoreAttention has no sliding-window mask; use the TransformerEngine spec on GPU"
            )
        # Stock default: 1/sqrt(kv_channels). Layer-scaling (apply_query_key_layer_scaling) divides
        # the scores by layer_number and the softmax multiplies it back: a no-op in fp32, skipped.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        cp_group = None
        if pg_collection is not None and hasattr(pg_collection, "cp"):
            cp_group = pg_collection.cp
        elif config.context_parallel_size > 1:
            cp_group = ps.get_context_parallel_group()
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None, **_
    ):
        if attention_bias is not None:
            raise NotImplementedError("CpuCoreAttention: attention_bias is not supported")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = getattr(mask_type, "name", str(mask_type)) in ("causal", "padding_causal")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd" or attention_mask is not None or not causal:
                raise NotImplementedError(
                    "CpuCoreAttention: packed sequences must be THD, causal and without an explicit attention_mask"
                )
            return self._forward_thd(query, key, value, packed_seq_params)

        sq = query.shape[0]
        if self.cp_group is not None:
            if attention_mask is not None:
                raise NotImplementedError(
                    "CpuCoreAttention under context parallel: an explicit "
                    "attention_mask is not supported (the engine passes None)"
                )
            key = _GatherKV.apply(key, self.cp_group)
            value = _GatherKV.apply(value, self.cp_group)
            c = self.cp_group.size()
            q_pos = cp_positions(sq * c, c, self.cp_group.rank())
            k_pos = all_positions(sq * c, c)
        else:
            q_pos = torch.arange(sq) + (key.shape[0] - sq)  # queries are the last sq keys
            k_pos = torch.arange(key.shape[0])

        # [s, b, h, d] -> [b, h, s, d]; grouped-query heads repeated to match the queries
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)

        allowed = None  # True = attend
        if causal:
            allowed = (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)).to(q.device)
        if attention_mask is not None:  # Megatron's convention: True = masked out
            keep = ~attention_mask.bool()
            allowed = keep if allowed is None else keep & allowed
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=self.softmax_scale, dropout_p=self.dropout if self.training else 0.0
        )
        # [b, np, sq, hv] -> [sq, b, np * hv]
        out = out.permute(2, 0, 1, 3).contiguous()
        return out.view(out.shape[0], out.shape[1], -1)

    def _forward_thd(self, query, key, value, params):
        """Packed sequences: [t, np, hk] x [t, ng, hk] x [t, ng, hv] -> [t, np * hv].

        Without CP: sequences of similar length are batched into one fused causal attention call
        each (`_length_groups`), right-padded to the group's longest; no [t, t] mask (a
        block-diagonal mask would cost the whole stream's square). Under CP each sequence is split
        on its own (stream_positions): this rank holds t/c tokens of the stream, and K/V are
        gathered over the CP group.
        """
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu = cu.tolist()
        if self.cp_group is None:
            return self._forward_thd_batched(query, key, value, cu)
        c = self.cp_group.size()
        t_local = query.shape[0]
        key = _GatherKV.apply(key, self.cp_group)
        value = _GatherKV.apply(value, self.cp_group)
        outs = []
        for start, end in zip(cu[:-1], cu[1:]):
            lo, hi = start // c, end // c  # this sequence's tokens on every rank
            q = query[lo:hi]
            k = torch.cat([key[r * t_local + lo : r * t_local + hi] for r in range(c)])
            v = torch.cat([value[r * t_local + lo : r * t_local + hi] for r in range(c)])
            q_pos = cp_positions(end - start, c, self.cp_group.rank())
            allowed = (all_positions(end - start, c).unsqueeze(0) <= q_pos.unsqueeze(1)).to(q.device)
            q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))  # [1, h, s, d]
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=allowed,
                scale=self.softmax_scale,
                dropout_p=self.dropout if self.training else 0.0,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            outs.append(out[0].permute(1, 0, 2).reshape(hi - lo, -1))
        return torch.cat(outs)

    def _forward_thd_batched(self, query, key, value, cu: list[int]):
        """One causal SDPA per group of similar-length sequences, gathered into [b, L] rows.

        Exact: sequences are right-padded, so a real query at position i attends keys 0..i, all
        real; the padded queries' outputs are dropped, so no gradient flows through them.
        The padded slots repeat the sequence's last token (an index clamp, no copy of the stream).
        """
        starts = torch.tensor(cu[:-1])
        lengths = torch.tensor(cu[1:]) - starts
        groups = _length_groups(lengths.tolist())
        pieces, positions = [], []
        for group in groups:
            g = torch.tensor(group)
            s, n = starts[g], lengths[g]
            width = int(n.max())
            col = torch.arange(width)
            real = col.unsqueeze(0) < n.unsqueeze(1)  # [b, L]
            idx = (s.unsqueeze(1) + torch.minimum(col.unsqueeze(0), (n - 1).unsqueeze(1))).to(query.device)
            q, k, v = (x[idx].transpose(1, 2) for x in (query, key, value))  # [b, h, L, d]
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                scale=self.softmax_scale,
                dropout_p=self.dropout if self.training else 0.0,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            out = out.transpose(1, 2).reshape(len(group), width, -1)  # [b, L, np * hv]
            real = real.to(query.device)
            pieces.append(out[real])
            positions.append(idx[real])
        if len(groups) == 1 and groups[0] == list(range(len(groups[0]))):
            return pieces[0]  # one group in stream order: already the stream's layout
        order = torch.cat(positions)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=order.device)
        return torch.cat(pieces)[inverse]


def _length_groups(lengths: list[int], slack: float = 1.25, min_width: int = 16) -> list[list[int]]:
    """Indices of the non-empty sequences grouped by length: sorted (stable), and a new group
    starts at a sequence longer than max(slack x, min_width +) the group's shortest. Padding stays
    under ~25% of a group's attention; short sequences, whose cost is the call itself, share one."""
    order = sorted((i for i in range(len(lengths)) if lengths[i] > 0), key=lengths.__getitem__)
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] <= max(slack * lengths[groups[-1][0]], lengths[groups[-1][0]] + min_width):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def use_cpu_core_attention(layer_spec):
    """Swap `core_attention` in a local layer spec (or every layer of a block spec) in place."""
    for spec in getattr(layer_spec, "layer_specs", None) or [layer_spec]:
        attn = spec.submodules.self_attention
        attn.submodules.core_attention = CpuCoreAttention
    return layer_spec
