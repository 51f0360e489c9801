"""Images for tests of vision-language models."""

from __future__ import annotations

import torch


def random_image(h: int, w: int, seed: int) -> torch.Tensor:
    """A uint8 [h, w, 3] image of random pixels, deterministic in `seed`."""
    return torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
