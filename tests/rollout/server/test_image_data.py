"""SGLang's `image_data` on the embedded server's /generate (server/image_data.py), with a tiny
Qwen2.5-VL behind it: each image's one pad in input_ids is expanded by the engine, and the answer
is the engine's own for the same prompt and images, whichever way the image travels (base64, a
data: URL, a file path), in a batch, or as one of n samples. Refusals name the prompt and the
image; a text model refuses image_data naming the field and its missing vision tower."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from megarl.rollout.engine.protocol import GenerationRequest, SamplingParams

torch.set_num_threads(1)
START, PAD, END = 51, 53, 52  # tiny_vlm.TOKEN_IDS
IMAGE = [START, PAD, END]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def _pixels(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


PIXELS = [_pixels(56, 84, 1), _pixels(84, 56, 2), _pixels(56, 56, 3)]
B64 = [base64.b64encode(_png(p)).decode() for p in PIXELS]
ONE = [2, 5, 6, *IMAGE, 7, 8]
TWO = [2, 10, *IMAGE, 11, *IMAGE, 12]
TEXT = [2, 30, 31, 32, 3]


@pytest.fixture(scope="module")
def vlm_engine(tiny_vlm_path):
    from megarl.rollout.engine.generation import GenerationEngine

    engine = GenerationEngine(tiny_vlm_path, max_batch_size=8, seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def vlm_client(vlm_engine):
    from fastapi.testclient import TestClient

    from megarl.rollout.server.app import create_app

    return TestClient(create_app(vlm_engine))


def generate(client, status=200, **body):
    response = client.post("/generate", json=body)
    assert response.status_code == status, response.text
    return response.json()


def engine_answer(engine, prompt, pixels: list) -> list[int]:
    """The engine's greedy answer to the prompt and images, without the server."""
    ids, images = engine.attach_images(prompt, pixels)
    params = SamplingParams(max_new_tokens=GREEDY["max_new_tokens"], temperature=0.0, ignore_eos=True)
    return engine.submit([GenerationRequest("ref", ids, params, images=images)])[0].result(timeout=60).output_ids


# ---- one image, three ways ---------------------------------------------------------------------
def test_base64_a_data_url_and_a_file_path_give_the_engines_answer(vlm_client, vlm_engine, tmp_path):
    path = tmp_path / "image.png"
    path.write_bytes(_png(PIXELS[0]))
    expected = engine_answer(vlm_engine, ONE, [PIXELS[0]])
    for form in (B64[0], f"data:image/png;base64,{B64[0]}", str(path), [B64[0]]):
        out = generate(vlm_client, input_ids=ONE, image_data=form, sampling_params=GREEDY, return_logprob=True)
        assert out["output_ids"] == expected
        # prompt_tokens and the input log-probs count the expanded prompt (6 pads for 56 x 84 px)
        assert out["meta_info"]["prompt_tokens"] == len(ONE) - 1 + 6


def test_input_logprobs_and_prompt_token_ids_are_those_of_the_expanded_prompt(vlm_client):
    out = generate(
        vlm_client,
        input_ids=ONE,
        image_data=B64[0],
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=0,
        return_prompt_token_ids=True,
    )
    expanded = ONE[:4] + [PAD] * 6 + ONE[5:]
    assert out["prompt_token_ids"] == expanded
    assert [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] == expanded


def test_text_prompts_with_images_are_expanded_too(vlm_client, vlm_engine):
    text = vlm_engine.decode(ONE, skip_special_tokens=False)
    out = generate(vlm_client, text=text, image_data=[B64[0]], sampling_params=GREEDY)
    assert out["output_ids"] == engine_answer(vlm_engine, ONE, [PIXELS[0]])


# ---- batches and n ----------------------------------------------------------------------------
def test_a_batch_with_per_prompt_image_lists_answers_as_each_alone(vlm_client, vlm_engine):
    out = generate(
        vlm_client,
        input_ids=[ONE, TWO, TEXT, ONE],
        image_data=[[B64[0]], [B64[1], B64[2]], [], B64[2]],  # a bare entry: that prompt's one image
        sampling_params=GREEDY,
    )
    expected = [
        engine_answer(vlm_engine, ONE, [PIXELS[0]]),
        engine_answer(vlm_engine, TWO, PIXELS[1:]),
        engine_answer(vlm_engine, TEXT, []),
        engine_answer(vlm_engine, ONE, [PIXELS[2]]),
    ]
    assert [o["output_ids"] for o in out] == expected
    assert expected[0] != expected[3]  # the same text, other images
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(ONE) + 5, len(TWO) + 5 + 3, len(TEXT), len(ONE) + 3]


def test_n_samples_share_their_prompts_images(vlm_client, vlm_engine):
    greedy = generate(
        vlm_client, input_ids=[ONE, TWO], image_data=[[B64[0]], B64[1:]], sampling_params={**GREEDY, "n": 2}
    )
    assert [o["output_ids"] for o in greedy] == [engine_answer(vlm_engine, ONE, [PIXELS[0]])] * 2 + [
        engine_answer(vlm_engine, TWO, PIXELS[1:])
    ] * 2
    sampled = generate(
        vlm_client, input_ids=ONE, image_data=B64[0], sampling_params={"max_new_tokens": 6, "n": 3, "temperature": 1.0}
    )
    assert len(sampled) == 3 and all(o["meta_info"]["prompt_tokens"] == len(ONE) + 5 for o in sampled)


# ---- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, needles",
    [
        ({"input_ids": TWO, "image_data": [B64[0], "not base64!"]}, ["image_data[1] (prompt 0, image 1)", "base64"]),
        (
            {"input_ids": [ONE, TWO], "image_data": [[B64[0]], [B64[1], base64.b64encode(b"no image").decode()]]},
            ["image_data[1][1] (prompt 1, image 1)", "does not decode"],
        ),
        ({"input_ids": [ONE, TWO], "image_data": [[B64[0]], [B64[1]]]}, ["input_ids[1] (prompt 1)", "2 image pad"]),
        ({"input_ids": ONE, "image_data": [B64[0], B64[1]]}, ["input_ids holds 1 image pad(s)", "2 image(s)"]),
        ({"input_ids": ONE}, ["input_ids holds 1 image pad(s)", "0 image(s)"]),
        ({"input_ids": [ONE, TWO], "image_data": [[B64[0]]]}, ["image_data has 1 entries for 2 prompts"]),
        ({"input_ids": ONE, "image_data": "https://example.com/a.png"}, ["image_data[0]", "does not fetch URLs"]),
        ({"input_ids": ONE, "image_data": "data:image/png,abc"}, ["image_data[0]", "data URL"]),
        ({"input_ids": ONE, "image_data": [7]}, ["image_data[0]", "got int"]),
        ({"input_ids": ONE, "image_data": B64[0], "modalities": ["video"]}, ["modalities", "'video'"]),
    ],
)
def test_bad_images_are_refused_naming_the_prompt_and_the_image(vlm_client, body, needles):
    message = generate(vlm_client, 400, sampling_params=GREEDY, **body)["error"]["message"]
    for needle in needles:
        assert needle in message, message


def test_a_text_model_refuses_image_data_for_want_of_a_vision_tower(client):
    message = generate(client, 400, input_ids=[2, 10, 3], image_data=B64[0])["error"]["message"]
    assert "image_data=" in message and "no vision tower" in message
