"""The embedded server speaks SGLang fully: every GenerateReqInput / SamplingParams field is
accepted, honoured or refused with a reason; streaming, top / chosen-token log-probs, penalties,
stop regexes, load and version endpoints. (Weight payloads and the API key: test_rollout_security.py.)"""

from __future__ import annotations

import base64
import json
import math
import re
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from megarl.rollout.server.app import create_app
from megarl.rollout.server.sglang_fields import GENERATE_FIELDS, OFF_ONLY, SAMPLING_FIELDS, defaults
from tests._http import ThreadedServer

torch.set_num_threads(1)
TOL = 1e-4
PROMPT = [2, 10, 11, 12, 13, 3]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def generate(client, status=200, **body):
    response = client.post("/generate", json=body)
    assert response.status_code == status, response.text
    return response.json()


def ref_logprobs(model, ids, temperature=0.0):
    """(len(ids), vocab): row j is the log-prob distribution of the token after ids[:j+1]."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits / (temperature or 1.0), -1)


# ---- every field --------------------------------------------------------------------------------
def test_every_field_at_its_default_changes_nothing(client):
    """The table's defaults are SGLang's (test_sglang_contract_fields.py checks them against the
    release); here each must also be a no-op: a body with every field at its default gets the
    answer, log-probs included, of the bare request."""
    greedy = {"temperature": 0, "max_new_tokens": 4}
    bare = generate(client, input_ids=PROMPT, sampling_params=greedy, return_logprob=True)
    full = {
        **defaults(GENERATE_FIELDS),
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {**defaults(SAMPLING_FIELDS), **greedy},
    }
    out = generate(client, **full)
    assert out["output_ids"] == bare["output_ids"] and out["text"] == bare["text"]
    assert out["meta_info"]["output_token_logprobs"] == bare["meta_info"]["output_token_logprobs"]
    assert out["meta_info"]["finish_reason"] == bare["meta_info"]["finish_reason"]


def test_a_body_reserialised_by_sglang_router_is_answered_like_the_plain_one(client):
    plain = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}
    routed = {
        **plain,
        "model": None,
        "return_text_in_logprobs": False,
        "stream": False,
        "log_metrics": True,
        "return_hidden_states": False,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
    }
    a, b = generate(client, **plain), generate(client, **routed)
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
    assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


def test_hints_that_change_nothing_here_accept_any_value(client):
    plain = generate(client, input_ids=PROMPT, sampling_params=GREEDY)
    hinted = generate(
        client,
        input_ids=PROMPT,
        sampling_params={**GREEDY, "custom_params": {"a": 1}},
        priority=7,
        bootstrap_host="10.0.0.1",
        bootstrap_room=3,
        data_parallel_rank=0,
        log_metrics=False,
        no_logs=True,
        custom_labels={"team": "rl"},
        extra_key="k",
        routing_key="r",
        conversation_id="c",
        background=True,
    )
    assert hinted["output_ids"] == plain["output_ids"]


def _refused_value(field):
    if isinstance(field.default, bool):  # bool before int: False == 0 would collide as a dict key
        return not field.default
    if isinstance(field.default, list):  # e.g. sampling_params.choice
        return ["something"]
    return {0: 5, 1: 4}.get(field.default, "something") if field.default is not None else "something"


@pytest.mark.parametrize("name", sorted(n for n, f in GENERATE_FIELDS.items() if f.kind == OFF_ONLY))
def test_each_unsupported_generate_value_is_refused_naming_field_and_value(client, name):
    value = _refused_value(GENERATE_FIELDS[name])
    message = generate(client, 400, input_ids=PROMPT, **{name: value})["error"]["message"]
    assert f"{name}={value!r}" in message and "not supported" in message


@pytest.mark.parametrize("name", sorted(n for n, f in SAMPLING_FIELDS.items() if f.kind == OFF_ONLY))
def test_each_unsupported_sampling_value_is_refused_naming_field_and_value(client, name):
    value = _refused_value(SAMPLING_FIELDS[name])
    message = generate(client, 400, input_ids=PROMPT, sampling_params={name: value})["error"]["message"]
    assert f"sampling_params.{name}={value!r}" in message and "not supported" in message


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"top_logprob_num": 2}, "did you mean 'top_logprobs_num'"),
        ({"sampling_params": {"max_tokens": 3}}, "'max_tokens' is not a field of SGLang's sampling_params"),
        ({"sampling_params": {"min_p": 1.5}}, "sampling_params.min_p=1.5"),
        ({"sampling_params": {"repetition_penalty": 0}}, "sampling_params.repetition_penalty=0"),
        ({"sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "min_new_tokens=9"),
        ({"sampling_params": {"stop_regex": "(unclosed"}}, "stop_regex='(unclosed'"),
        ({"sampling_params": {"logit_bias": {"99": 1.0}}}, "logit_bias names token ids [99]"),
        ({"token_ids_logprob": [3, 700]}, "token_ids_logprob names token ids [700]"),
        ({"return_flat_raw_top_logprobs_b64": True}, "return_flat_raw_top_logprobs_b64"),
        ({"input_ids": [[2, 3], [2, 4]], "rid": ["a", "a"]}, "rid has duplicates ['a']"),
    ],
)
def test_invalid_values_of_honoured_fields_get_400(client, body, needle):
    body = {"input_ids": PROMPT, **body}
    assert needle in generate(client, 400, **body)["error"]["message"]


# ---- streaming ------------------------------------------------------------------------------------
def events(response) -> list:
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == "" and all(b.startswith("data: ") for b in blocks[:-1])
    assert blocks[-2] == "data: [DONE]", "the stream must end with [DONE]"
    return [json.loads(b[len("data: ") :]) for b in blocks[:-2]]


def test_stream_sends_cumulative_chunks_ending_in_the_non_streamed_answer(client):
    body = dict(
        input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 10}, return_logprob=True, top_logprobs_num=2
    )
    full = generate(client, **body)
    chunks = events(client.post("/generate", json={**body, "stream": True}))
    final = chunks[-1]
    assert final["output_ids"] == full["output_ids"] and final["text"] == full["text"]
    assert final["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    for key in ("output_token_logprobs", "output_top_logprobs"):
        assert final["meta_info"][key] == full["meta_info"][key]
    for chunk in chunks[:-1]:  # cumulative: every chunk is a prefix of the answer, unfinished
        n = len(chunk["output_ids"])
        assert chunk["output_ids"] == full["output_ids"][:n] and chunk["meta_info"]["finish_reason"] is None
        assert chunk["meta_info"]["output_token_logprobs"] == full["meta_info"]["output_token_logprobs"][:n]
        assert full["text"].startswith(chunk["text"]) and "index" not in chunk


def test_batched_stream_with_n_tags_chunks_with_their_prompt_major_index(client):
    body = dict(
        input_ids=[PROMPT, [2, 20, 21, 3]], sampling_params={**GREEDY, "n": 2, "max_new_tokens": 5}, rid=["p", "q"]
    )
    full = generate(client, **body)
    chunks = events(client.post("/generate", json={**body, "stream": True}))
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3]
    for index, item in enumerate(full):
        assert finals[index]["output_ids"] == item["output_ids"]
        assert finals[index]["meta_info"]["id"] == item["meta_info"]["id"] == ["p-0", "p-1", "q-0", "q-1"][index]


def test_stream_interval_sends_one_chunk_per_that_many_tokens(client):
    body = dict(input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 9, "stream_interval": 4}, stream=True)
    lengths = [len(c["output_ids"]) for c in events(client.post("/generate", json=body))]
    # a chunk only when a multiple of 4 was crossed; a slow reader may get tokens folded into it
    crossed = [n // 4 for n in lengths[:-1]]
    assert lengths[-1] == 9 and len(lengths) <= 3 and all(c >= 1 for c in crossed)
    assert crossed == sorted(set(crossed)), lengths


def test_a_client_that_disconnects_mid_stream_aborts_its_request(engine):
    with ThreadedServer(create_app(engine)) as server:
        try:
            finished_before = engine.stats["requests_finished"]
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}, "stream": True}
            with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=30) as response:
                first = next(response.iter_lines())
                assert first.startswith("data: {")
                engine.pause("in_place")  # nothing more is sent: only the disconnect poll can notice
            _wait_for(lambda: engine.pending() == 0)  # aborted while paused: no forward step ran since
            assert engine.stats["requests_finished"] == finished_before + 1
        finally:
            engine.resume_generation()


# ---- log-prob extras --------------------------------------------------------------------------------
def test_top_and_chosen_token_logprobs_match_an_independent_forward(client, reference):
    temperature, start, chosen = 0.7, 2, [5, 7, 30]
    out = generate(
        client,
        input_ids=PROMPT,
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=3,
        token_ids_logprob=chosen,
        return_text_in_logprobs=True,
        return_entropy=True,
        sampling_params={"temperature": temperature, "max_new_tokens": 6, "ignore_eos": True},
    )
    meta, ids = out["meta_info"], out["output_ids"]
    lp = ref_logprobs(reference, PROMPT + ids, temperature)
    out_rows, in_rows = lp[len(PROMPT) - 1 : -1], lp[start - 1 : len(PROMPT) - 1]

    def check(per_position, rows, expect_ids=None):
        assert len(per_position) == len(rows)
        for triples, row in zip(per_position, rows):
            tokens = expect_ids or row.topk(3).indices.tolist()
            assert [t for _, t, _ in triples] == tokens
            torch.testing.assert_close(torch.tensor([v for v, _, _ in triples]), row[tokens], atol=TOL, rtol=0)

    check(meta["output_top_logprobs"], out_rows)
    check(meta["input_top_logprobs"], in_rows)
    check(meta["output_token_ids_logprobs"], out_rows, chosen)
    check(meta["input_token_ids_logprobs"], in_rows, chosen)
    assert [t for _, t, _ in meta["input_token_logprobs"]] == PROMPT[start:]
    torch.testing.assert_close(
        torch.tensor([v for v, _, _ in meta["input_token_logprobs"]]),
        in_rows.gather(-1, torch.tensor(PROMPT[start:])[:, None])[:, 0],
        atol=TOL,
        rtol=0,
    )
    best = meta["output_top_logprobs"][0][0]
    assert best[2] == client.app.state.server.engine.decode([best[1]], False)  # return_text_in_logprobs
    entropy = -(out_rows.exp() * out_rows).sum(-1)
    torch.testing.assert_close(torch.tensor(meta["output_token_entropy"]), entropy, atol=TOL, rtol=0)


def test_prompt_only_scoring_with_zero_new_tokens_and_flat_top_logprobs(client, reference):
    body = dict(
        input_ids=PROMPT,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        sampling_params={"max_new_tokens": 0},
        return_prompt_token_ids=True,
    )
    nested = generate(client, **body)
    meta = nested["meta_info"]
    assert nested["output_ids"] == [] and meta["output_top_logprobs"] == [] and nested["prompt_token_ids"] == PROMPT
    assert meta["input_top_logprobs"][0] is None and meta["input_token_logprobs"][0] == [None, PROMPT[0], None]
    top = ref_logprobs(reference, PROMPT)[:-1].topk(2)
    assert [[t for _, t, _ in row] for row in meta["input_top_logprobs"][1:]] == top.indices.tolist()
    flat = generate(client, **body, return_flat_raw_top_logprobs=True)["meta_info"]
    assert "input_top_logprobs" not in flat and flat["input_top_logprobs_null_prefix"] == 1
    assert flat["input_top_logprobs_shape"] == [len(PROMPT) - 1, 2]
    assert flat["input_top_logprobs_idx_flat"] == top.indices.flatten().tolist()
    b64 = generate(client, **body, return_flat_raw_top_logprobs=True, return_flat_raw_top_logprobs_b64=True)[
        "meta_info"
    ]
    values = np.frombuffer(base64.b64decode(b64["input_top_logprobs_val_flat_b64"]), dtype="<f4")
    np.testing.assert_allclose(values, np.array(flat["input_top_logprobs_val_flat"], dtype="<f4"))
    assert (
        np.frombuffer(base64.b64decode(b64["input_top_logprobs_idx_flat_b64"]), "<i4").tolist()
        == flat["input_top_logprobs_idx_flat"]
    )


# ---- sampling options ------------------------------------------------------------------------------
def test_logit_bias_moves_the_greedy_token_and_logprobs_follow_the_biased_logits(client, reference):
    greedy = generate(client, input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 1})["output_ids"][0]
    out = generate(
        client,
        input_ids=PROMPT,
        return_logprob=True,
        sampling_params={**GREEDY, "max_new_tokens": 1, "logit_bias": {str(greedy): -100.0}},
    )
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT])).logits[0, -1]
    logits[greedy] -= 100.0
    assert out["output_ids"][0] != greedy and out["output_ids"][0] == logits.argmax().item()
    expected = torch.log_softmax(logits, -1)[out["output_ids"][0]].item()
    assert abs(out["meta_info"]["output_token_logprobs"][0][0] - expected) < TOL


def test_min_new_tokens_holds_off_eos(client):
    towards_eos = {"temperature": 0, "max_new_tokens": 6, "logit_bias": {"1": 60.0}}  # id 1 is <eos>
    assert generate(client, input_ids=PROMPT, sampling_params=towards_eos)["output_ids"] == [1]
    out = generate(client, input_ids=PROMPT, sampling_params={**towards_eos, "min_new_tokens": 3})
    # as in SGLang (and HF): three tokens that cannot stop, then <eos> may come
    assert len(out["output_ids"]) == 4 and out["output_ids"][-1] == 1 and 1 not in out["output_ids"][:-1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 1}


def test_penalties_follow_sglangs_formulas_step_by_step(client, reference):
    params = {
        "temperature": 0,
        "max_new_tokens": 10,
        "ignore_eos": True,
        "repetition_penalty": 1.6,
        "frequency_penalty": 0.4,
        "presence_penalty": 0.3,
    }
    out = generate(client, input_ids=PROMPT, return_logprob=True, sampling_params=params)
    ids = out["output_ids"]
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1]
    for step, token in enumerate(ids):
        row, counts = logits[step].clone(), torch.bincount(torch.tensor(ids[:step], dtype=torch.long), minlength=64)
        seen = counts > 0
        row = torch.where(seen, torch.where(row < 0, row * 1.6, row / 1.6), row) - 0.4 * counts - 0.3 * seen
        assert token == row.argmax().item(), step
        lp = out["meta_info"]["output_token_logprobs"][step][0]
        assert abs(lp - torch.log_softmax(row, -1)[token].item()) < TOL
    plain = generate(
        client,
        input_ids=PROMPT,
        sampling_params={**params, "repetition_penalty": 1.0, "frequency_penalty": 0, "presence_penalty": 0},
    )
    assert len(set(ids)) >= len(set(plain["output_ids"]))


def test_min_p_keeps_only_tokens_near_the_most_likely(client, reference):
    out = generate(
        client,
        input_ids=PROMPT,
        sampling_params={"n": 6, "max_new_tokens": 8, "ignore_eos": True, "min_p": 0.9, "temperature": 1.0},
    )
    for item in out:
        probs = ref_logprobs(reference, PROMPT + item["output_ids"])[len(PROMPT) - 1 : -1].exp()
        for step, token in enumerate(item["output_ids"]):
            assert probs[step, token] >= 0.9 * probs[step].max() - TOL


def test_stop_regex_and_no_stop_trim(client):
    text = generate(client, input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 16})["text"]
    char = next(ch for ch in text[1:] if ch.strip())
    pattern = f"[{re.escape(char)}]"
    cut = generate(client, input_ids=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 16, "stop_regex": pattern})
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert cut["text"] == text[: text.index(char)]
    kept = generate(
        client,
        input_ids=PROMPT,
        sampling_params={**GREEDY, "max_new_tokens": 16, "stop_regex": [pattern], "no_stop_trim": True},
    )
    assert kept["text"] == text[: text.index(char) + 1]


def test_null_max_new_tokens_means_up_to_the_context_length(client, engine):
    message = generate(client, 400, input_ids=PROMPT, sampling_params={"max_new_tokens": engine.context_length})
    assert "context length" in message["error"]["message"]
    out = generate(
        client,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": None, "temperature": 0, "stop_token_ids": list(range(64))},
    )
    assert len(out["output_ids"]) == 1  # accepted (room = context - prompt); stopped by the first token


# ---- load, version, server info ---------------------------------------------------------------------
def test_load_weight_version_and_server_info(client, engine):
    assert client.get("/get_weight_version").json() == {"weight_version": engine.weight_version}
    engine.pause("in_place")
    try:
        threading.Thread(
            target=client.post,
            args=("/generate",),
            kwargs={"json": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}},
        ).start()
        _wait_for(lambda: engine.pending() == 1)
        assert client.get("/get_load").json() == [
            {"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 1, "num_tokens": len(PROMPT)}
        ]
    finally:
        engine.resume_generation()
    _wait_for(lambda: engine.pending() == 0)
    info = client.get("/get_server_info").json()
    assert {info[k] for k in ("tp_size", "dp_size", "pp_size")} == {1} and info["enable_memory_saver"] is True


def _wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_non_finite_logprobs_are_sent_as_null(client):
    out = generate(
        client,
        input_ids=PROMPT,
        return_logprob=True,
        token_ids_logprob=[1],
        sampling_params={"temperature": 0, "max_new_tokens": 2, "min_new_tokens": 2, "ignore_eos": True},
    )
    masked = [triples[0][0] for triples in out["meta_info"]["output_token_ids_logprobs"]]
    assert masked == [None, None] and all(math.isfinite(lp) for lp, _, _ in out["meta_info"]["output_token_logprobs"])


def test_logit_bias_of_many_rows_at_once_equals_row_by_row():
    """process_logits adds every bias-only row's logit_bias in one scatter; rows with penalties
    or min_new_tokens go row by row. Both give bit-for-bit what each row alone gives."""
    from megarl.rollout.engine.logit_processing import _process_row, process_logits
    from megarl.rollout.engine.protocol import SamplingParams

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 12, generator=g)
    params = [
        SamplingParams(logit_bias=((1, 2.5), (7, -1.0))),
        SamplingParams(),
        SamplingParams(logit_bias=((1, 0.75),), frequency_penalty=0.5),
        SamplingParams(logit_bias=((3, 4.0),), min_new_tokens=4),
        SamplingParams(logit_bias=((11, -3.0),)),
    ]
    outputs = [[2, 2], [4], [1, 1, 5], [6], []]
    eos = frozenset({1})
    out = process_logits(logits, params, outputs, eos)
    for i, p in enumerate(params):
        alone = _process_row(logits[i].clone(), p, outputs[i], eos) if p.changes_logits else logits[i]
        assert torch.equal(out[i], alone), i
    assert out[0, 1] == logits[0, 1] + 2.5 and out[3, 1] == float("-inf")
