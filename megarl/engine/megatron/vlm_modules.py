"""The Megatron modules a Qwen2.5-VL model needs besides mbridge's own (vlm.py builds the model).

Imported only once megatron-core is (cpu/compat.import_megatron first), as mla.py is.

- `VisionCoreAttention`: the vision tower's core attention. The tower always hands its layers
  packed (THD) input: one sequence per window in the windowed blocks, one per image frame in the
  full-attention blocks (mbridge's vision_model.py). Megatron's local `DotProductAttention`
  refuses packed input and megarl's `CpuCoreAttention` is causal only; the tower attends both
  ways within a sequence.
- `install_attention_compat`: mbridge 0.15.1's `Qwen2_5VLSelfAttention` predates megatron-core
  0.19's `rotary_pos_cos_sin` argument, which every `TransformerLayer` passes (TypeError).
- `Qwen2_5VLImageModel`: mbridge's model with a forward that takes the 3-D rotary positions it is
  given. mbridge's forward ignores `position_ids` and recomputes them with Qwen's released token
  ids and merge size written into the code, so any other checkpoint (the tiny presets) gets
  1-D positions for its image tokens, and a packed row gets one sequence's positions for all.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from mbridge.models.qwen2_5_vl import model as mbridge_model
from mbridge.models.qwen2_5_vl.attention import Qwen2_5VLSelfAttention
from mbridge.models.qwen2_5_vl.model import Qwen2_5VLModel


class VisionCoreAttention(torch.nn.Module):
    """Drop-in `core_attention` of the vision layers: packed [t, np, d] x3 -> [t, np * d],
    bidirectional within each sequence of `cu_seqlens_q`. Sequences of one length (the tower's
    full windows) go through one fused attention call together."""

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
        **_,
    ):
        super().__init__()
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None, **_
    ):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd" or attention_mask is not None:
            raise NotImplementedError(
                "VisionCoreAttention: the vision tower's input must be packed (THD) and carry no attention_mask"
            )
        if attention_bias is not None:
            raise NotImplementedError("VisionCoreAttention: attention_bias is not supported")
        cu = packed_seq_params.cu_seqlens_q.to(query.device)
        starts, lengths = cu[:-1].long(), (cu[1:] - cu[:-1]).long()
        out = query.new_empty(query.shape[0], query.shape[1] * value.shape[2])
        for length in lengths.unique().tolist():
            index = starts[lengths == length].unsqueeze(1) + torch.arange(length, device=query.device)  # [n, L]
            q, k, v = (x[index].transpose(1, 2) for x in (query, key, value))  # [n, heads, L, d]
            o = F.scaled_dot_product_attention(
                q, k, v, scale=self.softmax_scale, dropout_p=self.dropout if self.training else 0.0
            )
            out[index.reshape(-1)] = o.transpose(1, 2).reshape(-1, out.shape[1])
        return out


class _Qwen2_5VLSelfAttention(Qwen2_5VLSelfAttention):
    def forward(self, *args, rotary_pos_cos_sin=None, **kwargs):
        # megatron-core passes it (None) to every self-attention; only its fused-rope inference sets it
        assert rotary_pos_cos_sin is None, "fused-rope inference is not supported by mbridge's Qwen2.5-VL attention"
        return super().forward(*args, **kwargs)


def install_attention_compat() -> None:
    """Make Qwen2_5VLModel build the attention above (idempotent): its __init__ puts its module's
    `Qwen2_5VLSelfAttention` into both the vision and the language layer specs."""
    mbridge_model.Qwen2_5VLSelfAttention = _Qwen2_5VLSelfAttention


class Qwen2_5VLImageModel(Qwen2_5VLModel):
    """mbridge's Qwen2.5-VL model for text and images (no video: mbridge's video path is broken,
    an inverted `is None` test). `position_ids` are the [3, b, s] rotary positions
    (vlm.mrope_position_ids); other keywords (padding_mask, output_processor) go to the language
    model, as they would to a GPTModel."""

    def __init__(self, *args, spatial_merge_size: int, **kwargs):
        from megatron.core.enums import ModelType

        super().__init__(*args, **kwargs)
        self.spatial_merge_size = spatial_merge_size  # for the positions of image tokens (vlm.py)
        self.model_type = ModelType.encoder_or_decoder  # what Megatron's schedules ask a model (as GPTModel says)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        packed_seq_params=None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
        **language_kwargs,
    ):
        if position_ids is None or position_ids.dim() != 3 or position_ids.shape[0] != 3:
            shape = None if position_ids is None else tuple(position_ids.shape)
            raise ValueError(
                f"Qwen2_5VLImageModel: position_ids {shape} must be the [3, b, s] rotary positions "
                "of vlm.mrope_position_ids"
            )
        embeddings = self._embed(input_ids, pixel_values, image_grid_thw, image_mask) if self.pre_process else None
        return self.language_model(
            input_ids=None,
            position_ids=position_ids,
            attention_mask=attention_mask,
            decoder_input=embeddings,
            labels=labels,
            packed_seq_params=packed_seq_params,
            **language_kwargs,
        )

    def _embed(self, input_ids, pixel_values, image_grid_thw, image_mask=None) -> torch.Tensor:
        """Token embeddings [s, b, h] with each image's features in place of its pad tokens, the
        images in row-major token order (rows first), as Hugging Face places them. `image_mask`
        [b, s]: where the pads are (default: every image_token_id); a response the policy wrote
        may hold that id too, and is text."""
        from megatron.core import tensor_parallel

        embeddings = self.language_model.embedding(input_ids=input_ids, position_ids=None)
        if image_grid_thw is not None and len(image_grid_thw) > 0:
            features = self.vision_model(vision_data=pixel_values, grid_thw=image_grid_thw)
            pads = input_ids == self.image_token_id if image_mask is None else image_mask  # [b, s]
            if int(pads.sum()) != features.shape[0]:
                raise ValueError(
                    f"input_ids hold {int(pads.sum())} image tokens (id {self.image_token_id}) but the "
                    f"images of image_grid_thw {image_grid_thw.tolist()} make {features.shape[0]}: each image "
                    f"needs prod(grid) / {self.spatial_merge_size}^2 of them"
                )
            by_row = embeddings.transpose(0, 1).masked_scatter(pads.unsqueeze(-1), features.to(embeddings.dtype))
            embeddings = by_row.transpose(0, 1).contiguous()
        if self.config.sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings).contiguous()
        return embeddings
