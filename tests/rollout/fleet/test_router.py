"""The real sglang-router (the Rust binary from PyPI) in front of small FastAPI stub workers."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
import uvicorn
from fastapi import FastAPI, Request

from megarl.rollout.fleet.router import API_KEY_ENV, RouterProcess
from tests._http import ThreadedServer

KEY = "per-run-test-key"


def stub_app(name: str, seen: list) -> FastAPI:
    """A worker that answers what the router asks and records every request it gets."""
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next):
        body = await request.body()
        seen.append({"path": request.url.path, "auth": request.headers.get("authorization"), "body": body})
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return {"model_path": "stub", "tokenizer_path": None, "is_generation": True}

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info():
        return {"dp_size": 1}

    @app.post("/generate")
    async def generate(request: Request):
        rid = (await request.json()).get("rid") or ""
        if rid.startswith("sleep-"):  # lets a test keep a request in flight
            await asyncio.sleep(float(rid.removeprefix("sleep-")))
        return {"text": name, "output_ids": [1], "meta_info": {"id": name, "finish_reason": {"type": "length"}}}

    return app


class ThreadStub(ThreadedServer):
    """A stub worker served by uvicorn in a thread of the test process."""

    def __init__(self, name: str):
        self.name, self.seen = name, []
        super().__init__(stub_app(name, self.seen))
        self.start()

    def generates(self) -> list[dict]:
        return [json.loads(r["body"]) for r in self.seen if r["path"] == "/generate"]


def serve_stub_process(name: str, port: int) -> None:
    """Entry point of a stub worker in its own process (the one test that SIGKILLs a worker)."""
    uvicorn.run(stub_app(name, []), host="127.0.0.1", port=port, log_level="warning")


@pytest.fixture(scope="module")
def stubs():
    workers = [ThreadStub(f"w{i}") for i in range(5)]
    yield workers
    for w in workers:
        w.stop()


@pytest.fixture
def fresh(stubs):
    for w in stubs:
        w.seen.clear()
    return stubs


@pytest.fixture(scope="module")
def rr_router(stubs, tmp_path_factory):
    with RouterProcess(
        [stubs[0].url, stubs[1].url], policy="round_robin", log_path=tmp_path_factory.mktemp("router") / "rr.log"
    ) as router:
        yield router


@pytest.fixture(scope="module")
def key_router(stubs, tmp_path_factory):
    with RouterProcess(
        [stubs[2].url], api_key=KEY, policy="round_robin", log_path=tmp_path_factory.mktemp("router") / "key.log"
    ) as router:
        yield router


def generate(url: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=30, **kwargs)


def test_round_robin_spreads_requests(rr_router, fresh):
    answers = [generate(rr_router.url, {"input_ids": [1, 2, 3]}).json()["text"] for _ in range(4)]
    assert sorted(answers) == ["w0", "w0", "w1", "w1"]
    assert fresh[0].generates()[0]["input_ids"] == [1, 2, 3]


def test_n_samples_and_batches_go_whole_to_one_worker(rr_router, fresh):
    generate(rr_router.url, {"input_ids": list(range(50)), "sampling_params": {"n": 4, "max_new_tokens": 2}})
    received = fresh[0].generates() + fresh[1].generates()
    assert len(received) == 1 and received[0]["sampling_params"]["n"] == 4

    batch = [[i, i + 1] for i in range(6)]
    generate(rr_router.url, {"input_ids": batch})
    received = fresh[0].generates() + fresh[1].generates()
    assert len(received) == 2 and [r["input_ids"] for r in received].count(batch) == 1


def test_add_and_remove_worker_at_run_time(rr_router, fresh):
    extra = fresh[3]
    rr_router.add_worker(extra.url + "/")  # one spelling of a URL, whatever the caller passes
    assert sorted(rr_router.workers()) == sorted([fresh[0].url, fresh[1].url, extra.url])
    assert rr_router.add_worker(extra.url) is not None  # adding twice is harmless
    answers = {generate(rr_router.url, {"input_ids": [1]}).json()["text"] for _ in range(3)}
    assert answers == {"w0", "w1", "w3"}

    rr_router.remove_worker(extra.url)
    assert extra.url not in rr_router.workers()
    answers = {generate(rr_router.url, {"input_ids": [1]}).json()["text"] for _ in range(4)}
    assert answers == {"w0", "w1"}
    with pytest.raises(ValueError, match="is not registered"):
        rr_router.remove_worker(extra.url)


def test_two_routers_on_one_machine(rr_router, key_router):
    assert rr_router.alive() and key_router.alive()
    assert rr_router.prometheus_port != key_router.prometheus_port
    assert generate(rr_router.url, {"input_ids": [1]}).status_code == 200
    assert (
        generate(key_router.url, {"input_ids": [1]}, headers={"Authorization": f"Bearer {KEY}"}).json()["text"] == "w2"
    )


def test_api_key_guards_the_router_and_reaches_workers(key_router, fresh):
    assert generate(key_router.url, {"input_ids": [1]}).status_code == 401
    assert generate(key_router.url, {"input_ids": [1]}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(key_router.url + "/workers").status_code == 401
    assert httpx.get(key_router.url + "/health").status_code == 200  # probes stay open

    assert generate(key_router.url, {"input_ids": [1]}, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert [r["auth"] for r in fresh[2].seen if r["path"] == "/generate"] == [f"Bearer {KEY}"]

    # A worker added at run time is registered with the same key (its probes carry it too).
    late = fresh[4]
    key_router.add_worker(late.url)
    assert {r["auth"] for r in late.seen if r["path"] in ("/model_info", "/server_info")} == {f"Bearer {KEY}"}
    key_router.remove_worker(late.url)

    # The key is not on the command line, and the router removed it from its environment.
    assert KEY not in " ".join(key_router.command())
    assert KEY.encode() not in open(f"/proc/{key_router.process.pid}/cmdline", "rb").read()
    assert API_KEY_ENV not in os.environ


def test_startup_error_quotes_the_log(tmp_path):
    router = RouterProcess(extra_args=("--no-such-flag",), log_path=tmp_path / "bad.log")
    with pytest.raises(RuntimeError, match="(?s)exited with code.*no-such-flag"):
        router.start()
    assert not router.alive()


def test_stop_leaves_no_process_behind(stubs, tmp_path):
    router = RouterProcess([stubs[0].url], log_path=tmp_path / "r.log").start()
    pids = [router.process.pid] + [c.pid for c in psutil.Process(router.process.pid).children(recursive=True)]
    router.stop()
    router.stop()  # safe twice
    assert not [p for p in pids if psutil.pid_exists(p)]


def test_dead_worker_fails_the_request_when_router_retries_are_off(stubs, tmp_path):
    """Retries off (the default here): the caller sees the failure; the health check drops the worker."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    doomed = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from tests.rollout.fleet.test_router import serve_stub_process; serve_stub_process('doomed', {port})",
        ],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    doomed_url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                httpx.get(doomed_url + "/health", timeout=1)
                break
            except httpx.TransportError:
                assert doomed.poll() is None, "the stub worker process died at start"
                time.sleep(0.05)
        with RouterProcess(
            [stubs[0].url, doomed_url],
            policy="round_robin",
            health_check_interval_s=1,
            health_failure_threshold=1,
            log_path=tmp_path / "r.log",
        ) as router:
            results = []
            slow = [
                threading.Thread(
                    target=lambda: results.append(generate(router.url, {"input_ids": [1], "rid": "sleep-1.5"}))
                )
                for _ in range(2)
            ]  # round robin: one on each worker
            for t in slow:
                t.start()
            time.sleep(0.5)
            os.killpg(doomed.pid, signal.SIGKILL)
            for t in slow:
                t.join()
            assert sorted(r.status_code for r in results) == [200, 500]
            assert [r.json()["text"] for r in results if r.status_code == 200] == ["w0"]

            deadline = time.monotonic() + 5
            while router.worker_health()[doomed_url]:
                assert time.monotonic() < deadline, "the router never marked the dead worker unhealthy"
                time.sleep(0.05)
            router.remove_worker(doomed_url)
            assert router.workers() == [stubs[0].url]
    finally:
        if doomed.poll() is None:
            os.killpg(doomed.pid, signal.SIGKILL)
        doomed.wait()
