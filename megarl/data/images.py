"""Images in dataset rows: the canonical `images` field, decoded and checked when the dataset loads.

A row's `images` is a list, one entry per image its prompt shows, each in one of the forms a
dataset file carries (verl's and Hugging Face datasets' included): a dict {"bytes": ..., "path":
...} (either set), raw encoded bytes, a file path, a PIL image, or a uint8 array [H, W, 3]. An
entry that does not decode, or whose size the model cannot take, is refused naming the row and the
image (data.bad_images=error), or the row is dropped and counted (filter).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megarl.data.errors import DatasetError

IMAGE_MARKER = "<image>"  # where an image goes in a message's text (verl's convention)


@dataclass(frozen=True)
class ImageLimits:
    """What the model's image processor takes: each side at least `min_side` pixels (Qwen2.5-VL:
    patch 14 x merge 2 = 28), at most `max_pixels` pixels in all."""

    min_side: int = 1
    max_pixels: int = 4096 * 4096
    # the text of the model's tokens for one image (Qwen2.5-VL: "<|vision_start|><|image_pad|>
    # <|vision_end|>"), put in place of each IMAGE_MARKER when the prompt is tokenized
    placeholder: str | None = None


def decode_image(value, where: str):
    """The entry as an RGB PIL image; DatasetError naming `where` if it is not one."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim != 3 or value.shape[2] != 3:
            raise DatasetError(
                f"{where}: an image array must be uint8 [H, W, 3], got {value.dtype} {list(value.shape)}"
            )
        image = Image.fromarray(value)
    else:
        data = value
        if isinstance(value, dict):
            data = value.get("bytes") or value.get("path")
            if data is None:
                raise DatasetError(f"{where}: an image dict needs 'bytes' or 'path', got keys {sorted(value)}")
        try:
            if isinstance(data, (bytes, bytearray)):
                image = Image.open(io.BytesIO(data))
            elif isinstance(data, (str, Path)):
                if not Path(data).is_file():
                    raise DatasetError(f"{where}: image file {data} does not exist")
                image = Image.open(data)
            else:
                raise DatasetError(
                    f"{where}: an image is a dict with bytes or path, bytes, a path, a PIL image or a "
                    f"uint8 array; got {type(value).__name__}"
                )
            image.load()  # decodes now: a truncated file fails here, not in the rollout
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise DatasetError(f"{where}: the image does not decode ({exc})") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def check_images(row: dict, where: str, limits: ImageLimits, prompt_key: str = "prompt") -> list:
    """The row's images decoded (RGB PIL), each checked against `limits`, their number against the
    prompt's image markers; DatasetError naming the row and the image otherwise."""
    images = row.get("images")
    if images is None:
        images = []
    if not isinstance(images, (list, tuple, np.ndarray)):
        raise DatasetError(f"{where}: field 'images' is a {type(images).__name__}, expected a list")
    markers = sum(m["content"].count(IMAGE_MARKER) for m in row[prompt_key])
    if markers != len(images):
        raise DatasetError(
            f"{where}: the prompt has {markers} {IMAGE_MARKER} marker(s) but the row has {len(images)} image(s)"
        )
    decoded = []
    for k, value in enumerate(images):
        image = decode_image(value, f"{where}: images[{k}]")
        w, h = image.size
        if min(w, h) < limits.min_side or w * h > limits.max_pixels:
            raise DatasetError(
                f"{where}: images[{k}] is {w} x {h}; the model takes sides >= {limits.min_side} and at most "
                f"{limits.max_pixels} pixels: resize it or drop the row (data.bad_images=filter)"
            )
        decoded.append(image)
    return decoded


def encode_png(pixels: np.ndarray) -> dict:
    """A uint8 [H, W, 3] array as the canonical stored form: {"bytes": PNG, "path": None}."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def image_data_entry(image) -> str:
    """An image as one entry of SGLang's `image_data`: base64 of its PNG file (lossless, so the
    engine's pixels are the trainer's)."""
    import base64

    from PIL import Image

    buf = io.BytesIO()
    (image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image))).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")
