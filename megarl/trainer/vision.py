"""What a run with a vision-language model sets up: its datasets' image limits and placeholder,
and the rollout's PromptImages. None for a text model (whose datasets then refuse rows with images)."""

from __future__ import annotations

from megarl.data.images import ImageLimits
from megarl.models.vision import PromptImages, VisionSpec, load_image_processor


def _config(model_path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def image_limits(model_path: str, tokenizer) -> ImageLimits | None:
    """Sides of at least patch x merge pixels (the processor's smallest resize), and the text of
    the model's tokens for one image (vision start, one image pad, vision end)."""
    config = _config(model_path)
    spec = VisionSpec.of(config)
    if spec is None:
        return None
    processor = load_image_processor(model_path, config)
    placeholder = "".join(tokenizer.convert_ids_to_tokens(spec.placeholder_ids))
    return ImageLimits(min_side=processor.patch_size * processor.merge_size, placeholder=placeholder)


def prompt_images(model_path: str) -> PromptImages | None:
    return PromptImages(model_path) if VisionSpec.of(_config(model_path)) is not None else None
