"""Qwen2.5-VL through mbridge with the local spec (engine/megatron/vlm.py): parity with Hugging Face.

A tiny random checkpoint (models/tiny_vlm.py: norm weights and biases random too), Megatron in
fp32 in fresh gloo processes: one rank (TP=1) and two (TP=2: each rank holds one of the vision
tower's two heads and half of every linear, the merger's included). Rows: one image of 140 x 112
pixels (a 10 x 8 patch grid: the windowed block sees two windows, one of them cut short), two
images of different sizes in one row, and text alone; the image rows are batched together,
right-padded.

Tolerances: log-probs vs Hugging Face's Qwen2_5_VLForConditionalGeneration in float64: 1e-5
absolute (observed 4.3e-7, TP=1 and TP=2 alike); HF -> Megatron -> HF weights: exact
(torch.equal), the vision tower's fused qkv included. The comparison can fail: 1e-2 on one bias
of the vision tower, or text positions for the image tokens (what mbridge's own forward gives a
checkpoint whose token ids are not Qwen's), move the image rows' log-probs by 4.7e-4 and 1.2e-3;
splitting the merger's first linear over TP=2 as if it were gated (gate / up halves) moved them
by 0.28 while the round trip stayed exact.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks
from tests._images import random_image as _image

PERTURBED = "vision_model.decoder.layers.0.self_attention.linear_qkv.bias"


@pytest.fixture(scope="module")
def path(tiny_vlm_path) -> str:
    return tiny_vlm_path


@pytest.fixture(scope="module")
def prompts(path) -> dict:
    """name -> encode_prompt's inputs ([1, s] input_ids, pixel_values, image_grid_thw)."""
    from transformers import AutoConfig

    from megarl.models.tiny_vlm import encode_prompt

    c = AutoConfig.from_pretrained(path)
    image = [c.vision_start_token_id, c.image_token_id, c.vision_end_token_id]
    return {
        "one_image": encode_prompt([5, 6, *image, 7, 8, 9], [_image(140, 112, 0)], c),
        "two_images": encode_prompt([10, *image, 11, 12, *image, 13], [_image(56, 84, 1), _image(84, 56, 2)], c),
        "text": encode_prompt([5, 6, 7, 8, 9, 10, 11, 12], [], c),
    }


def _labels(ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(ids[:, 1:], (0, 1))


def _image_batch(prompts) -> dict:
    """The image rows as one right-padded batch, their images in row order."""
    rows = [prompts["one_image"], prompts["two_images"]]
    width = max(r["input_ids"].shape[1] for r in rows)
    ids = torch.cat([torch.nn.functional.pad(r["input_ids"], (0, width - r["input_ids"].shape[1])) for r in rows])
    return dict(
        input_ids=ids,
        pixel_values=torch.cat([r["pixel_values"] for r in rows]),
        image_grid_thw=torch.cat([r["image_grid_thw"] for r in rows]),
    )


# ------------------------------------------------------------------ rank-side work
def _forward(path, prompts, tp=1):
    from megarl.engine.megatron import vlm
    from megarl.engine.megatron.weights import export_hf_weights

    bridge, chunks = vlm.build_vlm(path, torch.float32, tp=tp)
    model = chunks[0].eval()
    batch = _image_batch(prompts)
    text = prompts["text"]["input_ids"]
    with torch.no_grad():
        return (
            model,
            batch,
            {
                "images": vlm.vlm_log_probs(model, labels=_labels(batch["input_ids"]), **batch),
                "text": vlm.vlm_log_probs(model, text, _labels(text)),
                "weights": {k: v.clone() for k, v in export_hf_weights(bridge, chunks)},
            },
        )


def _one_rank(rank, path, prompts):
    from megarl.engine.megatron import vlm
    from megarl.engine.megatron.output_head import PolicyHead

    model, batch, out = _forward(path, prompts)
    with torch.no_grad():
        # positions as if every token were text: what mbridge's forward computes for these ids
        flat = torch.arange(batch["input_ids"].shape[1]).expand(3, *batch["input_ids"].shape)
        head = PolicyHead(temperature=1.0, with_entropy=False)
        output = model(
            batch["input_ids"],
            flat,
            None,
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
            output_processor=head.output_processor,
        )
        out["flat_positions"] = head(output, _labels(batch["input_ids"]))[0]
        dict(model.named_parameters())[PERTURBED].add_(1e-2)
        out["perturbed"] = vlm.vlm_log_probs(model, labels=_labels(batch["input_ids"]), **batch)
    return out


def _two_ranks(rank, path, prompts):
    return _forward(path, prompts, tp=2)[2]


@pytest.fixture(scope="module")
def per_layout(path, prompts) -> dict:
    """layout -> rank 0's results (TP=2: both ranks hold the whole log-probs and weights)."""
    two = run_ranks(_two_ranks, 2, path, prompts)
    for key in ("images", "text"):
        assert torch.equal(two[0][key], two[1][key])
    return {"tp1": run_ranks(_one_rank, 1, path, prompts)[0], "tp2": two[0]}


@pytest.fixture(scope="module")
def results(per_layout) -> dict:
    return per_layout["tp1"]


# ------------------------------------------------------------------ references
@pytest.fixture(scope="module")
def hf_model(path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(path).double().eval()


def _hf_log_probs(hf_model, prompt) -> torch.Tensor:
    """[s] float64 log p(next token) of one unpadded row (the last position: of token 0)."""
    pixels = prompt["pixel_values"]
    with torch.no_grad():
        logits = hf_model(
            input_ids=prompt["input_ids"],
            pixel_values=None if pixels is None else pixels.double(),
            image_grid_thw=prompt["image_grid_thw"],
        ).logits
    ids = prompt["input_ids"]
    return torch.log_softmax(logits[0], -1).gather(-1, _labels(ids)[0].unsqueeze(-1))[:, 0]


def _max_image_row_diff(got: torch.Tensor, hf_model, prompts) -> float:
    diffs = []
    for row, name in enumerate(["one_image", "two_images"]):
        ref = _hf_log_probs(hf_model, prompts[name])
        diffs.append((got[row, : len(ref)].double() - ref).abs().max().item())
    return max(diffs)


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_image_log_probs_equal_hugging_face(per_layout, hf_model, prompts, layout):
    assert _max_image_row_diff(per_layout[layout]["images"], hf_model, prompts) < 1e-5


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_text_log_probs_equal_hugging_face(per_layout, hf_model, prompts, layout):
    ref = _hf_log_probs(hf_model, prompts["text"])
    torch.testing.assert_close(per_layout[layout]["text"][0].double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_weight_round_trip_is_exact(per_layout, path, layout):
    from safetensors.torch import load_file

    original = load_file(f"{path}/model.safetensors")
    exported = per_layout[layout]["weights"]
    assert set(exported) == set(original)
    assert any(k.startswith("visual.blocks.") and k.endswith("attn.qkv.weight") for k in original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key


def test_the_comparison_catches_vision_and_position_errors(results, hf_model, prompts):
    assert _max_image_row_diff(results["perturbed"], hf_model, prompts) > 1e-4
    assert _max_image_row_diff(results["flat_positions"], hf_model, prompts) > 1e-4


def test_positions_equal_hugging_face_batched_and_packed(hf_model, prompts):
    from megarl.models.vision import mrope_position_ids

    cfg = hf_model.config
    merge = cfg.vision_config.spatial_merge_size
    batch = _image_batch(prompts)
    mask = (batch["input_ids"] != 0).long()  # the padding (no prompt token is <pad>)
    ref, _ = hf_model.model.get_rope_index(batch["input_ids"], batch["image_grid_thw"], None, None, mask)
    got = mrope_position_ids(batch["input_ids"], batch["image_grid_thw"], cfg.image_token_id, merge)
    real = mask.bool()
    assert torch.equal(got[:, real], ref[:, real])
    assert got[1:, 0].ne(got[0, 0]).any()  # the image tokens' rows and columns differ from time
    # the same rows packed into one stream: each sequence's positions from 0
    rows = [prompts["one_image"]["input_ids"], prompts["two_images"]["input_ids"], prompts["text"]["input_ids"]]
    lengths = torch.tensor([0] + [r.shape[1] for r in rows])
    packed = mrope_position_ids(
        torch.cat(rows, dim=1), batch["image_grid_thw"], cfg.image_token_id, merge, cu_seqlens=lengths.cumsum(0)
    )
    singles = [
        mrope_position_ids(r, g, cfg.image_token_id, merge)
        for r, g in zip(rows, [batch["image_grid_thw"][:1], batch["image_grid_thw"][1:], None])
    ]
    assert torch.equal(packed, torch.cat(singles, dim=2))


def test_prompt_and_positions_refuse_a_wrong_image_count(prompts, hf_model):
    from megarl.models.tiny_vlm import encode_prompt
    from megarl.models.vision import mrope_position_ids

    cfg = hf_model.config
    with pytest.raises(ValueError, match="image placeholder"):
        encode_prompt([5, cfg.image_token_id, 6], [], cfg)
    one = prompts["one_image"]
    with pytest.raises(ValueError, match="image_grid_thw lists 2 images"):
        mrope_position_ids(one["input_ids"], one["image_grid_thw"].repeat(2, 1), cfg.image_token_id, 2)
    with pytest.raises(ValueError, match="consecutive image tokens"):
        mrope_position_ids(one["input_ids"][:, :10], one["image_grid_thw"], cfg.image_token_id, 2)
