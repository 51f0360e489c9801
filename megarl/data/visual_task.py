"""`shapes`: a procedural visual task, generated in code, for vision-language RL.

Each row shows one 56 x 56 image: a dark, noisy background with one square (side 14 to 28
pixels) of one of four colours somewhere on it. The prompt is "<image>colour?" and the answer the
colour's letter: r (red), g (green), b (blue) or y (yellow). Scored under data_source
"megarl/shapes" (megarl.reward.rule): 1 when the response starts with the answer. The answer
depends only on the image (the text is the same in every row), so a rising reward proves the
policy reads the pixels; answering one fixed letter scores 0.25 on average.
"""

from __future__ import annotations

import numpy as np

from megarl.data.images import IMAGE_MARKER, encode_png

SHAPES_DATA_SOURCE = "megarl/shapes"
COLOURS = {"r": (220, 40, 40), "g": (40, 200, 60), "b": (50, 80, 230), "y": (230, 210, 40)}
SIDE = 56  # 4 x 4 patches of 14: 4 image tokens after Qwen2.5-VL's 2 x 2 merge


def shapes_image(colour: str, rng: np.random.Generator, side: int = SIDE) -> np.ndarray:
    """A uint8 [side, side, 3] image: noise on dark grey, one square of `colour`."""
    pixels = rng.integers(0, 48, size=(side, side, 3), dtype=np.uint8)
    size = int(rng.integers(side // 4, side // 2 + 1))
    top, left = (int(v) for v in rng.integers(0, side - size + 1, size=2))
    pixels[top : top + size, left : left + size] = COLOURS[colour]
    return pixels


def make_shapes_rows(num: int, seed: int = 0) -> list[dict]:
    """`num` rows of the shapes task, deterministic in `seed`; each image stored as PNG bytes."""
    if num < 0:
        raise ValueError(f"make_shapes_rows needs num >= 0, got {num}")
    rng = np.random.default_rng(seed)
    letters = sorted(COLOURS)
    rows = []
    for index in range(num):
        colour = letters[int(rng.integers(len(letters)))]
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"{IMAGE_MARKER}colour?"}],
                "images": [encode_png(shapes_image(colour, rng))],
                "data_source": SHAPES_DATA_SOURCE,
                "reward_model": {"ground_truth": colour, "style": "rule"},
                "extra_info": {"index": index, "colour": colour},
            }
        )
    return rows
