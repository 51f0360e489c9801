"""Qwen2.5-VL's model inputs, shared by the Megatron engine, the rollout engine and the trainer.

A prompt reaches a rollout engine as SGLang takes it: token ids with one `<|image_pad|>` per image
(between `<|vision_start|>` and `<|vision_end|>`) and the images beside them (`image_data`). The
engine, and the trainer for its log-prob and training passes, turn that into the model's inputs
the same way, here: the image processor makes each image's patches `pixel_values` [sum(t*h*w),
3 * 2 * 14 * 14] and its grid `image_grid_thw` [n, 3]; each image's single pad becomes prod(grid) /
merge^2 pads, the tokens its features replace; the rotary positions are 3-D
(`mrope_position_ids`), and a sequence's text after its last image runs `rope_delta` ahead of its
token index, which is how decoding continues.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.config.validate_vision import VISION_MODEL_TYPES

# the rows' non-tensor column of a vision-language model's image inputs: per row a dict
# {pixel_values, image_grid_thw} (process_images), or None for a row without images
MM_COLUMN = "multi_modal_inputs"


@dataclass(frozen=True)
class VisionSpec:
    """What turns a prompt with images into a vision-language model's inputs."""

    model_type: str
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int

    @classmethod
    def of(cls, hf_config) -> VisionSpec | None:
        """The spec of a Hugging Face config; None for a model without a vision tower."""
        if getattr(hf_config, "model_type", None) not in VISION_MODEL_TYPES:
            return None
        return cls(
            model_type=hf_config.model_type,
            image_token_id=int(hf_config.image_token_id),
            vision_start_token_id=int(hf_config.vision_start_token_id),
            vision_end_token_id=int(hf_config.vision_end_token_id),
            spatial_merge_size=int(hf_config.vision_config.spatial_merge_size),
        )

    @property
    def placeholder_ids(self) -> list[int]:
        """The ids that stand for one image in a prompt before its pads are expanded."""
        return [self.vision_start_token_id, self.image_token_id, self.vision_end_token_id]


def image_processor(config, min_pixels: int = 56 * 56, max_pixels: int = 448 * 448):
    """transformers' Qwen2-VL image processor for `config`'s vision tower, built without a hub.
    Images are resized to multiples of patch * merge (28) pixels a side, their area kept within
    [min_pixels, max_pixels]."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    v = config.vision_config
    return Qwen2VLImageProcessor(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size,
        merge_size=v.spatial_merge_size,
    )


def load_image_processor(path: str, config):
    """The checkpoint's own image processor (its preprocessor_config.json), else image_processor(config)."""
    from pathlib import Path

    if (Path(path) / "preprocessor_config.json").is_file():
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(path)
    return image_processor(config)


def as_array(image):
    """An RGB image [H, W, 3] as a uint8 numpy array (from a numpy array, a torch uint8 tensor or a PIL image)."""
    import numpy as np

    if isinstance(image, torch.Tensor):
        array = image.numpy()
    elif isinstance(image, np.ndarray):
        array = image
    else:
        array = np.asarray(image.convert("RGB"))
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise ValueError(
            f"image of shape {tuple(array.shape)} and dtype {array.dtype}: expected uint8 [H, W, 3] "
            "(a numpy array, a torch tensor or a PIL image)"
        )
    return array


def process_images(images: list, processor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, image_grid_thw) of `images` (numpy / torch / PIL, in prompt order)."""
    encoded = processor(images=[as_array(i) for i in images], return_tensors="pt", input_data_format="channels_last")
    return encoded["pixel_values"], encoded["image_grid_thw"]


def expand_image_pads(
    prompt_ids: list[int], image_grid_thw: torch.Tensor | None, image_token_id: int, merge: int
) -> list[int]:
    """`prompt_ids` with each image's single pad (one per image, in order) expanded to its
    prod(grid) / merge^2 pads; ValueError when the pads and the images do not pair up."""
    counts = [] if image_grid_thw is None else (image_grid_thw.prod(dim=1) // merge**2).tolist()
    placeholders = sum(1 for t in prompt_ids if t == image_token_id)
    if placeholders != len(counts):
        raise ValueError(
            f"the prompt holds {placeholders} image placeholder(s) (id {image_token_id}) for "
            f"{len(counts)} image(s): put one per image where it belongs"
        )
    it = iter(counts)
    out: list[int] = []
    for t in prompt_ids:
        out.extend([t] * int(next(it)) if t == image_token_id else [t])
    return out


def encode_prompt(prompt_ids: list[int], images: list, config, processor=None) -> dict:
    """Model inputs of a prompt with images: `input_ids` [1, s] (the pads expanded),
    `pixel_values` and `image_grid_thw` (None without images). `processor`: image_processor(config)
    unless given."""
    if not images:
        expand_image_pads(prompt_ids, None, config.image_token_id, 1)  # no stray placeholders
        return {"input_ids": torch.tensor([prompt_ids]), "pixel_values": None, "image_grid_thw": None}
    pixel_values, grid = process_images(images, processor or image_processor(config))
    ids = expand_image_pads(prompt_ids, grid, config.image_token_id, config.vision_config.spatial_merge_size)
    return {"input_ids": torch.tensor([ids]), "pixel_values": pixel_values, "image_grid_thw": grid}


def mrope_position_ids(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    image_token_id: int,
    spatial_merge_size: int,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Qwen2.5-VL's 3-D rotary positions [3, b, s] of `input_ids` [b, s] (Hugging Face's
    get_rope_index, for images). Text counts up on all three axes; an image's prod(grid) /
    merge^2 pad tokens take (0, row, column) of its merged grid, offset by the position the next
    text token would have had; the text after it continues from the image's largest position + 1.
    `image_grid_thw` [n, 3] lists the images in token order, rows first. `cu_seqlens`: every row
    is a packed stream of these sequences, each starting from position 0."""
    grids = [] if image_grid_thw is None else [tuple(int(x) for x in g) for g in image_grid_thw.tolist()]
    out = torch.empty((3, *input_ids.shape), dtype=torch.long)
    used = 0
    bounds = [0, input_ids.shape[1]] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    for b, row in enumerate(input_ids.tolist()):
        for start, end in zip(bounds[:-1], bounds[1:]):
            out[:, b, start:end], used = _sequence_positions(
                row[start:end], grids, used, image_token_id, spatial_merge_size
            )
    if used != len(grids):
        raise ValueError(
            f"image_grid_thw lists {len(grids)} images but input_ids hold the image tokens of {used}: "
            f"each image needs its prod(grid) / {spatial_merge_size}^2 tokens of id {image_token_id}"
        )
    return out.to(input_ids.device)


def _sequence_positions(ids: list[int], grids: list, used: int, image_token_id: int, merge: int):
    """(positions [3, len(ids)] of one sequence, images used so far)."""
    pieces, next_pos, i = [], 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            end = ids.index(image_token_id, i) if image_token_id in ids[i:] else len(ids)
            pieces.append(torch.arange(next_pos, next_pos + end - i).expand(3, -1))
            next_pos, i = next_pos + end - i, end
            continue
        if used == len(grids):
            raise ValueError(f"input_ids hold more images than the {len(grids)} of image_grid_thw")
        t, h, w = grids[used][0], grids[used][1] // merge, grids[used][2] // merge
        n = t * h * w
        if ids[i : i + n] != [image_token_id] * n:
            raise ValueError(
                f"image {used} (grid {list(grids[used])}) needs {n} consecutive image tokens "
                f"(id {image_token_id}); input_ids hold fewer at its place"
            )
        grid = torch.stack(
            [
                torch.zeros(n, dtype=torch.long),
                torch.arange(h).repeat_interleave(w).repeat(t),
                torch.arange(w).repeat(t * h),
            ]
        )
        pieces.append(grid + next_pos)
        next_pos, i, used = next_pos + int(grid.max()) + 1, i + n, used + 1
    return (torch.cat(pieces, dim=1) if pieces else torch.empty(3, 0, dtype=torch.long)), used


def rope_delta(positions: torch.Tensor) -> int:
    """How far a sequence's next text position runs ahead of its token count: max(positions) + 1 -
    len, for one sequence's [3, len] positions (0 without images)."""
    return int(positions.max()) + 1 - positions.shape[-1] if positions.numel() else 0


class PromptImages:
    """A vision-language checkpoint's way from (prompt ids with one pad per image, images) to the
    model's inputs: the expanded ids, and the row's {pixel_values, image_grid_thw} (MM_COLUMN).
    What the trainer computes for its own passes is what a rollout engine computes from the same
    ids and images, so the log-probs of both score the same tokens."""

    def __init__(self, model_path: str):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
        spec = VisionSpec.of(config)
        if spec is None:
            raise ValueError(
                f"{model_path}: model_type {config.model_type!r} has no vision tower; rows with images need one"
            )
        self.spec, self.processor = spec, load_image_processor(model_path, config)

    def model_inputs(self, prompt_ids: list[int], images: list) -> tuple[list[int], dict | None]:
        """(expanded ids, the row's MM_COLUMN entry or None without images)."""
        if not images:
            return expand_image_pads(prompt_ids, None, self.spec.image_token_id, 1), None
        pixel_values, grid = process_images(images, self.processor)
        ids = expand_image_pads(prompt_ids, grid, self.spec.image_token_id, self.spec.spatial_merge_size)
        return ids, {"pixel_values": pixel_values, "image_grid_thw": grid}
