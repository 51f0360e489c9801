"""RolloutClient against a fake SGLang-shaped app (batched and per-prompt modes: request counts, retries,
errors, ordering), and end to end against a real embedded server subprocess started by the launcher
(batching, log-probs, weight updates sent from another process, clean shutdown)."""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from megarl.models.tiny import build_tiny_checkpoint
from megarl.procs.net import free_port
from megarl.rollout.client.client import RolloutClient, RolloutRequestError
from megarl.rollout.engine.generation import GenerationEngine
from megarl.rollout.fleet.server_process import RolloutServerProcess
from megarl.rollout.server.app import create_app
from megarl.wire.weights_codec import serialize_named_tensors
from tests._http import ThreadedServer

torch.set_num_threads(1)
LOGPROB_TOL = 1e-4


# ---- a fake SGLang worker in a thread --------------------------------------------------------------
def fake_worker_app(mode: str) -> FastAPI:
    """mode: ok | fail_once (500 the first time a request carries its first prompt) | always_503 |
    reject (400) | reject_0_hang_others (400 for prompt [0], 2 s for any other) | short (a batched
    answer one output short). Answers SGLang's single and batched
    /generate forms; records every request body and, per prompt, how many requests carried it."""
    app = FastAPI()
    app.state.calls, app.state.bodies = collections.Counter(), []

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        batched = isinstance(body["input_ids"][0], list)
        prompts = body["input_ids"] if batched else [body["input_ids"]]
        app.state.calls.update(tuple(p) for p in prompts)
        if mode == "always_503" or (mode == "fail_once" and app.state.calls[tuple(prompts[0])] == 1):
            return JSONResponse(
                {"error": {"message": "worker hiccup"}}, status_code=503 if mode == "always_503" else 500
            )
        if mode == "reject_0_hang_others" and prompts[0] != [0]:
            await asyncio.sleep(2)
        if mode == "reject" or mode == "reject_0_hang_others":
            return JSONResponse({"error": {"message": "sampling_params.top_p=2 must be in (0, 1]"}}, status_code=400)
        params = body["sampling_params"]
        params = params if isinstance(params, list) else [params] * len(prompts)
        items = [
            {
                "text": "",
                "output_ids": [prompt[0], j],
                "meta_info": {
                    "id": f"{prompt}-{j}",
                    "finish_reason": {"type": "length", "length": 2},
                    "output_token_logprobs": [[-0.5, prompt[0], None], [-0.25, j, None]],
                },
            }
            for prompt, p in zip(prompts, params)
            for j in range(p.get("n", 1))
        ]
        if mode == "short":
            items = items[:-1]
        return items if batched or len(items) > 1 else items[0]

    return app


def test_per_prompt_mode_retries_each_failing_request_and_keeps_prompt_major_order():
    with (
        ThreadedServer(fake_worker_app("fail_once")) as worker,
        RolloutClient(worker.url, batched=False, max_retries=2, backoff_s=0.01) as client,
    ):
        outputs = client.generate([[7, 1], [8, 1], [9, 1]], {"n": 2}, return_logprob=True)
        assert [o.output_ids for o in outputs] == [[7, 0], [7, 1], [8, 0], [8, 1], [9, 0], [9, 1]]
        assert outputs[1].output_logprobs == [-0.5, -0.25] and outputs[0].finish_reason["type"] == "length"
        assert dict(worker.app.state.calls) == {(7, 1): 2, (8, 1): 2, (9, 1): 2}
        assert all(body["input_ids"] in ([7, 1], [8, 1], [9, 1]) for body in worker.app.state.bodies)
        awaited = asyncio.run(client.agenerate([[3, 3]], [{"n": 1}]))  # from inside another event loop
        assert [o.output_ids for o in awaited] == [[3, 0]]


def test_batched_mode_sends_one_request_and_retries_the_whole_batch_after_a_500():
    prompts = [[7, 1], [8, 1], [9, 1]]
    with (
        ThreadedServer(fake_worker_app("fail_once")) as worker,
        RolloutClient(worker.url, max_retries=2, backoff_s=0.01) as client,
    ):
        outputs = client.generate(prompts, {"n": 2, "max_new_tokens": 2}, return_logprob=True, rids=["a", "b", "c"])
        assert [o.output_ids for o in outputs] == [[7, 0], [7, 1], [8, 0], [8, 1], [9, 0], [9, 1]]
        assert outputs[5].output_logprobs == [-0.5, -0.25]
        bodies = worker.app.state.bodies
        assert len(bodies) == 2, "one batched request, sent again once after the 500"
        assert all(
            b["input_ids"] == prompts
            and b["sampling_params"] == {"n": 2, "max_new_tokens": 2}
            and b["rid"] == ["a", "b", "c"]
            and b["return_logprob"] is True
            for b in bodies
        )
        assert dict(worker.app.state.calls) == {(7, 1): 2, (8, 1): 2, (9, 1): 2}
        # one prompt is still sent in the batched form (the answer is a list)
        assert [o.output_ids for o in client.generate([[4, 4]])] == [[4, 0]]
        assert bodies[-1]["input_ids"] == [[4, 4]]


def test_batched_mode_splits_large_calls_into_concurrent_chunks_in_order():
    prompts = [[10 + i] for i in range(5)]
    params = [{"n": 2, "temperature": 0.1 * i} for i in range(5)]
    with ThreadedServer(fake_worker_app("ok")) as worker, RolloutClient(worker.url, max_batch_prompts=2) as client:
        outputs = client.generate(prompts, params)
        assert [o.output_ids for o in outputs] == [[p[0], j] for p in prompts for j in range(2)]
        bodies = sorted(worker.app.state.bodies, key=lambda b: b["input_ids"][0])
        assert [b["input_ids"] for b in bodies] == [prompts[0:2], prompts[2:4], prompts[4:5]]
        assert [b["sampling_params"] for b in bodies] == [params[0:2], params[2:4], params[4:5]]
        with pytest.raises(ValueError, match=r"different n per prompt \(\[1, 2\]\).*batched=False"):
            client.generate([[1], [2]], [{"n": 1}, {"n": 2}])
        assert len(worker.app.state.bodies) == 3, "a call with mixed n must not be sent"
        assert client.generate([], {"n": 2}) == [] and len(worker.app.state.bodies) == 3


def test_batched_mode_rejects_an_answer_with_the_wrong_number_of_outputs():
    with ThreadedServer(fake_worker_app("short")) as worker, RolloutClient(worker.url) as client:
        with pytest.raises(RolloutRequestError) as err:
            client.generate([[7], [8], [9]], {"n": 2})
        message = str(err.value)
        assert "answered 5 outputs" in message and "expected 6 (3 prompts x n=2)" in message
        assert worker.url in message and "batched=False" in message


@pytest.mark.parametrize("batched", [True, False])
def test_generate_gives_up_after_max_retries_naming_server_and_request(batched):
    with (
        ThreadedServer(fake_worker_app("always_503")) as worker,
        RolloutClient(worker.url, batched=batched, max_retries=2, backoff_s=0.01) as client,
    ):
        with pytest.raises(RolloutRequestError) as err:
            client.generate([[5, 6, 7], [8]] if batched else [[5, 6, 7]], {"max_new_tokens": 3})
        message = str(err.value)
        assert worker.url in message and "failed 3 times" in message and "HTTP 503" in message
        assert "'max_new_tokens': 3" in message
        assert ("a batch of 2 prompts (4 tokens" if batched else "prompt 0 (3 tokens") in message
        assert worker.app.state.calls[(5, 6, 7)] == 3
        assert len(worker.app.state.bodies) == 3


@pytest.mark.parametrize("batched", [True, False])
def test_a_rejected_request_is_not_retried_and_the_server_message_is_kept(batched):
    with (
        ThreadedServer(fake_worker_app("reject")) as worker,
        RolloutClient(worker.url, batched=batched, max_retries=3, backoff_s=0.01) as client,
    ):
        with pytest.raises(RolloutRequestError, match="HTTP 400: sampling_params.top_p=2 must be in"):
            client.generate([[5]], {"top_p": 2})
        assert worker.app.state.calls[(5,)] == 1


def test_a_failed_prompt_cancels_the_other_requests_of_the_call():
    with (
        ThreadedServer(fake_worker_app("reject_0_hang_others")) as worker,
        RolloutClient(worker.url, batched=False, backoff_s=0.01) as client,
    ):
        start = time.monotonic()
        with pytest.raises(RolloutRequestError, match="prompt 2 .*HTTP 400"):
            client.generate([[5], [6], [0], [7]])
        assert time.monotonic() - start < 1.5, "the rejection must not wait for the slow requests"

        async def requests_still_running():
            return len(asyncio.all_tasks()) - 1  # minus this one

        assert asyncio.run_coroutine_threadsafe(requests_still_running(), client._loop).result() == 0


def test_plain_http_clients_skip_tls_setup_and_https_clients_keep_verification(monkeypatch):
    seen = []
    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kwargs: seen.append(kwargs["verify"]) or real(**kwargs))
    RolloutClient("http://127.0.0.1:1").close()
    RolloutClient("https://rollout.example:443").close()
    assert seen == [False, True]


def test_a_closed_client_says_so_and_leaves_no_unawaited_coroutine():
    client = RolloutClient("http://127.0.0.1:1")
    client.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="127.0.0.1:1 is closed"):
            client.generate([[1]])
        with pytest.raises(RuntimeError, match="is closed"):
            asyncio.run(client.agenerate([[1]]))
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_connection_errors_are_retried_until_the_server_comes_up():
    port = free_port()
    with RolloutClient(f"http://127.0.0.1:{port}", max_retries=8, backoff_s=0.1, max_backoff_s=0.3) as client:
        with (
            RolloutClient(client.base_url, max_retries=1, backoff_s=0.01) as impatient,
            pytest.raises(RolloutRequestError, match=f"127.0.0.1:{port}.*ConnectError"),
        ):
            impatient.generate([[1]])
        assert client.health() is False
        result = {}
        caller = threading.Thread(target=lambda: result.update(out=client.generate([[4, 2]])))
        caller.start()
        time.sleep(0.3)  # the first attempts hit a closed port
        with ThreadedServer(fake_worker_app("ok"), port=port):
            caller.join(timeout=20)
        assert [o.output_ids for o in result["out"]] == [[4, 0]]


# ---- end to end: a real server subprocess ------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return build_tiny_checkpoint(root / "seed0", seed=0), build_tiny_checkpoint(root / "seed1", seed=1)


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    process = RolloutServerProcess(
        checkpoints[0],
        port=0,
        max_batch_size=16,
        seed=0,
        torch_threads=1,
        log_path=tmp_path_factory.mktemp("logs") / "server.log",
        extra_args=("--weight-dirs", str(checkpoints[0].parent)),
    )  # both checkpoints
    with process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    with RolloutClient(server.url, max_retries=2, backoff_s=0.05) as c:
        yield c


def hf_logprobs(model_dir, prompt, output, temperature):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / (temperature or 1.0), -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def test_api_key_is_sent_on_every_request_and_load_and_version_helpers(checkpoints, monkeypatch):
    monkeypatch.delenv("MEGARL_ROLLOUT_API_KEY", raising=False)
    key = "s3cret-rollout-key"
    engine = GenerationEngine(str(checkpoints[0]), max_batch_size=4, seed=0)
    try:
        with ThreadedServer(create_app(engine, api_key=key)) as worker:
            with RolloutClient(worker.url, max_retries=0) as anonymous:
                assert anonymous.health()  # /health* needs no key, as in SGLang
                with pytest.raises(RolloutRequestError, match="HTTP 401") as err:
                    anonymous.generate([[2, 5, 6]], {"max_new_tokens": 2})
                assert key not in str(err.value)
            with RolloutClient(worker.url, api_key=key) as keyed:
                assert keyed.generate([[2, 5, 6]], {"max_new_tokens": 2, "ignore_eos": True})[0].output_ids
                assert keyed.get_weight_version() == "default" and keyed.flush_cache()
                assert keyed.get_load() == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
                keyed.update_weights_from_disk(str(checkpoints[0]), weight_version="v2")
                assert keyed.get_weight_version() == "v2"
            monkeypatch.setenv("MEGARL_ROLLOUT_API_KEY", key)  # the run-wide variable the server reads too
            with RolloutClient(worker.url) as from_env:
                assert from_env.get_server_info()["api_key"] == "<set>"
    finally:
        engine.close()


def test_e2e_concurrent_requests_are_batched_with_exact_logprobs(client, server, checkpoints):
    before = client.get_server_info()["engine_stats"].get("batches", 0)
    prompts = [[2] + [10 + i, 11 + i, 12 + (i % 3)] * (1 + i % 3) + [3] for i in range(8)]
    with RolloutClient(server.url, batched=False) as per_prompt:  # 8 concurrent requests, as behind a router
        outputs = per_prompt.generate(
            prompts, {"max_new_tokens": 16, "temperature": 0.8, "ignore_eos": True}, return_logprob=True
        )
    batches = client.get_server_info()["engine_stats"]["batches"] - before
    assert len(outputs) == 8 and 1 <= batches < 8, f"8 concurrent requests ran in {batches} batches"
    for prompt, out in zip(prompts[:3], outputs[:3]):
        expected = hf_logprobs(checkpoints[0], prompt, out.output_ids, 0.8)
        torch.testing.assert_close(torch.tensor(out.output_logprobs), expected, atol=LOGPROB_TOL, rtol=0)
    info = client.get_model_info()
    assert info["model_path"] == str(checkpoints[0]) and info["is_generation"]
    assert client.health() and client.health_generate() and client.flush_cache()


def test_e2e_score_gives_teacher_forced_log_probs_of_the_weights_served(client, checkpoints):
    """Log-probs of given tokens (prefill only), as the Hugging Face model computes them, per
    sequence from its start index, with the weight version that computed them."""
    sequences = [[2, 10, 11, 12, 40, 41, 42], [2, 30, 31, 50, 51, 52, 53, 54]]
    starts = [4, 3]
    scored = client.score(sequences, starts, temperature=0.7)
    assert [version for _, version in scored] == ["default", "default"]
    for seq, start, (lps, _) in zip(sequences, starts, scored):
        expected = hf_logprobs(checkpoints[0], seq[:start], seq[start:], 0.7)
        assert len(lps) == len(seq) - start
        torch.testing.assert_close(torch.tensor(lps), expected, atol=1e-5, rtol=0)


def test_e2e_malformed_requests_are_rejected_and_the_server_keeps_serving(client, server):
    response = httpx.post(f"{server.url}/generate", content=b'{"input_ids": [1,', timeout=10)
    assert response.status_code == 400
    with pytest.raises(RolloutRequestError, match="outside the model's vocabulary"):
        client.generate([[1, 500]])
    assert (
        client.generate([[2, 5, 6]], {"max_new_tokens": 3, "ignore_eos": True})[0].meta_info["completion_tokens"] == 3
    )


SENDER = textwrap.dedent("""
    import json, sys
    import torch
    import torch.multiprocessing as mp
    from safetensors.torch import load_file
    from megarl.rollout.client.client import RolloutClient
    from megarl.wire.weights_codec import serialize_named_tensors
    torch.set_num_threads(1)
    assert mp.get_sharing_strategy() == "file_descriptor"  # torch's default; the codec must not need more
    url, checkpoint = sys.argv[1], sys.argv[2]
    named = sorted(load_file(checkpoint + "/model.safetensors").items())
    with RolloutClient(url) as client:  # `named` stays alive until the server has replied
        reply = client.update_weights_from_tensor([serialize_named_tensors(named)], weight_version="step-1")
    print(json.dumps(reply))
""")


def test_e2e_weight_update_sent_from_another_process(client, server, checkpoints, tmp_path):
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    prompt = [2, 14, 15, 16, 3]
    before = client.generate([prompt], greedy)[0]
    # Files, not pipes: the sender's torch_shm_manager inherits its stdio and lives on while the
    # server stays attached to it, so a pipe would never reach EOF.
    out, err = tmp_path / "sender.out", tmp_path / "sender.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        code = subprocess.call(
            [sys.executable, "-c", SENDER, server.url, str(checkpoints[1])],
            stdout=stdout,
            stderr=stderr,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
    assert code == 0, err.read_text()[-3000:]
    assert json.loads(out.read_text().strip().splitlines()[-1])["success"]
    after = client.generate([prompt], {**greedy, "temperature": 1.0}, return_logprob=True)[0]
    after_greedy = client.generate([prompt], greedy)[0]
    assert after.meta_info["weight_version"] == "step-1"
    assert after_greedy.output_ids != before.output_ids
    expected = hf_logprobs(checkpoints[1], prompt, after.output_ids, 1.0)
    torch.testing.assert_close(torch.tensor(after.output_logprobs), expected, atol=LOGPROB_TOL, rtol=0)

    bad = serialize_named_tensors([("model.embed_tokens.weight", torch.zeros(3, 3))])
    with pytest.raises(RolloutRequestError, match="model.embed_tokens.weight"):
        client.update_weights_from_tensor(bad)
    client.release_memory_occupation(["weights"])
    with pytest.raises(RolloutRequestError, match="HTTP 503.*weights released"):
        client.generate([prompt], greedy)
    client.resume_memory_occupation(["weights"])
    client.update_weights_from_disk(str(checkpoints[1]), weight_version="step-1-disk")
    reloaded = client.generate([prompt], greedy)[0]
    assert reloaded.output_ids == after_greedy.output_ids and reloaded.meta_info["weight_version"] == "step-1-disk"


def test_launcher_reports_a_failed_start_with_the_server_log(tmp_path):
    process = RolloutServerProcess(
        tmp_path / "no-such-model", torch_threads=1, startup_timeout_s=60, log_path=tmp_path / "bad.log"
    )
    with pytest.raises(RuntimeError, match="exited with code") as err:
        process.start()
    assert "no-such-model" in str(err.value) and not process.alive()


def test_launcher_stop_leaves_no_process_behind(server):
    group = server.process.pid
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)
    server.stop()  # idempotent
