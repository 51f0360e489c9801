"""Images for tests of vision-language models."""

from __future__ import annotations

import torch


def random_image(h: int, w: int, seed: int) -> torch.Tensor:
    """A uint8 [h, w, 3] image of random pixels, deterministic in `seed`."""
    return torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def hf_response_log_probs(model, prompt: list[int], response: list[int], inputs: dict | None) -> torch.Tensor:
    """Log-probs [len(response)] of `response` after `prompt` (image pads expanded) from Hugging
    Face's Qwen2.5-VL `model`, in its dtype, reading it as megarl's engines do: the images'
    features go in at the prompt's pads only, and the rotary positions treat a response token equal
    to the pad id as text (models/vision.py's positions, checked against Hugging Face's in
    tests/engine/test_vlm.py). Hugging Face's own forward would take such a token for an image slot."""
    from megarl.models.vision import mrope_position_ids

    pad, merge = model.config.image_token_id, model.config.vision_config.spatial_merge_size
    ids = torch.tensor([prompt + response])
    marked = ids.clone()
    marked[0, len(prompt) :][marked[0, len(prompt) :] == pad] = -1
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        grid = None
        if inputs is not None:
            grid = inputs["image_grid_thw"]
            features = torch.cat(model.get_image_features(inputs["pixel_values"].to(embeds.dtype), grid))
            embeds[0, (marked[0] == pad).nonzero()[:, 0]] = features
        positions = mrope_position_ids(marked, grid, pad, merge)
        logits = model(inputs_embeds=embeds, position_ids=positions).logits[0]
    start = len(prompt) - 1
    scores = torch.log_softmax(logits, -1)[start : start + len(response)]
    return scores.gather(-1, torch.tensor(response)[:, None])[:, 0]
