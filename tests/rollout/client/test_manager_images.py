"""RolloutManager with a vision-language model, against a real embedded server process on the tiny
Qwen2.5-VL: prompts with images go out as SGLang's image_data (base64 PNG) and the rows that come
back hold what the trainer's engines read (expanded image pads, the images' model inputs).

The check that the server saw the trainer's pixels: every row's rollout log-probs equal Hugging
Face's log-probs of its response given the row's own image (fp32, 1e-4; a response holding the
image pad's id read as text, tests/_images.py), while the same response
given another row's image scores more than 1e-3 away. Batched, per-prompt and seeded requests
give the same row layout; a prompt without images rides in the same batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.data.batch import Batch
from megarl.models.vision import MM_COLUMN, PromptImages
from megarl.rollout.client.manager import RolloutManager, SamplingSpec
from megarl.rollout.fleet.server_process import RolloutServerProcess
from tests._images import hf_response_log_probs

torch.set_num_threads(1)
N, MAX_NEW = 2, 3


@pytest.fixture(scope="module")
def server(tiny_vlm_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("vlm-server") / "server.log"
    with RolloutServerProcess(tiny_vlm_path, port=0, max_batch_size=32, seed=0, torch_threads=1, log_path=log) as s:
        yield s


@pytest.fixture(scope="module")
def prompts(tiny_vlm_path) -> Batch:
    from transformers import AutoTokenizer

    from megarl.data.dataset import PromptBatches, RLDataset
    from megarl.data.visual_task import make_shapes_rows
    from megarl.trainer.vision import image_limits

    tok = AutoTokenizer.from_pretrained(tiny_vlm_path)
    rows = make_shapes_rows(3, seed=5)
    rows.append({**rows[0], "prompt": [{"role": "user", "content": "colour?"}], "images": []})  # text alone
    data = RLDataset(rows, tok, 32, images=image_limits(tiny_vlm_path, tok))
    return PromptBatches(data, 4, shuffle=False).batch_at(0)


@pytest.fixture(scope="module")
def hf_model(tiny_vlm_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vlm_path).eval()


def _hf_log_probs(model, ids: list[int], prompt_len: int, inputs: dict | None) -> torch.Tensor:
    return hf_response_log_probs(model, ids[:prompt_len], ids[prompt_len:], inputs).float()


@pytest.mark.parametrize("mode", ["batched", "per_prompt", "seeded"])
def test_rows_hold_the_expanded_prompt_and_the_servers_read_the_same_pixels(
    server, prompts, hf_model, tiny_vlm_path, mode
):
    manager = RolloutManager(
        [server.url], max_retries=1, batched=mode != "per_prompt", vision=PromptImages(tiny_vlm_path)
    )
    seed = (7,) if mode == "seeded" else None
    try:
        rows = manager.generate(prompts, SamplingSpec(n=N, max_new_tokens=MAX_NEW, seed=seed))
    finally:
        manager.close()
    vision = PromptImages(tiny_vlm_path)
    assert len(rows) == len(prompts) * N
    for r in range(len(rows)):
        p = r // N
        expanded, inputs = vision.model_inputs(list(prompts["raw_prompt_ids"][p]), prompts["images"][p])
        plen = int(rows["prompt_lengths"][r])
        assert rows["input_ids"][r, :plen].tolist() == expanded
        got = rows[MM_COLUMN][r]
        assert (got is None) == (inputs is None)
        if inputs is not None:
            assert len(expanded) > len(prompts["raw_prompt_ids"][p])  # 4 pads for the 56 x 56 image
            assert torch.equal(got["pixel_values"], inputs["pixel_values"])
        response = rows["responses"][r, : int(rows["response_mask"][r].sum())].tolist()
        ref = _hf_log_probs(hf_model, expanded + response, plen, inputs)
        torch.testing.assert_close(rows["rollout_log_probs"][r, : len(response)], ref, atol=1e-4, rtol=0)
        if inputs is not None:  # another prompt's image: the comparison sees the pixels
            other = rows[MM_COLUMN][(r + N) % (3 * N)]
            assert (_hf_log_probs(hf_model, expanded + response, plen, other) - ref).abs().max() > 1e-3


def test_images_without_a_vision_model_are_refused(server, prompts):
    manager = RolloutManager([server.url], max_retries=1)
    try:
        with pytest.raises(ValueError, match="no PromptImages"):
            manager.generate(prompts, SamplingSpec(n=1, max_new_tokens=1))
    finally:
        manager.close()
    assert np.asarray(prompts["images"][0][0]).shape == (56, 56, 3)
