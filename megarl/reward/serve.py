"""A reference reward server: the remote endpoint's contract (remote.py) around any megarl reward.

    python -m megarl.reward.serve --port P [--host 127.0.0.1] [--function package.module:fn]
        [--api-key KEY]   (or MEGARL_REWARD_API_KEY; required unless --host is a loopback address)
        [--math-timeout-s 5] [--math-workers 4]

POST /score takes {"rows": [...]} and answers {"scores": [...], "errors": [...]}; GET /health
answers 200 once it serves. By default a row is scored by the rule verifier of its data_source
(megarl.reward.score); `--function` loads a custom reward, `fn(data_source, solution_str,
ground_truth, extra_info) -> float`, as reward.custom_function does. A row whose reward raises
(an unknown data_source included) gets a null score and the reason in `errors`; a malformed
request gets 400. Rows are scored one after another in a worker thread, so the event loop keeps
answering /health. A run points at it with reward.model.kind=remote,
reward.model.url=http://HOST:P/score.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from megarl.procs.managed import HealthProbe
from megarl.reward.registry import RewardError
from megarl.reward.remote import API_KEY_ENV
from megarl.reward.rule import make_reward_function

log = logging.getLogger(__name__)
_ROW_FIELDS = ("data_source", "response", "ground_truth")


def create_app(reward_fn=None, api_key: str | None = None) -> FastAPI:
    """`reward_fn(data_source, solution_str, ground_truth, extra_info)`; None: the rule registry."""
    from megarl.rollout.server.auth import ApiKeyMiddleware

    reward_fn = reward_fn or make_reward_function(None)
    app = FastAPI(title="megarl reference reward server")
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/score")
    async def score(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return _bad("the body is not JSON")
        rows = body.get("rows") if isinstance(body, dict) else None
        if not isinstance(rows, list):
            return _bad('expected {"rows": [...]}')
        for k, row in enumerate(rows):
            missing = [f for f in _ROW_FIELDS if not isinstance(row, dict) or not isinstance(row.get(f), str)]
            if missing:
                return _bad(f"row {k} lacks the string field(s) {missing}")
        scores, errors = await run_in_threadpool(_score_all, reward_fn, rows)
        return {"scores": scores, "errors": errors}

    return app


def _score_all(reward_fn, rows: list[dict]) -> tuple[list, list]:
    scores, errors = [], []
    for row in rows:
        try:
            value = float(
                reward_fn(row["data_source"], row["response"], row["ground_truth"], row.get("extra_info") or {})
            )
            scores.append(value)
            errors.append(None)
        except Exception as exc:  # noqa: BLE001  (the contract: a row's failure is reported, per row)
            scores.append(None)
            errors.append(f"{type(exc).__name__}: {exc}")
    return scores, errors


def _bad(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=400)


class RewardServerProcess:
    """Start `python -m megarl.reward.serve` as a subprocess and wait (polling /health) until it
    serves; stop() ends it. For tests and for runs that host their reward next to the trainer."""

    def __init__(
        self,
        port: int,
        *,
        host: str = "127.0.0.1",
        function: str | None = None,
        log_path: str | os.PathLike | None = None,
        startup_timeout_s: float = 60.0,
        env: dict | None = None,
    ):
        self.host, self.port, self.function = host, port, function
        self.log_path, self.startup_timeout_s, self.env = log_path, startup_timeout_s, env
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/score"

    def start(self) -> RewardServerProcess:
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "megarl.reward.serve", "--host", self.host, "--port", str(self.port)]
        if self.function:
            cmd += ["--function", self.function]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        finally:
            if self.log_path:
                out.close()
        deadline = time.monotonic() + self.startup_timeout_s
        with HealthProbe() as probe:  # one client for the wait (procs.HealthProbe says why)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"the reward server exited with code {self.process.returncode} while "
                        f"starting (command: {' '.join(cmd)}; log: {self.log_path})"
                    )
                if probe.ok(f"http://{self.host}:{self.port}/health"):
                    return self
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(
            f"the reward server on port {self.port} did not serve within "
            f"{self.startup_timeout_s:.0f} s (log: {self.log_path})"
        )

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> RewardServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from megarl.procs.net import is_loopback

    parser = argparse.ArgumentParser(prog="python -m megarl.reward.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--function",
        default=None,
        help="package.module:fn or path/to/file.py:fn (default: the rule verifiers by data_source)",
    )
    parser.add_argument("--api-key", default=None, help=f"default: ${API_KEY_ENV}")
    parser.add_argument("--math-timeout-s", type=float, default=None)
    parser.add_argument("--math-workers", type=int, default=None)
    args = parser.parse_args(argv)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if not api_key and not is_loopback(args.host):
        parser.error(f"--host {args.host} is reachable from other machines: set --api-key or ${API_KEY_ENV}")
    try:
        reward_fn = make_reward_function(
            args.function, math_timeout_s=args.math_timeout_s, math_workers=args.math_workers
        )
    except RewardError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO)
    uvicorn.run(create_app(reward_fn, api_key), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
