"""The embedded server's answers decode with SGLang's own JSON contract (sglang.api.v1's
GenerateResponse, as its clients read them: meta_info keys, [logprob, token_id, text] entries,
finish reasons, weight-version spans, stream chunks), and every /generate body megarl's
RolloutClient sends passes SGLang's own gate (api_contract.generate_contract_error), which a real
SGLang 0.5.23 server applies before anything else."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from megarl.rollout.client.client import RolloutClient
from megarl.rollout.client.partial import resume_partial
from megarl.rollout.server.app import create_app
from tests._http import ThreadedServer
from tests.rollout import sglang_upstream as upstream

torch.set_num_threads(1)
PROMPT = [2, 10, 11, 12, 13, 3]
GREEDY = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}


def decode(item: dict):
    return upstream.api_types().GenerateResponse.from_json_value(item)


def _generate(client, **body) -> list | dict:
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_plain_answer_decodes_with_sglangs_contract(client):
    item = _generate(client, input_ids=PROMPT, sampling_params=GREEDY)
    answer = decode(item)
    meta = answer.meta_info
    assert list(answer.output_ids) == item["output_ids"] and answer.text == item["text"]
    assert meta.prompt_tokens == len(PROMPT) and meta.completion_tokens == 5 and meta.id == item["meta_info"]["id"]
    assert isinstance(meta.finish_reason, upstream.api_types().FinishLength) and meta.finish_reason.length == 5
    assert [(s.version, s.start, s.end) for s in meta.weight_versions] == [(meta.weight_version, 0, 5)]


def test_logprob_entries_decode_as_logprob_token_id_text(client):
    item = _generate(
        client,
        input_ids=PROMPT,
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        token_ids_logprob=[3, 5],
        return_text_in_logprobs=True,
    )
    meta, raw = decode(item).meta_info, item["meta_info"]
    assert [e.token_id for e in meta.output_token_logprobs] == item["output_ids"]
    assert [e.logprob for e in meta.output_token_logprobs] == [t[0] for t in raw["output_token_logprobs"]]
    assert all(isinstance(e.text, str) for e in meta.output_token_logprobs)
    assert [e.token_id for e in meta.input_token_logprobs] == PROMPT
    assert meta.input_token_logprobs[0].logprob is None  # nothing predicts the first prompt token
    assert [len(row) for row in meta.output_top_logprobs] == [2] * 5
    assert [[e.token_id for e in row] for row in meta.output_token_ids_logprobs] == [[3, 5]] * 5


def test_batched_and_n_answers_decode_in_sglangs_order(client):
    items = _generate(client, input_ids=[PROMPT, PROMPT[:4]], sampling_params={**GREEDY, "n": 2}, rid=["a", "b"])
    answers = [decode(item) for item in items]
    assert len(answers) == 4 and [a.meta_info.id[0] for a in answers] == ["a", "a", "b", "b"]
    assert [a.meta_info.prompt_tokens for a in answers] == [6, 6, 4, 4]


def test_stop_and_abort_finish_reasons_decode(client):
    params = {"temperature": 0, "max_new_tokens": 5}  # SGLang checks stop tokens only without ignore_eos
    first = _generate(client, input_ids=PROMPT, sampling_params=params)["output_ids"]
    stopped = decode(_generate(client, input_ids=PROMPT, sampling_params={**params, "stop_token_ids": [first[0]]}))
    assert isinstance(stopped.meta_info.finish_reason, upstream.api_types().FinishStop)
    assert stopped.meta_info.finish_reason.matched == first[0] and stopped.output_ids == first[:1]


def test_stream_chunks_decode_and_end_in_the_full_answer(client):
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}
    full = decode(_generate(client, **body))
    response = client.post("/generate", json={**body, "stream": True})
    blocks = response.text.split("\n\n")
    assert blocks[-2] == "data: [DONE]"
    chunks = [decode(json.loads(b[len("data: ") :])) for b in blocks[:-2]]
    assert (
        chunks[-1].output_ids == full.output_ids and chunks[-1].meta_info.finish_reason == full.meta_info.finish_reason
    )
    assert [len(c.meta_info.output_token_logprobs) for c in chunks] == [len(c.output_ids) for c in chunks]


def test_an_error_answer_decodes_as_sglangs_error_body(client):
    response = client.post("/generate", json={"input_ids": PROMPT, "top_logprob_num": 2})
    error = upstream.api_types().GenerateStreamError.from_json_value(response.json()).error
    assert response.status_code == 400 and "top_logprobs_num" in error.message


def test_model_and_server_info_decode_with_sglangs_contract(client):
    types = upstream.api_types()
    model = types.GetModelInfoResponse.from_json_value(client.get("/get_model_info").json())
    assert model.is_generation is True
    types.GetServerInfoResponse.from_json_value(client.get("/get_server_info").json())
    for probe in ("/health", "/health_generate", "/get_load", "/get_weight_version"):  # what routers poll
        assert client.get(probe).status_code == 200, probe


# ---- what megarl's client sends ------------------------------------------------------------------
class SGLangGate:
    """ASGI wrapper applying SGLang's own /generate gate before megarl's app, as SGLang's server
    does; the bodies it saw are kept."""

    def __init__(self, app):
        self.app, self.bodies = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/generate":
            return await self.app(scope, receive, send)
        raw, more = b"", True
        while more:
            message = await receive()
            raw, more = raw + message.get("body", b""), message.get("more_body", False)
        body = json.loads(raw)
        self.bodies.append(body)
        error = upstream.generate_contract_error()(body)
        if error is not None:
            payload = json.dumps({"error": error}).encode()
            await send(
                {"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]}
            )
            return await send({"type": "http.response.body", "body": payload})
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        return await self.app(scope, replay, send)


@pytest.fixture(scope="module")
def gated(engine):
    gate = SGLangGate(create_app(engine))
    with ThreadedServer(gate) as server, RolloutClient(server.url, max_retries=0) as client:
        yield gate, client, server.url


def test_every_generate_body_megarls_client_sends_passes_sglangs_gate(gated):
    gate, client, _ = gated
    before = len(gate.bodies)
    params = {"max_new_tokens": 4, "temperature": 1.0, "n": 2, "top_k": 5, "stop": ["zz"], "sampling_seed": 1}
    outs = client.generate([PROMPT, PROMPT[:4]], params, return_logprob=True, rids=["x", "y"])
    assert len(outs) == 4 and all(len(o.output_logprobs) == 4 for o in outs)
    client.generate([PROMPT], GREEDY, return_routed_experts=True)
    assert len(client.score([PROMPT + [7, 8]], [len(PROMPT)])) == 1
    assert len(client.generate_text(["hello"], {"max_new_tokens": 2})) == 1
    assert len(gate.bodies) - before >= 4


def test_a_partial_rollout_resume_passes_sglangs_gate(gated):
    gate, client, _ = gated
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "min_new_tokens": 2}
    (whole,) = client.generate([PROMPT], params, return_logprob=True)
    (first,) = client.generate([PROMPT], {**params, "max_new_tokens": 2}, return_logprob=True)
    first.finish_reason["type"] = "abort"  # as an interrupted answer reports it
    merged = asyncio.run(resume_partial(client, PROMPT, params, first))
    assert merged.output_ids == whole.output_ids
    resumed = gate.bodies[-1]["sampling_params"]
    resumed = resumed[0] if isinstance(resumed, list) else resumed
    assert resumed["max_new_tokens"] == 4 and gate.bodies[-1]["input_ids"][0][len(PROMPT) :] == first.output_ids


def test_sglangs_own_frontend_client_runs_a_program_against_the_embedded_server(gated):
    """sglang.lang's RuntimeEndpoint (what SGLang programs use): gen, select (scored from
    input_token_logprobs) and a batch, through SGLang's gate."""
    gate, _, url = gated
    sgl = upstream._import_sglang()
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    @sgl.function
    def program(s):
        s += "hello world"
        s += sgl.gen("answer", max_tokens=3, temperature=0, return_logprob=True)
        s += " pick: " + sgl.select("colour", choices=["red", "green", "blue"])

    before = len(gate.bodies)
    state = program.run(backend=RuntimeEndpoint(url))
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] == 3 and meta["finish_reason"] == {"type": "length", "length": 3}
    scores = state.get_meta_info("colour")["normalized_prompt_logprobs"]
    assert state["colour"] == ["red", "green", "blue"][scores.index(max(scores))]
    batch = program.run_batch([{}, {}], backend=RuntimeEndpoint(url))
    assert [s["answer"] for s in batch] == [state["answer"]] * 2  # greedy: the same answer
    assert len(gate.bodies) - before >= 3
