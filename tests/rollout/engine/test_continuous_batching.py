"""Continuous batching, interruptible generation and partial rollout in the embedded engine.

Requests that join a running batch (their prefilled KV cache merged into the batch's) must answer
exactly what they answer alone: same token ids with the same sampling_seed, log-probs within
1e-5 (fp32; only the padding and the batch shape differ, observed <= 1e-6). Pauses: abort returns
the partial tokens, in_place changes nothing when the weights do not change, retract re-prefills
under the weights loaded during the pause. Partial rollout (megarl/rollout/client/partial.py) resumes an
aborted request after a weight update; every token keeps the log-prob of the weights that
produced it, checked against independent HF forwards of the old and of the new weights (fp32,
1e-5). Joins are made deterministic by acting from a request's on_token callback, which runs on
the engine thread between sampling and the next forward step.
"""

from __future__ import annotations

import asyncio
import copy
import threading

import pytest
import torch

from megarl.models.tiny import build_tiny_checkpoint
from megarl.rollout.engine.generation import GenerationEngine
from megarl.rollout.engine.protocol import GenerationRequest, SamplingParams
from tests._http import ThreadedServer

torch.set_num_threads(1)
TOL = 1e-5
PROMPTS = [[2, 10, 11, 12, 13, 3], [2, 20, 21, 3], [2, 30, 31, 32, 33, 34, 35, 36, 3], [2, 40, 3]]


@pytest.fixture(scope="module")
def new_weights(reference):
    """A weight update: layer 1 and the head moved (the log-probs change visibly)."""
    generator = torch.Generator().manual_seed(3)
    return [
        (name, t + 0.2 * torch.randn(t.shape, generator=generator))
        for name, t in reference.state_dict().items()
        if "layers.1" in name or "lm_head" in name
    ]


@pytest.fixture(scope="module")
def updated_reference(reference, new_weights):
    model = copy.deepcopy(reference)
    model.load_state_dict(dict(new_weights), strict=False)
    return model


@pytest.fixture()
def engine(make_engine):
    return make_engine(max_batch_size=4)


def request(rid, prompt, max_new, seed=None, temperature=1.0, on_token=None) -> GenerationRequest:
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature, ignore_eos=True, sampling_seed=seed)
    return GenerationRequest(rid=rid, input_ids=prompt, params=params, return_logprob=True, on_token=on_token)


def at_token(k: int, action):
    """An on_token callback that runs `action` once, right after the k-th token of its request."""
    count = [0]

    def on_token(step):
        count[0] += 1
        if count[0] == k:
            action()

    return on_token


def hf_logprobs(model, prompt, output, temperature=1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    scaled = logits / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def assert_same_answer(a, b) -> None:
    assert a.output_ids == b.output_ids
    torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=TOL, rtol=0)


# ---- continuous batching -----------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_joined_rows_answer_what_they_answer_alone(engine, temperature):
    specs = [(f"r{i}", PROMPTS[i % 4], 6 + 5 * (i % 3), 100 + i) for i in range(7)]
    alone = {rid: engine.submit([request(rid, p, m, s, temperature)])[0].result(timeout=60) for rid, p, m, s in specs}
    before = dict(engine.stats)
    futures = {}

    def submit(*indices):
        for i in indices:
            rid, p, m, s = specs[i]
            futures[rid] = engine.submit([request(rid + "-cb", p, m, s, temperature)])[0]

    # r0 runs alone; r1, r2 join after its 2nd token, r3..r6 after its 4th (the batch holds 4:
    # some wait for rows to leave and join later)
    rid, p, m, s = specs[0]
    hooks = [at_token(2, lambda: submit(1, 2)), at_token(4, lambda: submit(3, 4, 5, 6))]
    futures[rid] = engine.submit(
        [request(rid + "-cb", p, 30, s, temperature, on_token=lambda step: [h(step) for h in hooks])]
    )[0]
    futures[rid].result(timeout=60)  # its hooks have submitted the others by now
    together = {rid: f.result(timeout=60) for rid, f in futures.items()}
    assert engine.stats["joined"] - before.get("joined", 0) >= 6  # all but r0 joined a running batch
    assert engine.stats["batches"] - before["batches"] == 1 and engine.stats["max_rows"] == 4
    for rid in list(alone)[1:]:
        assert_same_answer(together[rid], alone[rid])
        assert together[rid].weight_versions == [["default", len(alone[rid].output_ids)]]
    r0 = together["r0"]  # longer than alone (30 tokens): its first tokens are the same
    assert r0.output_ids[: len(alone["r0"].output_ids)] == alone["r0"].output_ids


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_rows_that_share_a_prompt_are_prefilled_once_and_answer_as_alone(make_engine, temperature):
    """The n samples of a prompt (here two prompts interleaved, A B A B A) share one prefill and
    each gets its own copy of the KV row: every answer is the one it gives alone."""
    engine = make_engine(max_batch_size=8)
    specs = [(f"s{i}", PROMPTS[i % 2], 5 + i, 200 + i) for i in range(5)]
    alone = {rid: engine.submit([request(rid, p, m, s, temperature)])[0].result(timeout=60) for rid, p, m, s in specs}
    before = engine.stats["prefill_rows"]
    gate = threading.Event()
    engine.submit([request("gate", PROMPTS[2], 1, 1, on_token=lambda step: gate.wait(timeout=30))])
    futures = engine.submit([request(rid + "-shared", p, m, s, temperature) for rid, p, m, s in specs])
    gate.set()  # the five were queued while the gate's row ran: they are admitted in one prefill
    together = {rid: f.result(timeout=60) for (rid, *_), f in zip(specs, futures)}
    assert engine.stats["prefill_rows"] - before == 1 + 2  # the gate's prompt, then A and B once each
    for rid in alone:
        assert_same_answer(together[rid], alone[rid])


def test_long_request_keeps_running_while_short_ones_join_and_leave(engine, reference):
    done: list[str] = []
    shorts = []

    def submit_shorts():
        for i in range(6):
            req = request(f"short{i}", PROMPTS[i % 4], 3, seed=i)
            req.future.add_done_callback(lambda _, rid=req.rid: done.append(rid))
            shorts.append(req)
        engine.submit(shorts)

    long = request("long", PROMPTS[2], 40, seed=9, on_token=at_token(2, submit_shorts))
    long.future.add_done_callback(lambda _: done.append("long"))
    engine.submit([long])
    result = long.future.result(timeout=60)
    for req in shorts:
        req.future.result(timeout=60)
    assert done[-1] == "long" and sorted(done[:-1]) == [f"short{i}" for i in range(6)]
    assert engine.stats["batches"] == 1 and engine.stats["joined"] == 6 and engine.stats["max_rows"] == 4
    # the shorts ran 3 at a time next to the long one: far fewer steps than one after the other
    assert engine.stats["forward_steps"] < 40 + 6 * 3
    torch.testing.assert_close(
        torch.tensor(result.output_logprobs), hf_logprobs(reference, PROMPTS[2], result.output_ids), atol=TOL, rtol=0
    )


def test_a_batch_gets_the_kv_headroom_its_rows_can_use(engine, monkeypatch):
    """A prefill's cache has spare columns for the tokens its rows can still sample (kv_cache.
    headroom_for), not a fixed 64: rows of 2 and 5 new tokens need 4 after the prefill."""
    from megarl.rollout.engine.kv_cache import HEADROOM

    seen, make = [], engine.runner.new_cache
    monkeypatch.setattr(engine.runner, "new_cache", lambda headroom: seen.append(headroom) or make(headroom))
    futures = engine.submit([request("a", PROMPTS[0], 2, seed=1), request("b", PROMPTS[1], 5, seed=2)])
    assert [len(f.result(timeout=60).output_ids) for f in futures] == [2, 5]
    engine.submit([request("long", PROMPTS[3], HEADROOM + 10, seed=3)])[0].result(timeout=60)
    assert seen == [4, HEADROOM]


# ---- pause, abort, retract -----------------------------------------------------------------------
def test_pause_abort_returns_the_partial_tokens(engine):
    req = request("a", PROMPTS[0], 40, seed=1, on_token=at_token(5, lambda: engine.pause("abort")))
    result = engine.submit([req])[0].result(timeout=60)
    assert result.finish_reason == {"type": "abort", "message": "aborted by /pause_generation"}
    assert len(result.output_ids) == len(result.output_logprobs) == 5
    assert engine.paused
    engine.resume_generation()
    assert len(engine.submit([request("b", PROMPTS[0], 3)])[0].result(timeout=60).output_ids) == 3


def test_pause_in_place_then_continue_changes_nothing(engine):
    expected = engine.submit([request("ref", PROMPTS[1], 20, seed=4)])[0].result(timeout=60)
    paused = threading.Event()
    req = request("p", PROMPTS[1], 20, seed=4, on_token=at_token(7, paused.set))
    engine.submit([req])
    assert paused.wait(60)
    engine.pause("in_place")  # returns once no forward step is running
    steps = engine.stats["forward_steps"]
    assert not req.future.done() and engine.load()["num_waiting_reqs"] == 0  # held in place, not queued
    assert engine.stats["forward_steps"] == steps
    engine.resume_generation()
    result = req.future.result(timeout=60)
    assert_same_answer(result, expected)
    assert result.num_retractions == 0 and result.weight_versions == [["default", 20]]


def test_retract_reprefills_under_the_weights_loaded_during_the_pause(
    engine, reference, updated_reference, new_weights
):
    k, total, retracted = 6, 18, threading.Event()
    req = request(
        "r", PROMPTS[2], total, seed=5, on_token=at_token(k, lambda: (engine.pause("retract"), retracted.set()))
    )
    engine.submit([req])
    assert retracted.wait(60)
    engine.pause("retract")  # from this thread: waits until the row is back in the queue
    assert engine.load() == {"num_reqs": 1, "num_waiting_reqs": 1, "num_tokens": len(PROMPTS[2]) + k}
    engine.update_weights(new_weights, weight_version="v2")
    engine.resume_generation()
    result = req.future.result(timeout=60)
    assert result.num_retractions == 1 and engine.stats["retracted"] == 1
    assert result.weight_versions == [["default", k], ["v2", total - k]]
    ids, logprobs = result.output_ids, torch.tensor(result.output_logprobs)
    old, new = hf_logprobs(reference, PROMPTS[2], ids), hf_logprobs(updated_reference, PROMPTS[2], ids)
    torch.testing.assert_close(logprobs[:k], old[:k], atol=TOL, rtol=0)
    torch.testing.assert_close(logprobs[k:], new[k:], atol=TOL, rtol=0)
    assert (old[k:] - new[k:]).abs().max() > 1e-2  # the update changed the log-probs: the test can fail


def test_abort_by_rid_of_a_joined_row_leaves_the_other_rows_running(engine):
    alone = {
        rid: engine.submit([request(rid, PROMPTS[i], 12, seed=i)])[0].result(timeout=60)
        for i, rid in [(0, "a"), (2, "c")]
    }
    joiners = [
        request("b", PROMPTS[1], 12, seed=1, on_token=at_token(4, lambda: engine.abort("b"))),
        request("c", PROMPTS[2], 12, seed=2),
    ]
    first = request("a", PROMPTS[0], 12, seed=0, on_token=at_token(2, lambda: engine.submit(joiners)))
    engine.submit([first])
    a, b, c = (r.future.result(timeout=60) for r in [first, *joiners])
    assert engine.stats["joined"] == 2
    assert b.finish_reason == {"type": "abort", "message": "aborted by /abort_request"} and len(b.output_ids) == 4
    assert_same_answer(a, alone["a"])
    assert_same_answer(c, alone["c"])
    assert a.finish_reason["type"] == c.finish_reason["type"] == "length"


def test_a_failure_between_steps_fails_its_rows_and_the_engine_keeps_serving(engine, monkeypatch):
    """An abort resolved between forwards whose cache edit raises: the running rows get the error
    (not a hang: the scheduler thread survives), and the next request is answered."""
    from megarl.rollout.engine import scheduler

    real = scheduler.RunningBatch.keep_unfinished

    def broken(self, runner, device):
        if any(row.finish is not None for row in self.rows):
            raise RuntimeError("cache edit failed")
        return real(self, runner, device)

    monkeypatch.setattr(scheduler.RunningBatch, "keep_unfinished", broken)
    first = request("a", PROMPTS[0], 12, seed=0, on_token=at_token(3, lambda: engine.abort("a")))
    other = request("b", PROMPTS[1], 12, seed=1)
    engine.submit([first, other])
    assert first.future.result(timeout=60).finish_reason["type"] == "abort"  # answered before the edit
    with pytest.raises(RuntimeError, match="cache edit failed"):
        other.future.result(timeout=60)
    monkeypatch.setattr(scheduler.RunningBatch, "keep_unfinished", real)
    again = engine.submit([request("c", PROMPTS[2], 5, seed=2)])[0].result(timeout=60)
    assert again.finish_reason["type"] == "length" and len(again.output_ids) == 5


# ---- partial rollout through the HTTP server and RolloutClient ---------------------------------------
@pytest.fixture()
def served(engine):
    from megarl.rollout.client.client import RolloutClient
    from megarl.rollout.server.app import create_app

    with ThreadedServer(create_app(engine)) as server, RolloutClient(server.url, max_retries=0) as client:
        yield engine, client


def test_partial_rollout_resumed_after_a_weight_update_keeps_each_tokens_logprob(
    served, monkeypatch, reference, updated_reference, new_weights
):
    from megarl.rollout.client.partial import is_partial, resume_partial
    from megarl.wire import routing
    from megarl.wire.weights_codec import serialize_named_tensors

    engine, client = served
    k, total = 7, 20
    submit = engine.submit

    def submit_with_interrupt(requests):  # the trainer's weight sync interrupts generation at token k
        for req in requests:
            req.on_token = at_token(k, lambda: engine.pause("abort"))
        return submit(requests)

    monkeypatch.setattr(engine, "submit", submit_with_interrupt)
    prompt, params = PROMPTS[2], {"max_new_tokens": total, "temperature": 1.0, "ignore_eos": True}
    (partial,) = client.generate([prompt], params, return_logprob=True, return_routed_experts=True)
    monkeypatch.setattr(engine, "submit", submit)
    assert is_partial(partial) and len(partial.output_ids) == k
    assert partial.meta_info["weight_versions"] == [{"version": "default", "start": 0, "end": k}]
    client.update_weights_from_tensor(serialize_named_tensors(new_weights), weight_version="v2")
    client.continue_generation()
    merged = asyncio.run(resume_partial(client, prompt, params, partial, return_routed_experts=True))
    assert merged.finish_reason == {"type": "length", "length": total - k}
    assert merged.output_ids[:k] == partial.output_ids and len(merged.output_ids) == total
    assert merged.meta_info["weight_versions"] == [
        {"version": "default", "start": 0, "end": k},
        {"version": "v2", "start": k, "end": total},
    ]
    assert merged.meta_info["completion_tokens"] == total and merged.meta_info["prompt_tokens"] == len(prompt)
    triples = merged.meta_info["output_token_logprobs"]
    assert [t for _, t, _ in triples] == merged.output_ids and [lp for lp, _, _ in triples] == merged.output_logprobs
    logprobs = torch.tensor(merged.output_logprobs)
    old = hf_logprobs(reference, prompt, merged.output_ids)
    new = hf_logprobs(updated_reference, prompt, merged.output_ids)
    torch.testing.assert_close(logprobs[:k], old[:k], atol=TOL, rtol=0)
    torch.testing.assert_close(logprobs[k:], new[k:], atol=TOL, rtol=0)
    assert (old[k:] - new[k:]).abs().max() > 1e-2
    assert asyncio.run(resume_partial(client, prompt, params, merged)) is merged  # finished: nothing to do
    # MoE routing records: each token keeps the experts of the forward that fed it, under the
    # version that ran it: the first part's up to where it stopped, then v2's (a fresh v2 prefill
    # of the whole answer routes those positions alike)
    fed, cut = len(prompt) + total - 1, len(prompt) + k - 1
    experts = routing.decode(merged.meta_info["routed_experts"], fed)
    first = routing.decode(partial.meta_info["routed_experts"], cut)
    (whole,) = client.generate([prompt + merged.output_ids], {"max_new_tokens": 1}, return_routed_experts=True)
    under_v2 = routing.decode(whole.meta_info["routed_experts"], fed + 1)[:fed]
    assert (experts[:cut] == first).all() and (experts[cut:] == under_v2[cut:]).all()


def test_a_streamed_request_that_joins_a_running_batch_streams_its_answer(served):
    import json

    import httpx

    engine, client = served
    body = {
        "input_ids": PROMPTS[1],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 9, "ignore_eos": True, "sampling_seed": 11},
    }
    expected = httpx.post(client.base_url + "/generate", json=body, timeout=60).json()
    started = threading.Event()
    long = request("long", PROMPTS[2], 40, seed=1, on_token=at_token(2, started.set))
    engine.submit([long])
    assert started.wait(60)
    engine.pause("in_place")  # the long row holds; the streamed request queues, then joins it
    joined_before, chunks = engine.stats["joined"], []

    def stream():
        with httpx.stream("POST", client.base_url + "/generate", json={**body, "stream": True}, timeout=60) as r:
            chunks.extend(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))

    reader = threading.Thread(target=stream)
    reader.start()
    while engine.load()["num_waiting_reqs"] != 1:
        assert reader.is_alive(), chunks
        threading.Event().wait(0.01)
    engine.resume_generation()
    reader.join(timeout=60)
    assert engine.stats["joined"] == joined_before + 1 and not long.future.done()
    lengths = [len(c["output_ids"]) for c in chunks]  # cumulative chunks (slow reads fold several)
    assert len(set(lengths)) > 1 and lengths == sorted(lengths) and lengths[-1] == 9
    assert all(c["output_ids"] == expected["output_ids"][: len(c["output_ids"])] for c in chunks)
    final = chunks[-1]
    assert final["output_ids"] == expected["output_ids"] and final["meta_info"]["finish_reason"]["type"] == "length"
    got, want = final["meta_info"]["output_token_logprobs"], expected["meta_info"]["output_token_logprobs"]
    assert [t[1:] for t in got] == [t[1:] for t in want]  # joined: the batch shape differs, log-probs within TOL
    torch.testing.assert_close(torch.tensor([t[0] for t in got]), torch.tensor([t[0] for t in want]), atol=TOL, rtol=0)
    assert final["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": 9}]
    long.future.result(timeout=60)


def test_resume_request_reduces_the_budget_and_refuses_n_above_one():
    from megarl.rollout.client.client import GenerateOutput
    from megarl.rollout.client.partial import merge_runs, resume_request

    partial = GenerateOutput([5, 6, 7], "abc", [-1.0, -2.0, -3.0], {"type": "abort"}, {})
    ids, params = resume_request([1, 2], {"max_new_tokens": 10, "min_new_tokens": 4, "top_p": 0.9}, partial)
    assert ids == [1, 2, 5, 6, 7] and params == {"max_new_tokens": 7, "min_new_tokens": 1, "top_p": 0.9}
    with pytest.raises(ValueError, match="n=2"):
        resume_request([1], {"max_new_tokens": 10, "n": 2}, partial)
    with pytest.raises(ValueError, match="max_new_tokens"):
        resume_request([1], {}, partial)
    assert merge_runs([["a", 2], ["b", 1]], [["b", 3], ["c", 1]]) == [["a", 2], ["b", 4], ["c", 1]]


# ---- every tiny architecture merges its KV cache ---------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3", "tiny-llama", "tiny-deepseek-v3"])
def test_every_tiny_architecture_answers_joined_rows_as_alone(preset, tmp_path):
    path = build_tiny_checkpoint(tmp_path / preset, seed=0, preset=preset)
    engine = GenerationEngine(str(path), max_batch_size=4, seed=0)
    try:
        # the joiners' prefill is narrower than the running row's cache: they are the padded ones
        specs = [(PROMPTS[2], 12, 50), (PROMPTS[1], 8, 51), (PROMPTS[3], 10, 52)]
        alone = [engine.submit([request(f"a{i}", p, m, s)])[0].result(timeout=60) for i, (p, m, s) in enumerate(specs)]
        joiners = []
        first = request(
            "j0",
            *specs[0],
            on_token=at_token(
                2, lambda: joiners.extend(engine.submit([request(f"j{i}", *spec) for i, spec in enumerate(specs) if i]))
            ),
        )
        assert_same_answer(engine.submit([first])[0].result(timeout=60), alone[0])
        for i, future in enumerate(joiners, start=1):
            assert_same_answer(future.result(timeout=60), alone[i])
        assert engine.stats["joined"] == 2
    finally:
        engine.close()
