"""The embedded rollout server in-process (FastAPI TestClient): SGLang shapes, log-probs against an
independent Hugging Face forward, stopping rules, batching, weights, memory, aborts, bad input."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megarl.models.tiny import build_tiny_checkpoint
from megarl.rollout.engine.generation import GenerationEngine
from megarl.rollout.engine.protocol import sample_next_tokens
from megarl.rollout.server.app import create_app
from megarl.wire.weights_codec import serialize_flattened_bucket, serialize_named_tensors

torch.set_num_threads(1)
LOGPROB_TOL = 1e-4  # fp32, padded + KV-cached batch vs one unpadded forward
PROMPTS = [[2, 10, 11, 12, 13, 3], [2, 20, 21, 3], [2, 30, 31, 32, 33, 34, 35, 36, 3]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def served(checkpoint):
    from fastapi.testclient import TestClient

    engine = GenerationEngine(str(checkpoint), max_batch_size=16, seed=0)
    yield engine, TestClient(create_app(engine))
    engine.close()


@pytest.fixture()
def fresh(checkpoint):
    """A private engine for tests that change weights, memory or pause state."""
    from fastapi.testclient import TestClient

    engine = GenerationEngine(str(checkpoint), max_batch_size=16, seed=0)
    yield engine, TestClient(create_app(engine))
    engine.close()


def reference_logprobs(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    scaled = logits / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def generate(client, status=200, **body):
    response = client.post("/generate", json=body)
    assert response.status_code == status, response.text
    return response.json()


def logprobs_of(item):
    triples = item["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in triples] == item["output_ids"]
    return torch.tensor([lp for lp, _, _ in triples])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batch_with_n_samples_returns_prompt_major_logprobs_equal_to_hf_forward(served, reference, temperature):
    _, client = served
    # different max_new_tokens per prompt make rows leave the running batch at different steps
    params = [{"n": 3, "temperature": temperature, "max_new_tokens": m, "ignore_eos": True} for m in (3, 9, 16)]
    out = generate(client, input_ids=PROMPTS, sampling_params=params, return_logprob=True)
    assert len(out) == len(PROMPTS) * 3
    for k, item in enumerate(out):
        prompt, max_new = PROMPTS[k // 3], params[k // 3]["max_new_tokens"]  # prompt-major order
        meta = item["meta_info"]
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == max_new
        assert meta["finish_reason"] == {"type": "length", "length": max_new}
        assert meta["cached_tokens"] == 0 and meta["weight_version"] == "default"
        expected = reference_logprobs(reference, prompt, item["output_ids"], temperature)
        torch.testing.assert_close(logprobs_of(item), expected, atol=LOGPROB_TOL, rtol=0)
    samples_of_last_prompt = {tuple(item["output_ids"]) for item in out[6:]}
    assert len(samples_of_last_prompt) > 1, "n=3 samples of 16 tokens at T>0 should not all coincide"


def test_top_k_and_top_p_restrict_the_samples_while_logprobs_stay_full_vocab(served, reference):
    _, client = served
    for params, allowed in [
        ({"top_k": 3}, lambda rank, mass_before: rank < 3),
        ({"top_p": 0.3}, lambda rank, mass_before: mass_before < 0.3),
    ]:
        out = generate(
            client,
            input_ids=PROMPTS[1],
            return_logprob=True,
            sampling_params={"n": 4, "max_new_tokens": 10, "ignore_eos": True, **params},
        )
        for item in out:
            ids = item["output_ids"]
            with torch.no_grad():
                logits = reference(torch.tensor([PROMPTS[1] + ids])).logits[0, len(PROMPTS[1]) - 1 : -1]
            probs = torch.softmax(logits, -1)
            for step, token in enumerate(ids):
                order = probs[step].argsort(descending=True).tolist()
                rank = order.index(token)
                assert allowed(rank, probs[step, order[:rank]].sum().item()), (params, step, rank)
            expected = reference_logprobs(reference, PROMPTS[1], ids, 1.0)  # not renormalised
            torch.testing.assert_close(logprobs_of(item), expected, atol=LOGPROB_TOL, rtol=0)


def test_sampler_draws_from_the_renormalised_kept_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draws = 4000
    logits = probs.log().expand(draws, 4).contiguous()
    generator = torch.Generator().manual_seed(0)
    cases = [
        (-1, 1.0, probs),
        (2, 1.0, torch.tensor([0.625, 0.375, 0, 0])),
        (-1, 0.7, torch.tensor([0.625, 0.375, 0, 0])),
        (0, 0.45, torch.tensor([1.0, 0, 0, 0])),
    ]
    for top_k, top_p, expected in cases:
        tokens, logprobs = sample_next_tokens(
            logits, [1.0] * draws, [top_p] * draws, [top_k] * draws, [generator] * draws
        )
        frequency = torch.bincount(tokens, minlength=4).float() / draws
        torch.testing.assert_close(frequency, expected, atol=0.03, rtol=0)  # ~4 standard errors
        torch.testing.assert_close(logprobs, probs.log()[tokens])
    seeded = [torch.Generator().manual_seed(7) for _ in range(2)]
    a, _ = sample_next_tokens(logits[:1], [1.0], [1.0], [-1], seeded[:1])
    b, _ = sample_next_tokens(logits[:2], [1.0, 0.0], [1.0, 1.0], [-1, -1], [seeded[1], generator])
    assert a[0] == b[0] and b[1] == 0  # a seeded row does not depend on its batch; T=0 is argmax


def test_sampling_noise_is_one_draw_per_row_from_its_generator():
    """Rows sharing a generator are drawn in one call (protocol._exponential_noise): the bits and
    the generators' states afterwards must equal one draw per row, in row order."""
    from megarl.rollout.engine.protocol import _exponential_noise

    for vocab in (1, 7, 64, 257):
        shared, seeded = torch.Generator().manual_seed(vocab), torch.Generator().manual_seed(99)
        layout = [shared] * 5 + [seeded] + [shared] * 3 + [seeded] * 2 + [shared]
        copies = {id(g): torch.Generator().set_state(g.get_state()) for g in (shared, seeded)}
        expected = torch.stack([torch.empty(vocab).exponential_(generator=copies[id(g)]) for g in layout])
        assert torch.equal(_exponential_noise(len(layout), vocab, layout), expected)
        assert all(torch.equal(g.get_state(), copies[id(g)].get_state()) for g in (shared, seeded))


def test_single_prompt_with_n_answers_a_list_and_text_input_works(served, checkpoint):
    _, client = served
    out = generate(client, text="12+3=", sampling_params={"n": 2, "max_new_tokens": 4, "ignore_eos": True})
    assert isinstance(out, list) and len(out) == 2
    one = generate(client, text="12+3=", sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    assert isinstance(one, dict) and one["meta_info"]["prompt_tokens"] == len("12+3=")


def test_greedy_is_deterministic_and_follows_the_argmax(served, reference):
    _, client = served
    body = dict(
        input_ids=PROMPTS[0],
        return_logprob=True,
        sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
    )
    first, second = generate(client, **body), generate(client, **body)
    assert first["output_ids"] == second["output_ids"]
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPTS[0] + first["output_ids"]])).logits[0]
    argmax = logits[len(PROMPTS[0]) - 1 : -1].argmax(-1).tolist()
    assert first["output_ids"] == argmax
    expected = reference_logprobs(reference, PROMPTS[0], first["output_ids"], temperature=0)
    torch.testing.assert_close(logprobs_of(first), expected, atol=LOGPROB_TOL, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_prompt_logprobs_from_logprob_start_len_with_zero_new_tokens(served, reference, temperature):
    _, client = served
    out = generate(
        client,
        input_ids=PROMPTS[2],
        return_logprob=True,
        logprob_start_len=2,
        sampling_params={"max_new_tokens": 0, "temperature": temperature},
    )
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    triples = meta["input_token_logprobs"]
    assert [t for _, t, _ in triples] == PROMPTS[2][2:]
    expected = reference_logprobs(reference, PROMPTS[2][:2], PROMPTS[2][2:], temperature)
    torch.testing.assert_close(torch.tensor([lp for lp, _, _ in triples]), expected, atol=LOGPROB_TOL, rtol=0)
    first = generate(
        client, input_ids=PROMPTS[2], return_logprob=True, logprob_start_len=0, sampling_params={"max_new_tokens": 0}
    )["meta_info"]["input_token_logprobs"][0]
    assert first == [None, PROMPTS[2][0], None]  # nothing predicts the first prompt token


def test_max_new_tokens_stop_token_ids_and_stop_strings(served):
    _, client = served
    greedy = {"temperature": 0, "ignore_eos": True}
    full = generate(client, input_ids=PROMPTS[1], sampling_params={**greedy, "max_new_tokens": 20})["output_ids"]
    short = generate(client, input_ids=PROMPTS[1], sampling_params={**greedy, "max_new_tokens": 4})
    assert short["output_ids"] == full[:4]
    assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    before_eos = full.index(1) if 1 in full else len(full)  # eos would stop first without ignore_eos
    stop_at = next(k for k in range(1, before_eos) if full[k] not in full[:k])
    out = generate(
        client,
        input_ids=PROMPTS[1],
        sampling_params={"temperature": 0, "max_new_tokens": 20, "stop_token_ids": [full[stop_at]]},
    )
    assert out["output_ids"] == full[: stop_at + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": full[stop_at]}
    # as in SGLang, ignore_eos switches every token-based stop off
    ignored = generate(
        client,
        input_ids=PROMPTS[1],
        sampling_params={**greedy, "max_new_tokens": 20, "stop_token_ids": [full[stop_at]]},
    )
    assert ignored["output_ids"] == full
    text = generate(client, input_ids=PROMPTS[1], sampling_params={**greedy, "max_new_tokens": 20})["text"]
    stop_str = next(ch for ch in text[1:] if ch.strip())
    cut = generate(client, input_ids=PROMPTS[1], sampling_params={**greedy, "max_new_tokens": 20, "stop": stop_str})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
    assert cut["text"] == text[: text.index(stop_str)]


def test_eos_stops_unless_ignore_eos(fresh):
    engine, client = fresh
    # Zero every residual-branch output and make all embeddings equal: the final hidden state is
    # then the same for every position, and an lm_head that only scores <eos> (id 1) always picks it.
    state = engine.model.state_dict()
    named = [(n, torch.zeros_like(t)) for n, t in state.items() if n.endswith(("o_proj.weight", "down_proj.weight"))]
    lm_head = torch.zeros_like(state["lm_head.weight"])
    lm_head[1] = 1.0
    named += [
        ("model.embed_tokens.weight", torch.ones_like(state["model.embed_tokens.weight"])),
        ("lm_head.weight", lm_head),
    ]
    engine.update_weights(named)
    out = generate(client, input_ids=PROMPTS[0], sampling_params={"temperature": 0, "max_new_tokens": 5})
    assert out["output_ids"] == [1] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 1}
    out = generate(
        client, input_ids=PROMPTS[0], sampling_params={"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    )
    assert out["output_ids"] == [1] * 5 and out["meta_info"]["finish_reason"]["type"] == "length"


def test_concurrent_requests_share_a_batch(fresh):
    engine, client = fresh
    client.post("/pause_generation", json={"mode": "in_place"})
    results, batches_before = [None] * 6, engine.stats["batches"]

    def call(i):
        results[i] = generate(client, input_ids=PROMPTS[i % 3], sampling_params={"max_new_tokens": 5})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    _wait_for(lambda: engine.pending() == 6)
    client.post("/continue_generation")
    for t in threads:
        t.join(timeout=30)
    assert all(r is not None for r in results)
    assert engine.stats["batches"] - batches_before == 1 and engine.stats["max_rows"] == 6


def test_weight_update_errors_name_the_tensor_and_write_nothing(fresh, reference):
    engine, client = fresh
    before = engine.model.lm_head.weight.detach().clone()
    for named, needle in [
        ([("lm_head.weight", before + 1), ("no.such.weight", before)], "no.such.weight"),
        ([("lm_head.weight", before[:3])], "lm_head.weight"),
    ]:
        response = client.post(
            "/update_weights_from_tensor", json={"serialized_named_tensors": [serialize_named_tensors(named)]}
        )
        assert response.status_code == 400 and needle in response.json()["message"]
    assert torch.equal(engine.model.lm_head.weight, before)


def test_flattened_bucket_update_changes_outputs_to_the_new_weights(fresh, reference):
    engine, client = fresh
    new = {n: t + 0.05 * torch.randn_like(t) for n, t in reference.state_dict().items() if "layers.1" in n}
    response = client.post(
        "/update_weights_from_tensor",
        json={
            "serialized_named_tensors": [serialize_flattened_bucket(list(new.items()))],
            "load_format": "flattened_bucket",
            "weight_version": "v7",
        },
    )
    assert response.status_code == 200 and response.json()["success"], response.text
    for name, tensor in new.items():
        assert torch.equal(engine.model.state_dict()[name], tensor)
    out = generate(client, input_ids=PROMPTS[2], return_logprob=True, sampling_params={"max_new_tokens": 6})
    assert out["meta_info"]["weight_version"] == "v7"


def test_release_refuses_generation_until_resume_and_refill(fresh, checkpoint):
    engine, client = fresh
    body = dict(input_ids=PROMPTS[0], sampling_params={"temperature": 0, "max_new_tokens": 6, "ignore_eos": True})
    expected = generate(client, **body)["output_ids"]
    assert client.post("/release_memory_occupation", json={"tags": ["weights"]}).json()["success"]
    assert engine.model.lm_head.weight.numel() == 0  # memory really dropped
    assert "resume_memory_occupation" in generate(client, status=503, **body)["error"]["message"]
    assert client.get("/health_generate").status_code == 503
    assert client.post("/resume_memory_occupation", json={"tags": ["weights"]}).json()["success"]
    assert "not refilled" in generate(client, status=503, **body)["error"]["message"]
    client.post("/release_memory_occupation", json={"tags": ["weights"]})
    response = client.post("/update_weights_from_disk", json={"model_path": str(checkpoint)})
    assert response.status_code == 400 and "resume_memory_occupation" in response.json()["message"]
    client.post("/resume_memory_occupation", json={"tags": ["weights"]})
    response = client.post("/update_weights_from_disk", json={"model_path": str(checkpoint)})
    assert response.status_code == 200, response.text
    assert generate(client, **body)["output_ids"] == expected
    assert client.get("/health_generate").status_code == 200


def test_abort_queued_and_running_requests(fresh):
    engine, client = fresh
    results = {}

    def call(rid, max_new):
        results[rid] = generate(
            client, rid=rid, input_ids=PROMPTS[0], sampling_params={"max_new_tokens": max_new, "ignore_eos": True}
        )

    running = threading.Thread(target=call, args=("long", 240))
    running.start()
    _wait_for(lambda: engine.stats["forward_steps"] > 2)
    client.post("/pause_generation", json={"mode": "in_place"})
    queued = threading.Thread(target=call, args=("queued", 5))
    queued.start()
    _wait_for(lambda: engine.pending() == 2)
    assert client.post("/abort_request", json={"rid": "queued"}).status_code == 200
    assert client.post("/abort_request", json={"rid": "long"}).status_code == 200
    for t in (running, queued):
        t.join(timeout=30)
    client.post("/continue_generation")
    assert results["queued"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert results["queued"]["output_ids"] == []
    assert results["long"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(results["long"]["output_ids"]) < 240
    again = threading.Thread(target=call, args=("again", 240))
    again.start()
    _wait_for(lambda: engine.stats["batches"] == 2 and engine.pending() == 1)
    assert client.post("/pause_generation", json={}).status_code == 200  # default mode: abort
    again.join(timeout=30)
    assert results["again"]["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "aborted by /pause_generation",
    }
    client.post("/continue_generation")
    assert generate(client, input_ids=[2, 5], sampling_params={"max_new_tokens": 2})["output_ids"]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input_ids": [1, 2, 64]}, "input_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 2}}, "top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 2.5}}, "frequency_penalty"),
        ({"input_ids": [1, 2], "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"input_ids": [[1, 2], [3]], "sampling_params": [{"n": 2}, {"n": 1}]}, "sampling_params.n"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 300}}, "context length"),
        ({"sampling_params": {}}, "input_ids"),
        ({"input_ids": [1, 2], "stream": "yes"}, "stream"),
        ({"input_ids": []}, "input_ids"),
    ],
)
def test_malformed_requests_get_400_naming_the_field_and_the_server_keeps_serving(served, body, field):
    _, client = served
    message = generate(client, status=400, **body)["error"]["message"]
    assert field in message
    assert generate(client, input_ids=[2, 5], sampling_params={"max_new_tokens": 2})["output_ids"]


def test_bad_json_and_control_endpoint_errors(served):
    engine, client = served
    response = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    response = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["!!notbase64"]})
    assert response.status_code == 400 and response.json()["success"] is False
    assert client.post("/release_memory_occupation", json={"tags": ["gpu"]}).status_code == 400
    assert client.get("/health").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["is_generation"] and info["model_path"] == engine.model_path and "weight_version" in info
    assert client.get("/get_server_info").json()["max_batch_size"] == 16
    assert client.post("/flush_cache").status_code == 200


def _wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        time.sleep(0.01)


def test_all_results_wakes_once_in_order_and_fails_at_the_first_failure():
    """server.all_results: the engine's futures settle on another thread, in any order."""
    import asyncio
    import concurrent.futures
    import threading

    from megarl.rollout.server.routes.generate import all_results

    async def run(settle):
        futures = [concurrent.futures.Future() for _ in range(4)]
        thread = threading.Thread(target=settle, args=(futures,))
        thread.start()
        try:
            return await asyncio.wait_for(all_results(futures), timeout=30)
        finally:
            thread.join()

    def backwards(futures):
        for k in reversed(range(len(futures))):
            futures[k].set_result(k * 10)

    assert asyncio.run(run(backwards)) == [0, 10, 20, 30]

    def one_fails(futures):  # the others never finish: the failure must not wait for them
        futures[2].set_exception(RuntimeError("row 2 failed"))

    with pytest.raises(RuntimeError, match="row 2 failed"):
        asyncio.run(run(one_fails))
    assert asyncio.run(all_results([])) == []


def test_decode_takes_the_backend_path_and_says_what_the_tokenizer_says(served):
    """The engine decodes through the `tokenizers` backend (transformers' own fast decode, less
    its per-call to_py_obj): the same text as tokenizer.decode for any ids, special ones too, with
    and without skipping them, and with the space clean-up on."""
    import random

    from transformers import PreTrainedTokenizerFast

    from megarl.rollout.engine.generation import plain_fast_backend

    engine, _ = served
    tok = engine.tokenizer
    assert engine._backend is not None and engine._backend is tok.backend_tokenizer
    rng = random.Random(0)
    vocab = len(tok)
    cases = [[], [0], list(tok.all_special_ids)] + [
        [rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(200)
    ]
    for clean_up in (engine._clean_up, not engine._clean_up):
        engine._clean_up = clean_up
        for ids in cases:
            for skip in (True, False):
                assert engine.decode(ids, skip_special_tokens=skip) == tok.decode(
                    ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean_up
                ), (ids, skip, clean_up)
    engine._clean_up = bool(tok.clean_up_tokenization_spaces)

    class OwnDecode(PreTrainedTokenizerFast):  # a tokenizer class with its own decode keeps it
        def decode(self, *args, **kwargs):
            return "own"

    assert plain_fast_backend(OwnDecode(tokenizer_object=tok.backend_tokenizer)) is None
