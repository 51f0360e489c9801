"""A vision-language model's micro-batch inputs: each micro-batch's images and 3-D positions.

Rows with images carry them in the non-tensor column `multi_modal_inputs` (models/vision.py
MM_COLUMN): per row a dict {pixel_values [patches, d], image_grid_thw [images, 3]} from the image
processor, or None for a row without images; `input_ids` hold the expanded image pads. A
micro-batch's images are its rows' concatenated in row order (the order the model fills its pads
in, rows first), and its positions are the rotary 3-D ones, per packed sequence (`cu_seqlens`) or
per padded row: the 1-D positions packing.py and inputs.py make are replaced.
"""

from __future__ import annotations

import torch

from megarl.data.batch import Batch
from megarl.models.vision import MM_COLUMN, VisionSpec, mrope_position_ids


def micro_batch_images(mb: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(pixel_values, image_grid_thw) of a micro-batch's rows, in row order; (None, None) without images."""
    if MM_COLUMN not in mb:
        return None, None
    rows = [r for r in mb[MM_COLUMN] if r is not None and r.get("image_grid_thw") is not None]
    if not rows:
        return None, None
    return torch.cat([r["pixel_values"] for r in rows]), torch.cat([r["image_grid_thw"] for r in rows])


def add_vision_inputs(micro: list[Batch], inputs: list[dict], spec: VisionSpec, dtype: torch.dtype) -> None:
    """Each micro-batch's model inputs gain its images (`pixel_values` in the model's dtype,
    `image_grid_thw`), where their pads are (`image_mask`: the image token id inside a prompt; a
    response may hold it too, as text, which is how the rollout engine read it) and 3-D
    `position_ids` [3, b, s] in place of the 1-D ones."""
    for mb, x in zip(micro, inputs):
        pixel_values, grid = micro_batch_images(mb)
        ids, cu = x["input_ids"], x.get("cu_seqlens")
        mask = (ids == spec.image_token_id) & _in_prompt(mb, x["position_ids"], cu)
        marked = ids.masked_fill((ids == spec.image_token_id) & ~mask, -1)  # a written pad id is text
        x["position_ids"] = mrope_position_ids(marked, grid, spec.image_token_id, spec.spatial_merge_size, cu)
        x["pixel_values"] = None if pixel_values is None else pixel_values.to(dtype)
        x["image_grid_thw"], x["image_mask"] = grid, mask


def _in_prompt(mb: Batch, columns: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """[b, s] / [1, t]: whether each position holds a prompt token of its row (`columns`: the
    1-D positions, each row's from 0; `cu_seqlens`: the packed rows' bounds, None when padded)."""
    rows = torch.arange(len(mb))
    if cu_seqlens is None:
        row = rows.unsqueeze(1).expand_as(columns)
    else:
        row = torch.repeat_interleave(rows, cu_seqlens.diff().long()).unsqueeze(0)
    return columns < mb["prompt_lengths"].long()[row]


def model_kwargs(x: dict) -> dict:
    """What the forward passes besides the language model's inputs: the images, for a vision-language model."""
    return {k: x[k] for k in ("pixel_values", "image_grid_thw", "image_mask") if k in x}
