"""Multi-latent attention (DeepSeek-V3) for the local layer spec, with correct TP gradients.

In the local spec `linear_kv_down_proj` is a ColumnParallelLinear: each TP rank computes a slice
of the latent's columns [kv_lora_rank | rope], and Megatron all-gathers them
(`gather_from_tensor_model_parallel_region`, whose backward keeps only this rank's columns). The
rope part of the key is shared by all heads, and every TP rank's heads use it, so its gradient is
the sum over TP ranks; the gather's backward drops the other ranks' share. Result: TP=2 training
gets wrong gradients silently (max error 0.15 against a largest gradient of 0.42), while the loss
and the logits are right. The TransformerEngine spec is not affected: there the projection is a
duplicated `TELinear`, and Megatron's path for that sums the rope gradient over TP.

`LocalMLASelfAttention` gathers the latent itself and hands Megatron the full-width latent, the
layout of the duplicated path, so Megatron's own code for that path runs:
- sequence parallel: the latent is scattered back to this rank's tokens; Megatron then all-gathers
  the rope key over the sequence, and that gather's backward (a reduce-scatter) sums the heads'
  gradients over TP;
- no sequence parallel: every rank holds the whole sequence and Megatron gathers nothing, so the
  rope columns pass through `copy_to_tensor_model_parallel_region` (backward: all-reduce).
The latent's compressed part needs neither: `linear_kv_up_proj`'s own backward already reduces
its input gradient over TP.

A second local-spec-only error, without sequence parallel: finalize_model_grads sums over TP the
gradients of every parameter named `q_layernorm` (meant for per-head qk-norms, whose ranks see
different heads). MLA's `q_layernorm` normalises the whole q latent, which every rank holds, so its
gradient is already complete and the sum doubles it. Marking it `average_gradients_across_tp_domain`
makes that an average. (With sequence parallel each rank holds its own tokens: the sum is right.
In the TransformerEngine spec the norm is fused into `linear_q_up_proj`, and not summed.)
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention


class LocalMLASelfAttention(MLASelfAttention):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        q_norm = getattr(self, "q_layernorm", None)
        if not self.config.sequence_parallel and q_norm is not None:
            for param in q_norm.parameters():
                param.average_gradients_across_tp_domain = True

    def _qkv_down_projection(self, hidden_states):
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        cfg = self.config
        if kv_combined.size(-1) == cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim:
            return q_compressed, kv_combined  # not split over TP: Megatron's path is right
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=self.tp_group)
        if cfg.sequence_parallel:
            kv_combined = scatter_to_sequence_parallel_region(kv_combined, group=self.tp_group)
        else:
            latent, rope = torch.split(kv_combined, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], -1)
            rope = copy_to_tensor_model_parallel_region(rope, group=self.tp_group)
            kv_combined = torch.cat([latent, rope], dim=-1)
        return q_compressed, kv_combined
