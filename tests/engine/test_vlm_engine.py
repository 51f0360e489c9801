"""A vision-language model through MegatronEngine: rows with images (the `multi_modal_inputs`
column) in packed and padded micro-batches, log-probs against Hugging Face, and a training step.

The tiny random Qwen2.5-VL checkpoint (models/tiny_vlm.py); rows: one image of 56 x 56 pixels
(4 image tokens), two images of other sizes in one prompt, text alone, and a second row with
an image of 56 x 56, so that micro-batches of two rows put images of two rows side by side (the
order the model fills their pads in). Tolerances: log-probs vs Hugging Face in float64, 1e-5
absolute, at TP=2 with sequence parallel (packed) and TP=2 without packing; a training step's
weights at TP=2 equal TP=1's to 1e-5 (fp32; Adam's first step moves a weight by lr = 1e-3, so a
vision gradient lost or doubled on one rank shows). Swapping two rows' images moves their
log-probs by more than 1e-3: the comparison sees the pixels. One response holds the image pad's
id, which stays text (the rollout engine's reading; Megatron's forward refused the row before).
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks
from tests._images import hf_response_log_probs
from tests._images import random_image as _image

# the first response holds the image pad's id (53), as a policy may write it: text, not an image slot
RESPONSES = [[20, 53, 22], [23, 24], [25, 26, 27, 28], [29, 30]]


@pytest.fixture(scope="module")
def path(tiny_vlm_path) -> str:
    return tiny_vlm_path


@pytest.fixture(scope="module")
def prompts(path) -> list[dict]:
    from transformers import AutoConfig

    from megarl.models.vision import encode_prompt

    c = AutoConfig.from_pretrained(path)
    image = [c.vision_start_token_id, c.image_token_id, c.vision_end_token_id]
    return [
        encode_prompt([5, 6, *image, 7, 8], [_image(56, 56, 0)], c),
        encode_prompt([10, *image, 11, *image, 13], [_image(56, 84, 1), _image(84, 56, 2)], c),
        encode_prompt([5, 6, 7, 8, 9, 10], [], c),
        encode_prompt([*image, 9, 10, 11], [_image(56, 56, 3)], c),
    ]


def make_rows(prompts, swap_images: bool = False):
    """The engine's row layout; `swap_images`: rows 0 and 3 get each other's image."""
    from megarl.data.batch import Batch
    from megarl.models.vision import MM_COLUMN

    pairs = [(p["input_ids"][0].tolist(), r) for p, r in zip(prompts, RESPONSES)]
    T, R = max(len(p) + len(r) for p, r in pairs), max(len(r) for _, r in pairs)
    ids, resp, mask = (
        torch.zeros(len(pairs), T, dtype=torch.long),
        torch.zeros(len(pairs), R, dtype=torch.long),
        torch.zeros(len(pairs), R),
    )
    for i, (p, r) in enumerate(pairs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        resp[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    images = [
        None
        if p["pixel_values"] is None
        else {"pixel_values": p["pixel_values"], "image_grid_thw": p["image_grid_thw"]}
        for p in prompts
    ]
    if swap_images:  # both 56 x 56: the pads stay where they are
        images[0], images[3] = images[3], images[0]
    batch = Batch(
        {
            "input_ids": ids,
            "responses": resp,
            "response_mask": mask,
            "prompt_lengths": torch.tensor([len(p) for p, _ in pairs]),
            "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1) * mask,
        }
    )
    batch[MM_COLUMN] = images
    return batch


def hf_reference(path, prompts) -> torch.Tensor:
    """[rows, R] float64 log-probs of each row's response tokens from Hugging Face's model, read
    as the rollout engine reads a response holding the pad id (tests/_images.py)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).double().eval()
    out = torch.zeros(len(prompts), max(map(len, RESPONSES)), dtype=torch.float64)
    for i, (p, r) in enumerate(zip(prompts, RESPONSES)):
        inputs = None if p["pixel_values"] is None else p
        out[i, : len(r)] = hf_response_log_probs(model, p["input_ids"][0].tolist(), r, inputs)
    return out


# ------------------------------------------------------------------ rank-side work
def _engine(path, tp: int, train: bool):
    from megarl.config.schema import OptimConfig, ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, MegatronEngine

    engine = MegatronEngine(
        EngineSpec(
            model_path=path,
            parallel=ParallelConfig(tp=tp, sequence_parallel=tp > 1),
            optim=OptimConfig(lr=1e-3, adam_eps=1e-2, clip_grad=0.0) if train else None,
            micro_batch_size=2,
            seed=1,
        )
    )
    engine.initialize()
    return engine


def _on_rank(rank, path, prompts, tp):
    from megarl.algo.losses import policy_loss

    engine = _engine(path, tp, train=True)
    rows = make_rows(prompts)
    out = {"packed": engine.compute_log_prob(rows)["log_probs"]}
    out["swapped"] = engine.compute_log_prob(make_rows(prompts, swap_images=True))["log_probs"]
    engine.spec.pack_sequences = False
    out["padded"] = engine.compute_log_prob(rows)["log_probs"]
    engine.spec.pack_sequences = True

    def loss_fn(logp, ent, mb):
        mask = mb["response_mask"]
        loss, _ = policy_loss(logp, logp.detach(), mb["advantages"], mask, global_denominator=1.0)
        return loss, mask.sum(), {}

    before = {k: v.clone() for k, v in engine.export_weights()}
    metrics = engine.train_mini_batch(rows, loss_fn)
    out["grad_norm"] = metrics["actor/grad_norm"]
    out["before"], out["after"] = before, {k: v.clone() for k, v in engine.export_weights()}
    return out


@pytest.fixture(scope="module")
def per_tp(path, prompts) -> dict:
    return {tp: run_ranks(_on_rank, tp, path, prompts, tp)[0] for tp in (1, 2)}


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_log_probs_with_images_equal_hugging_face_at_tp2(per_tp, path, prompts, layout):
    ref = hf_reference(path, prompts)
    mask = make_rows(prompts)["response_mask"].bool()
    got = per_tp[2][layout].double()
    assert (got - ref)[mask].abs().max().item() < 1e-5
    swapped = (per_tp[2]["swapped"].double() - ref)[[0, 3]]
    assert swapped[mask[[0, 3]]].abs().max().item() > 1e-3


def test_a_training_step_reaches_the_vision_tower_and_tp2_equals_tp1(per_tp):
    one, two = per_tp[1], per_tp[2]
    assert set(two["after"]) == set(two["before"])
    moved = [k for k in two["after"] if not torch.equal(two["after"][k], two["before"][k])]
    assert any(k.startswith("visual.blocks.0.") for k in moved), moved
    assert any(k.startswith("visual.merger.") for k in moved), moved
    for key, tensor in two["after"].items():
        torch.testing.assert_close(tensor, one["after"][key], atol=1e-5, rtol=0, msg=key)
    assert abs(one["grad_norm"] - two["grad_norm"]) < 1e-4 * one["grad_norm"]


def test_a_vision_model_refuses_what_it_cannot_run(path):
    from megarl.config.schema import ParallelConfig
    from megarl.engine.megatron.engine import EngineSpec, check_vision_layout
    from megarl.engine.megatron.lora import LoraSpec

    check_vision_layout(EngineSpec(model_path=path))
    for spec, words in [
        (EngineSpec(model_path=path, parallel=ParallelConfig(pp=2)), "pp=2"),
        (EngineSpec(model_path=path, parallel=ParallelConfig(cp=2)), "cp=2"),
        (EngineSpec(model_path=path, value_head=True), "critic"),
        (EngineSpec(model_path=path, lora=LoraSpec(rank=4, alpha=8, target_modules=("q_proj",))), "actor.lora"),
    ]:
        with pytest.raises(ValueError, match=words):
            check_vision_layout(spec)
