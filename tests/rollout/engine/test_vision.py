"""The embedded engine with a vision-language model (tiny Qwen2.5-VL, models/tiny_vlm.py; engine/vision.py).

References are Hugging Face's own: `generate` (greedy) on the same expanded inputs
(models.vision.encode_prompt with the checkpoint's image processor) token for token, and the
log-probs of its forward over prompt + output (fp32, 1e-4 absolute as asked of the engine;
observed 2.4e-7). The comparisons can fail: dropping the rope delta from decoding (rows then
decode as if their images were text) keeps this tiny model's greedy tokens but moves the output
log-probs by 8e-4 to 1.6e-3; text positions for the image pads in prefill, or an update that
ignores the checkpoint's names, fail them too.

Batches: rows that join a running batch, rows of the same text with other images (which must not
share a prefill: keyed by ids alone, two tests fail), text rows beside image rows, and a
retracted row answer what they answer alone. Weights: an update by the checkpoint's names (what
the trainer exports: `model.layers...`, `visual...`; transformers renames them at load) gives
the other checkpoint's answers.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from megarl.rollout.engine.generation import GenerationEngine
from megarl.rollout.engine.protocol import GenerationRequest, InvalidRequest, SamplingParams
from tests.rollout.engine.test_continuous_batching import at_token

torch.set_num_threads(1)
TOL = 1e-4
START, PAD, END = 51, 53, 52  # tiny_vlm.TOKEN_IDS
IMAGE = [START, PAD, END]


def _image(h: int, w: int, seed: int):
    return torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).numpy()


PROMPTS = {  # name -> (prompt ids with one pad per image, images)
    "one_image": ([2, 5, 6, *IMAGE, 7, 8, 9], [_image(56, 84, 1)]),
    "two_images": ([2, 10, *IMAGE, 11, 12, *IMAGE, 13], [_image(84, 56, 2), _image(140, 112, 3)]),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    from megarl.models.tiny_vlm import build_tiny_vlm_checkpoint

    root = tmp_path_factory.mktemp("vlm")
    return {seed: str(build_tiny_vlm_checkpoint(root / f"seed{seed}", seed=seed)) for seed in (0, 1)}


@pytest.fixture(scope="module")
def engine(paths):
    engine = GenerationEngine(paths[0], max_batch_size=4, seed=0)
    yield engine
    engine.close()


def _hf(path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def request(engine, rid, prompt, images, max_new=8, on_token=None, ignore_eos=True, **kwargs) -> GenerationRequest:
    ids, attached = engine.attach_images(prompt, images)
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=ignore_eos)
    return GenerationRequest(rid, ids, params, return_logprob=True, images=attached, on_token=on_token, **kwargs)


def run(engine, *requests):
    return [f.result(timeout=60) for f in engine.submit(list(requests))]


def hf_answer(model, path, prompt, images, max_new):
    """(expanded ids, greedy output ids of HF generate (stopping at EOS, as the engine without
    ignore_eos), HF forward's log-probs over prompt + output)."""
    from transformers import AutoConfig

    from megarl.models.vision import encode_prompt, load_image_processor

    config = AutoConfig.from_pretrained(path)
    inputs = encode_prompt(prompt, images, config, load_image_processor(path, config))
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False, pad_token_id=0)
        out = out[0, inputs["input_ids"].shape[1] :].tolist()
        full = torch.cat([inputs["input_ids"], torch.tensor([out])], dim=1)
        logits = model(full, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]).logits
    logprobs = torch.log_softmax(logits[0].float(), -1)[:-1].gather(-1, full[0, 1:, None])[:, 0]
    return inputs["input_ids"][0].tolist(), out, logprobs


def assert_same_answer(a, b) -> None:
    assert a.output_ids == b.output_ids
    torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=TOL, rtol=0)


# ---- against Hugging Face ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_generation_with_images_is_hf_generate_and_its_logprobs(engine, paths, name):
    prompt, images = PROMPTS[name]
    expanded, out, logprobs = hf_answer(_hf(paths[0]), paths[0], prompt, images, max_new=10)
    result = run(engine, request(engine, "a", prompt, images, 10, ignore_eos=False, logprob_start_len=0))[0]
    assert result.input_ids == expanded and result.prompt_tokens == len(expanded) > len(prompt)
    assert result.output_ids == out
    n = len(expanded)
    torch.testing.assert_close(torch.tensor(result.output_logprobs), logprobs[n - 1 :], atol=TOL, rtol=0)
    # input log-probs cover the expanded prompt (None for its first token)
    assert len(result.input_logprobs) == n and result.input_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(result.input_logprobs[1:]), logprobs[: n - 1], atol=TOL, rtol=0)


# ---- batches ----------------------------------------------------------------------------------------
def test_joined_rows_with_other_images_and_text_rows_answer_what_they_answer_alone(engine):
    """The same text with three different images of one size (the same expanded ids: a prefill
    deduplicated by ids alone would give all three the first image's answer), two samples of
    one of them (those share a prefill), a text row and a two-image row; some join the running
    batch of the first, some wait for room (max_batch_size=4)."""
    text = [2, 20, 21, *IMAGE, 22]
    images = [_image(56, 56, 10), _image(56, 56, 11), np.zeros((56, 56, 3), np.uint8)]
    specs = [(text, [image], 6 + 2 * k) for k, image in enumerate(images)]
    specs += [(text, images[:1], 7), ([2, 30, 31, 32, 33, 3], [], 9), (*PROMPTS["two_images"], 5)]
    alone = [run(engine, request(engine, f"alone{k}", p, i, m))[0] for k, (p, i, m) in enumerate(specs)]
    assert len({tuple(a.output_ids[:2]) for a in alone[:3]}) == 3  # the images matter
    futures = {}

    def submit(*indices):
        for k in indices:
            prompt, images, max_new = specs[k]
            futures[k] = engine.submit([request(engine, f"cb{k}", prompt, images, max_new)])[0]

    prefilled, joined = engine.stats["prefill_rows"], engine.stats["joined"]
    first = engine.submit([request(engine, "cb0", *specs[0], on_token=at_token(2, lambda: submit(1, 2, 3, 4, 5)))])[0]
    futures[0] = first
    first.result(timeout=60)
    together = {k: f.result(timeout=60) for k, f in futures.items()}
    assert engine.stats["joined"] - joined == 5
    assert engine.stats["prefill_rows"] - prefilled <= 6  # rows 0 and 3 may share theirs
    for k, answer in together.items():
        assert_same_answer(answer, alone[k])


def test_rows_of_the_same_prompt_and_images_share_a_prefill_others_do_not(engine):
    text = [2, 40, *IMAGE, 41]
    a, b = [_image(56, 56, 20)], [_image(56, 56, 21)]
    alone = [run(engine, request(engine, f"s{k}", text, i))[0] for k, i in enumerate((a, b))]
    running, gate = threading.Event(), threading.Event()
    engine.submit([request(engine, "gate", [2, 3], [], 1, on_token=lambda step: running.set() or gate.wait(30))])
    running.wait(timeout=30)
    before = engine.stats["prefill_rows"]
    futures = engine.submit([request(engine, f"d{k}", text, i) for k, i in enumerate((a, b, a))])
    gate.set()  # the three were queued while the gate ran: one prefill, two distinct rows
    together = [f.result(timeout=60) for f in futures]
    assert engine.stats["prefill_rows"] - before == 2
    for answer, reference in zip(together, (alone[0], alone[1], alone[0])):
        assert_same_answer(answer, reference)


def test_a_retracted_row_with_images_is_prefilled_again_and_answers_as_alone(engine):
    prompt, images = PROMPTS["two_images"]
    alone = run(engine, request(engine, "r", prompt, images, max_new=10))[0]
    retracted = engine.stats["retracted"]
    future = engine.submit(
        [request(engine, "r2", prompt, images, 10, on_token=at_token(4, lambda: engine.pause("retract")))]
    )[0]
    while engine.stats["retracted"] == retracted:
        threading.Event().wait(0.01)
    engine.resume_generation()
    answer = future.result(timeout=60)
    assert answer.num_retractions == 1
    assert_same_answer(answer, alone)


# ---- requests the engine refuses -------------------------------------------------------------------
def test_pads_and_images_that_do_not_pair_up_are_refused(engine):
    prompt, images = PROMPTS["two_images"]
    with pytest.raises(InvalidRequest, match=r"holds 2 image pad\(s\) .* for 1 image"):
        engine.attach_images(prompt, images[:1])
    with pytest.raises(InvalidRequest, match="holds image pads .* no images"):
        engine.validate(GenerationRequest("x", prompt, SamplingParams()))
    with pytest.raises(InvalidRequest, match=r"images\[0\]: the image does not decode"):
        engine.attach_images([2, *IMAGE], [b"not an image"])


def test_a_vision_language_model_is_refused_by_tensor_parallel_engines(paths):
    from transformers import AutoConfig

    from megarl.rollout.engine.runner.sharding import validate_tp

    with pytest.raises(ValueError, match="--tp 2: vision-language models .* tp=1"):
        validate_tp(AutoConfig.from_pretrained(paths[0]), 2)


# ---- weights by the checkpoint's names ---------------------------------------------------------------
def test_an_update_by_checkpoint_names_gives_the_other_checkpoints_answers(paths):
    from safetensors.torch import load_file

    prompt, images = PROMPTS["one_image"]
    engine = GenerationEngine(paths[0], max_batch_size=2, seed=0)
    try:
        layout = engine.runner.layout()["ranks"][0]["params"]
        assert {"model.layers.0.self_attn.q_proj.weight", "visual.blocks.0.attn.qkv.weight", "lm_head.weight"} <= set(
            layout
        )
        before = run(engine, request(engine, "a", prompt, images, ignore_eos=False))[0]
        named = sorted(load_file(f"{paths[1]}/model.safetensors").items())
        assert any(n.startswith("visual.") for n, _ in named) and any(n.startswith("model.layers.") for n, _ in named)
        engine.update_weights(named, weight_version="seed1")
        after = run(engine, request(engine, "b", prompt, images, ignore_eos=False))[0]
        _, out, logprobs = hf_answer(_hf(paths[1]), paths[1], prompt, images, max_new=8)
        assert after.output_ids == out != before.output_ids
        torch.testing.assert_close(
            torch.tensor(after.output_logprobs), logprobs[len(after.input_ids) - 1 :], atol=TOL, rtol=0
        )
        engine.update_weights_from_disk(paths[0], weight_version="seed0")  # the files' names too
        assert_same_answer(run(engine, request(engine, "c", prompt, images, ignore_eos=False))[0], before)
    finally:
        engine.close()


def test_a_lora_adapter_named_by_checkpoint_modules_merges_into_the_vlm(engine):
    name = "model.layers.0.self_attn.q_proj"
    param = engine.model.model.language_model.layers[0].self_attn.q_proj.weight
    base = param.detach().clone()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, base.shape[1], generator=g), torch.randn(base.shape[0], 2, generator=g)
    tensors = {f"base_model.model.{name}.lora_A.weight": a, f"base_model.model.{name}.lora_B.weight": b}
    engine.load_lora_adapter_from_tensors("x", {"r": 2, "lora_alpha": 4}, tensors)
    try:
        torch.testing.assert_close(param.detach(), base + 2 * b @ a)
    finally:
        engine.unload_lora_adapter("x")
    assert torch.equal(param.detach(), base)
