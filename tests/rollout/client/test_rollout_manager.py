"""RolloutManager end to end against two real embedded servers (the launcher's subprocesses on the tiny
model): the row layout the trainer relies on, round-robin shares, and batched vs per-prompt modes."""

from __future__ import annotations

import contextlib

import httpx
import pytest
import torch

from megarl.data.batch import Batch
from megarl.rollout.client.manager import RolloutManager, SamplingSpec
from megarl.rollout.fleet.server_process import RolloutServerProcess

torch.set_num_threads(1)
LOGPROB_TOL = 1e-4  # server vs HF forward, fp32 (the tolerance test_rollout_client uses)

PROMPTS = [[2, 10, 11, 3], [2, 20, 21, 22, 23, 24, 3], [2, 30, 3], [2, 40, 41, 42, 3], [2, 50, 51, 52, 53, 3]]


@pytest.fixture(scope="module")
def servers(tiny_model_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("manager-logs")
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                RolloutServerProcess(
                    tiny_model_path,
                    port=0,
                    max_batch_size=64,
                    seed=i,
                    torch_threads=1,
                    log_path=logs / f"server{i}.log",
                )
            )
            for i in range(2)
        ]


@pytest.fixture(scope="module")
def manager(servers):
    rollout = RolloutManager([s.url for s in servers], max_retries=1)
    yield rollout
    rollout.close()


def prompt_batch() -> Batch:
    return Batch(
        non_tensors={
            "raw_prompt_ids": [list(p) for p in PROMPTS],
            "data_source": [f"source-{k}" for k in range(len(PROMPTS))],
            "extra_info": [{"index": k} for k in range(len(PROMPTS))],
        }
    )


def engine_stats(server) -> dict:
    return httpx.get(f"{server.url}/get_server_info", timeout=10).json()["engine_stats"]


def test_rows_are_prompt_major_with_right_padded_responses_and_their_log_probs(manager, tiny_model_path):
    n, max_new = 3, 6
    rows = manager.generate(prompt_batch(), SamplingSpec(n=n, temperature=1.0, max_new_tokens=max_new))
    assert len(rows) == len(PROMPTS) * n
    lengths = rows["response_mask"].sum(-1).long()
    R, T = int(lengths.max()), int((rows["prompt_lengths"] + lengths).max())
    assert 1 <= R <= max_new
    assert rows["input_ids"].shape == (len(rows), T)
    assert rows["responses"].shape == rows["response_mask"].shape == rows["rollout_log_probs"].shape == (len(rows), R)
    assert rows["rollout_log_probs"].dtype == rows["response_mask"].dtype == torch.float32
    for i in range(len(rows)):
        k, P, L = i // n, int(rows["prompt_lengths"][i]), int(lengths[i])
        assert P == len(PROMPTS[k]) and rows["input_ids"][i, :P].tolist() == PROMPTS[k], f"row {i} is not prompt {k}"
        assert rows["data_source"][i] == f"source-{k}" and rows["extra_info"][i] == {"index": k}
        assert list(rows["raw_prompt_ids"][i]) == PROMPTS[k]
        assert rows["response_mask"][i].tolist() == [1.0] * L + [0.0] * (R - L)
        assert rows["input_ids"][i, P : P + L].tolist() == rows["responses"][i, :L].tolist()
        assert not rows["input_ids"][i, P + L :].any() and not rows["responses"][i, L:].any()
        assert (rows["rollout_log_probs"][i, :L] <= 0).all() and not rows["rollout_log_probs"][i, L:].any()
        assert rows["finish_reason"][i] in ("length", "stop") and (rows["finish_reason"][i] == "stop" or L == max_new)
    # Each row's log-probs belong to that row's tokens: recompute them with HF for a few rows.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    for i in (0, 4, len(rows) - 1):
        P, L = int(rows["prompt_lengths"][i]), int(lengths[i])
        with torch.no_grad():
            logits = model(rows["input_ids"][i : i + 1, : P + L]).logits[0, P - 1 : P + L - 1]
        expected = torch.log_softmax(logits, -1).gather(-1, rows["responses"][i, :L, None])[:, 0]
        torch.testing.assert_close(rows["rollout_log_probs"][i, :L], expected, atol=LOGPROB_TOL, rtol=0)


def test_prompts_go_round_robin_and_each_server_gets_its_share_in_one_batch(manager, servers):
    before = [engine_stats(s) for s in servers]
    rows = manager.generate(prompt_batch(), SamplingSpec(n=2, temperature=1.0, max_new_tokens=3))
    after = [engine_stats(s) for s in servers]
    finished = [a["requests_finished"] - b.get("requests_finished", 0) for a, b in zip(after, before)]
    batches = [a["batches"] - b.get("batches", 0) for a, b in zip(after, before)]
    assert finished == [3 * 2, 2 * 2], "server 0 takes prompts 0, 2, 4 and server 1 prompts 1, 3"
    assert batches == [1, 1], "batched mode hands each server its whole share at once"
    assert [rows["input_ids"][2 * k, : len(p)].tolist() for k, p in enumerate(PROMPTS)] == PROMPTS


def test_batched_chunked_and_per_prompt_modes_give_the_same_rows(servers, manager):
    urls, greedy = [s.url for s in servers], SamplingSpec(n=2, temperature=0.0, max_new_tokens=5)
    with (
        contextlib.closing(RolloutManager(urls, batched=False)) as per_prompt,
        contextlib.closing(RolloutManager(urls, max_batch_prompts=2)) as chunked,
    ):
        results = [m.generate(prompt_batch(), greedy) for m in (manager, per_prompt, chunked)]
    reference = results[0]
    for rows in results[1:]:
        assert set(rows.keys()) == set(reference.keys())
        for key in ("input_ids", "prompt_lengths", "responses", "response_mask"):
            assert torch.equal(rows[key], reference[key]), key
        torch.testing.assert_close(rows["rollout_log_probs"], reference["rollout_log_probs"], atol=1e-5, rtol=0)
        for key in ("data_source", "finish_reason", "response_text"):
            assert list(rows[key]) == list(reference[key]), key
