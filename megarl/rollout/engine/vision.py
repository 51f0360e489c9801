"""Prompts with images on the embedded engine (Qwen2.5-VL): their inputs, prefill and positions.

A prompt arrives as SGLang takes it: token ids with one `<|image_pad|>` per image and the images
beside them. `VisionInputs.prepare` does what SGLang's processor does before scheduling: decode
each image, run the checkpoint's image processor (`pixel_values`, `image_grid_thw`), expand each
image's pad to prod(grid) / merge^2 pads, and compute the prompt's 3-D rotary positions and its
rope delta (models/vision.py). The request then carries the expanded ids, so everything the
engine reports in prompt tokens (prompt_tokens, input log-probs, prompt_token_ids, context
checks) counts the expanded prompt, as SGLang's does.

Prefill (`prefill_inputs`, `vision_forward`). Rows are left-padded; each row's positions are
computed on its own tokens and placed right-aligned ([3, rows, width]; text rows count up on all
three axes). The image features are scattered into the token embeddings at the prompt's pad
positions, which the engine knows, rather than wherever `input_ids` holds the pad id as the
model's own forward would: a retracted row re-prefills prompt + output, and an output token
that happens to be the pad id is text, not an image. Decode needs no per-step work: a row's next
position is its token count + its rope delta on all three axes, so the running batch's 2-D
positions (which the model expands to three axes) start from `last` = fed - 1 + delta and count
up as for any text row.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from megarl.data.errors import DatasetError
from megarl.data.images import decode_image
from megarl.models.vision import (
    VisionSpec,
    expand_image_pads,
    load_image_processor,
    mrope_position_ids,
    process_images,
    rope_delta,
)
from megarl.rollout.engine.attn_mask import model_attention_mask
from megarl.rollout.engine.protocol import InvalidRequest


@dataclass(eq=False)
class PromptImages:
    """One prompt's images as the model takes them (shared by the n samples of the prompt)."""

    pixel_values: torch.Tensor  # [patches, 3 * 2 * 14 * 14], as the image processor made them (CPU)
    image_grid_thw: torch.Tensor  # [images, 3], in prompt order
    positions: torch.Tensor  # [3, expanded prompt]: the prompt's 3-D rotary positions
    pad_index: torch.Tensor  # where in the expanded prompt the image features go
    rope_delta: int  # how far text after the prompt runs ahead of its token index
    key: bytes  # digest of the pixels and grids: rows prefilled once need equal ids and equal keys


@dataclass
class PrefillImages:
    """The images of one prefill's rows, in row order then token order."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    image_mask: torch.Tensor  # [rows, width] bool: the columns the features replace


class VisionInputs:
    """The engine's image side: the model's VisionSpec and the checkpoint's image processor."""

    def __init__(self, spec: VisionSpec, processor):
        self.spec, self.processor = spec, processor

    @classmethod
    def of(cls, model, model_path: str) -> VisionInputs | None:
        """None for a text model."""
        spec = VisionSpec.of(model.config)
        return None if spec is None else cls(spec, load_image_processor(model_path, model.config))

    def prepare(
        self, input_ids: list[int], images: list, prompt: str = "input_ids", names: list[str] | None = None
    ) -> tuple[list[int], PromptImages | None]:
        """(expanded ids, PromptImages) of a prompt with one pad per image; InvalidRequest naming
        `prompt` (the prompt's field) or the image (`names[k]`, default images[k]) otherwise.
        Images: anything megarl.data.images.decode_image takes (encoded bytes, a path, PIL, array)."""
        pad = self.spec.image_token_id
        pads = input_ids.count(pad)
        if pads != len(images):
            raise InvalidRequest(
                f"{prompt} holds {pads} image pad(s) (<|image_pad|>, id {pad}) for {len(images)} image(s) "
                "in image_data: put exactly one pad per image, in image order (the engine expands it)"
            )
        if not images:
            return input_ids, None
        names = names or [f"images[{k}]" for k in range(len(images))]
        pixels, grids = [], []
        for image, name in zip(images, names):
            try:
                pixel_values, grid = process_images([decode_image(image, name)], self.processor)
            except DatasetError as exc:
                raise InvalidRequest(str(exc)) from None
            except ValueError as exc:  # e.g. an aspect ratio the processor refuses
                raise InvalidRequest(f"{name}: the image processor refused the image ({exc})") from None
            pixels.append(pixel_values)
            grids.append(grid)
        pixel_values, grid = torch.cat(pixels), torch.cat(grids)
        ids = expand_image_pads(input_ids, grid, pad, self.spec.spatial_merge_size)
        positions = mrope_position_ids(torch.tensor([ids]), grid, pad, self.spec.spatial_merge_size)[:, 0]
        digest = hashlib.sha256(pixel_values.contiguous().numpy().tobytes())
        digest.update(grid.numpy().tobytes())
        return ids, PromptImages(
            pixel_values=pixel_values,
            image_grid_thw=grid,
            positions=positions,
            pad_index=(torch.tensor(ids) == pad).nonzero()[:, 0],
            rope_delta=rope_delta(positions),
            key=digest.digest(),
        )


def image_keys(rows) -> list:
    """Each row's images' key (None: text), for keying the prefill's deduplication."""
    return [None if row.req.images is None else row.req.images.key for row in rows]


def prefill_inputs(rows, mask: torch.Tensor, device: torch.device):
    """(positions [3, rows, width], last [rows, 1], PrefillImages or None) of left-padded rows
    whose tokens are `row.fed_ids()` (prompt, and after a retraction the output so far). `last`:
    the position of each row's last token as decoding continues from it (module doc)."""
    width = mask.shape[1]
    positions = torch.zeros(3, len(rows), width, dtype=torch.long)
    last = torch.empty(len(rows), 1, dtype=torch.long)
    image_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    pixels, grids = [], []
    for b, row in enumerate(rows):
        fed, images = len(row.req.input_ids) + len(row.output_ids), row.req.images
        start = width - fed
        if images is None:
            positions[:, b, start:] = torch.arange(fed)
            last[b] = fed - 1
            continue
        prompt = images.positions.shape[1]
        positions[:, b, start : start + prompt] = images.positions
        positions[:, b, start + prompt :] = torch.arange(prompt, fed) + images.rope_delta  # output: text
        last[b] = fed - 1 + images.rope_delta
        image_mask[b, start + images.pad_index] = True
        pixels.append(images.pixel_values)
        grids.append(images.image_grid_thw)
    images = None
    if pixels:
        images = PrefillImages(torch.cat(pixels), torch.cat(grids), image_mask.to(device))
    return positions.to(device), last.to(device), images


def vision_forward(model, ids, mask, positions, cache, keep_all: bool, images: PrefillImages):
    """A prefill of the HF vision-language model: token embeddings with the images' features at
    their pads (module doc says why not the model's own scatter), 3-D positions, the engine's mask."""
    embeds = model.get_input_embeddings()(ids)
    pixel_values = images.pixel_values.to(device=embeds.device, dtype=model.dtype)
    features = torch.cat(model.get_image_features(pixel_values, images.image_grid_thw.to(embeds.device)))
    if features.shape[0] != int(images.image_mask.sum()):
        raise RuntimeError(
            f"the images give {features.shape[0]} feature rows for {int(images.image_mask.sum())} image pads"
        )
    slots = images.image_mask[..., None].expand_as(embeds)
    embeds = embeds.masked_scatter(slots, features.to(embeds.dtype))
    return model(
        inputs_embeds=embeds,
        attention_mask=model_attention_mask(model.config, mask, ids.shape[1], model.dtype),
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=0 if keep_all else 1,
    )
