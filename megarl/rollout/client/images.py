"""Prompts with images on the trainer's side of rollout.

A vision-language model's prompt batch carries each prompt's decoded images (the `images`
column, data/dataset.py). They go to the engines as SGLang's `image_data` (base64 PNG, one entry
per image pad of the prompt), and the rows that come back get what the trainer's engines read:
input_ids with the image pads expanded and the images' processed inputs (models/vision.py
PromptImages; the MM_COLUMN column), the same computation the rollout engine made.
"""

from __future__ import annotations

from megarl.data.batch import Batch
from megarl.data.images import image_data_entry
from megarl.models.vision import PromptImages


def prompt_images(prompts: Batch) -> list[list] | None:
    """Each prompt's images, or None when the batch has none at all."""
    if "images" not in prompts:
        return None
    images = [list(x) if x is not None else [] for x in prompts["images"]]
    return images if any(images) else None


def image_data_of(images: list[list]) -> list[list[str] | None]:
    """SGLang's `image_data` of each prompt (None for a prompt without images)."""
    return [[image_data_entry(i) for i in imgs] or None for imgs in images]


def model_rows(prompt_ids: list[list[int]], images: list[list], vision: PromptImages | None):
    """(each prompt's expanded ids, each prompt's MM_COLUMN entry) for the trainer's rows."""
    if vision is None:
        raise ValueError(
            "the prompts have images but the rollout manager has no PromptImages (a text model?); "
            "use a vision-language model for rows with images"
        )
    pairs = [vision.model_inputs(ids, imgs) for ids, imgs in zip(prompt_ids, images)]
    return [p[0] for p in pairs], [p[1] for p in pairs]
