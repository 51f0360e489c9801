"""RolloutClient against a fake SGLang-shaped app (retries, errors, ordering), and end to end against
a real embedded server subprocess started by the launcher (batching, log-probs, weight updates
sent from another process, clean shutdown)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from megarl.models.tiny import build_tiny_checkpoint
from megarl.rollout.client import RolloutClient, RolloutRequestError
from megarl.rollout.launcher import RolloutServerProcess, free_port
from megarl.rollout.weights_codec import serialize_named_tensors

torch.set_num_threads(1)
LOGPROB_TOL = 1e-4


# ---- a fake SGLang worker in a thread --------------------------------------------------------------
def fake_worker_app(mode: str) -> FastAPI:
    """mode: ok | fail_once (500 on each prompt's first try) | always_503 | reject (400)."""
    app = FastAPI()
    app.state.calls = collections.Counter()

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        key = tuple(body["input_ids"])
        app.state.calls[key] += 1
        if mode == "always_503" or (mode == "fail_once" and app.state.calls[key] == 1):
            return JSONResponse({"error": {"message": "worker hiccup"}}, status_code=503 if mode == "always_503" else 500)
        if mode == "reject":
            return JSONResponse({"error": {"message": "sampling_params.top_p=2 must be in (0, 1]"}}, status_code=400)
        n = body["sampling_params"].get("n", 1)
        items = [{"text": "", "output_ids": [body["input_ids"][0], j],
                  "meta_info": {"id": f"{key}-{j}", "finish_reason": {"type": "length", "length": 2},
                                "output_token_logprobs": [[-0.5, body["input_ids"][0], None], [-0.25, j, None]]}}
                 for j in range(n)]
        return items if n > 1 else items[0]

    return app


class ThreadedServer:
    def __init__(self, app: FastAPI, port: int | None = None):
        import uvicorn

        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "fake worker did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_generate_retries_a_failing_request_and_keeps_prompt_major_order():
    with ThreadedServer(fake_worker_app("fail_once")) as worker, \
            RolloutClient(worker.url, max_retries=2, backoff_s=0.01) as client:
        outputs = client.generate([[7, 1], [8, 1], [9, 1]], {"n": 2}, return_logprob=True)
        assert [o.output_ids for o in outputs] == [[7, 0], [7, 1], [8, 0], [8, 1], [9, 0], [9, 1]]
        assert outputs[1].output_logprobs == [-0.5, -0.25] and outputs[0].finish_reason["type"] == "length"
        assert dict(worker.server.config.app.state.calls) == {(7, 1): 2, (8, 1): 2, (9, 1): 2}
        awaited = asyncio.run(client.agenerate([[3, 3]], [{"n": 1}]))  # from inside another event loop
        assert [o.output_ids for o in awaited] == [[3, 0]]


def test_generate_gives_up_after_max_retries_naming_server_and_request():
    with ThreadedServer(fake_worker_app("always_503")) as worker, \
            RolloutClient(worker.url, max_retries=2, backoff_s=0.01) as client:
        with pytest.raises(RolloutRequestError) as err:
            client.generate([[5, 6, 7]], {"max_new_tokens": 3})
        assert worker.url in str(err.value) and "3 tokens" in str(err.value) and "HTTP 503" in str(err.value)
        assert worker.server.config.app.state.calls[(5, 6, 7)] == 3


def test_a_rejected_request_is_not_retried_and_the_server_message_is_kept():
    with ThreadedServer(fake_worker_app("reject")) as worker, \
            RolloutClient(worker.url, max_retries=3, backoff_s=0.01) as client:
        with pytest.raises(RolloutRequestError, match="top_p=2 must be in"):
            client.generate([[5]], {"top_p": 2})
        assert worker.server.config.app.state.calls[(5,)] == 1


def test_connection_errors_are_retried_until_the_server_comes_up():
    port = free_port()
    with RolloutClient(f"http://127.0.0.1:{port}", max_retries=8, backoff_s=0.1, max_backoff_s=0.3) as client:
        with RolloutClient(client.base_url, max_retries=1, backoff_s=0.01) as impatient, \
                pytest.raises(RolloutRequestError, match=f"127.0.0.1:{port}.*ConnectError"):
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
    process = RolloutServerProcess(checkpoints[0], port=0, max_batch_size=16, seed=0, torch_threads=1,
                                   log_path=tmp_path_factory.mktemp("logs") / "server.log")
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
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits / (temperature or 1.0), -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def test_e2e_concurrent_requests_are_batched_with_exact_logprobs(client, checkpoints):
    before = client.get_server_info()["engine_stats"].get("batches", 0)
    prompts = [[2] + [10 + i, 11 + i, 12 + (i % 3)] * (1 + i % 3) + [3] for i in range(8)]
    outputs = client.generate(prompts, {"max_new_tokens": 16, "temperature": 0.8, "ignore_eos": True},
                              return_logprob=True)
    batches = client.get_server_info()["engine_stats"]["batches"] - before
    assert len(outputs) == 8 and 1 <= batches < 8, f"8 concurrent requests ran in {batches} batches"
    for prompt, out in zip(prompts[:3], outputs[:3]):
        expected = hf_logprobs(checkpoints[0], prompt, out.output_ids, 0.8)
        torch.testing.assert_close(torch.tensor(out.output_logprobs), expected, atol=LOGPROB_TOL, rtol=0)
    info = client.get_model_info()
    assert info["model_path"] == str(checkpoints[0]) and info["is_generation"]
    assert client.health() and client.health_generate() and client.flush_cache()


def test_e2e_malformed_requests_are_rejected_and_the_server_keeps_serving(client, server):
    response = httpx.post(f"{server.url}/generate", content=b"{\"input_ids\": [1,", timeout=10)
    assert response.status_code == 400
    with pytest.raises(RolloutRequestError, match="outside the model's vocabulary"):
        client.generate([[1, 500]])
    assert client.generate([[2, 5, 6]], {"max_new_tokens": 3, "ignore_eos": True})[0].meta_info["completion_tokens"] == 3


SENDER = textwrap.dedent("""
    import json, sys
    import torch
    import torch.multiprocessing as mp
    from safetensors.torch import load_file
    from megarl.rollout.client import RolloutClient
    from megarl.rollout.weights_codec import serialize_named_tensors
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
        code = subprocess.call([sys.executable, "-c", SENDER, server.url, str(checkpoints[1])], stdout=stdout,
                               stderr=stderr, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
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
    process = RolloutServerProcess(tmp_path / "no-such-model", torch_threads=1, startup_timeout_s=60,
                                   log_path=tmp_path / "bad.log")
    with pytest.raises(RuntimeError, match="exited with code") as err:
        process.start()
    assert "no-such-model" in str(err.value) and not process.alive()


def test_launcher_stop_leaves_no_process_behind(server):
    group = server.process.pid
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)
    server.stop()  # idempotent
