"""Run the real sglang-router (PyPI `sglang-router` 0.3.2, a Rust binary) in front of K engines.

    with RouterProcess([engine_a.url, engine_b.url], api_key=key) as router:
        client = RolloutClient(router.url)          # requests carry "Authorization: Bearer <key>"
        router.add_worker(engine_c.url)             # returns once the router routes to it
        router.remove_worker(engine_a.url)

The router runs in its own process group (start_new_session): stop() sends SIGTERM to the group,
then SIGKILL after a grace period; it is registered with atexit and safe to call twice, and the
router dies with whoever started it (megarl/procs/lifeline.py: parent-death signal). The process
renames itself `sglang::router`, so it is stopped by pid, never by name. port=0 picks a free port
(and a free Prometheus port: every router otherwise binds 29000 and a second one on the same
machine panics); a port taken between picking and binding is retried on new ones.

What sglang-router 0.3.2 does, measured here against FastAPI stub workers on 127.0.0.1
--------------------------------------------------------------------------------------
Readiness. `GET /liveness` and `GET /health` answer 200 "OK" as soon as the HTTP server is up, with
or without workers; `GET /readiness` answers 503 {"status":"not ready","reason":"insufficient
healthy workers"} until one worker is healthy, then 200 {"status":"ready","healthy_workers":N,
"total_workers":M}. Workers named by --worker-urls are registered in the background after the
server is up (~50 ms for a live worker), so start() polls /liveness, then GET /workers until each of
them is listed healthy. A /generate with no healthy worker is 503 `no_available_workers`.

Worker management at run time (the legacy `/add_worker?url=`, `/remove_worker?url=` and
`/list_workers` answer 404 in 0.3.2):
- `POST /workers` {"url": U, "api_key": K (optional)} -> 202 {"status":"accepted","worker_id":ID,
  "url":U,"location":"/workers/ID",...}; the registration is a background job. Adding a URL that is
  already registered answers 202 with the same id (the job then fails with "already exists"). A
  body without "url" is 422. The URL is not validated up front ("not a url" is accepted).
- `GET /workers` -> {"workers":[{"id","url","model_id","is_healthy","load","worker_type",
  "connection_mode","metadata",...}],"total":N,"stats":{...}}; unhealthy workers stay listed.
- `GET /workers/{ID}` -> the record; while the add job runs, or after it failed, it has
  "job_status": {"job_type":"AddWorker","status":"processing"|"failed","message":...}. ID must be
  the UUID (a URL there is 400).
- `DELETE /workers/{ID}` -> 202 (queued); gone from GET /workers within ~60 ms. An unknown ID is 404
  WORKER_NOT_FOUND. A request already in flight on the removed worker still completes (200).
- A new worker is listed healthy 40-50 ms after the POST and gets traffic right away. The add job
  first checks `GET {U}/health` (plus a gRPC probe) and retries an unreachable URL with backoff until
  --worker-startup-timeout-secs (default 1800 s), then marks the job failed.

What it asks workers. At registration: `GET /health`, then `/model_info` and `/server_info`
(falling back to `/get_model_info`, `/get_server_info`), each preceded by an HTTP/2 prior-knowledge
attempt (uvicorn logs a harmless "Invalid HTTP request received"); afterwards `GET /get_load` every
30 s and the health check every --health-check-interval-secs. Registration succeeds when only
/health and /generate exist: the info endpoints are optional (model_id is then "unknown").

--api-key K. The router then requires `Authorization: Bearer K` from its clients on /generate and on
the worker API (/workers, /get_loads) - 401 with an empty body otherwise - while /health,
/liveness, /readiness, /get_model_info, /get_server_info and /v1/models stay open. Toward workers:
workers from --worker-urls are registered with K (their /model_info, /server_info and /generate
carry "Bearer K"); a worker added with {"api_key": W} gets "Bearer W" on its probes and every /generate,
the client's header replaced; a worker added without "api_key" is probed without a key and gets the client's
Authorization header passed through (other client headers are not forwarded). Health checks
(`GET /health`) never carry a key - SGLang exempts /health* from its key check, so that works.
The key is never logged by the router. It does NOT read the key from an environment variable, and
`--api-key K` on the command line is world-readable in `ps` for the ~0.4 s before the process
renames itself. So this module never puts it there: the router is started through a three-line
`python -c` shim that parses the normal flags with sglang_router's own parser and takes the key
from the environment variable MEGARL_ROUTER_API_KEY (readable only by the same user). add_worker()
passes the same per-run key as the worker's key unless told otherwise.

A worker dying mid-request (SIGKILL of a stub while a 3 s request is in flight):
- default (5 retries): the router silently re-sends the request to another worker and the client
  sees 200 after the full second attempt - the caller never learns of the failure;
- retries also re-send a worker's 5xx or 429 answer (not 400): 5 attempts in all by default;
  --retry-max-retries N counts attempts, the first included (N=3: 3 requests reach the worker),
  and --disable-retries is N=1;
- --disable-retries: the client gets 500 {"error":{"code":"call_upstream_request_error",...}} at the
  moment the worker dies;
- with --health-check-interval-secs 1 --health-failure-threshold 1 the dead worker is listed
  is_healthy=false 0.3-1.0 s after the kill and gets no more traffic; it stays listed until removed
  and is marked healthy again when a server comes back on the same URL (~2.5 s with the default
  --health-success-threshold 2). With the default 60 s interval a dead idle worker stays "healthy"
  for up to a minute and, retries disabled, every request routed to it fails with 500.
Recommended, and the defaults here: retries off (the controller retries and counts every retry in
`rollout/retries`), health checks every few seconds with a small failure threshold so a dead engine
stops receiving traffic quickly, and the manager removes dead engines explicitly (remove_worker).
Not measured: the circuit breaker (by default it opens after 10 failures of one worker within
120 s and skips that worker for 60 s); --disable-circuit-breaker turns it off if that hidden
exclusion gets in the controller's way. Also not measured: SGLang's /health generates one token
when the engine is idle, so a colocated engine whose memory is released during training may fail
health checks and be marked unhealthy until it resumes (one success brings it back with the
health_success_threshold=1 used here).

Routing. One /generate is one routing decision under round_robin and cache_aware alike: a request with
sampling_params.n = 4 goes whole to one worker (n kept), and a batched request (input_ids = list of
lists) goes whole to one worker - the router never splits a batch, so clients that want K engines
busy send one request per prompt. round_robin spreads requests in turn, the same prompt included.
cache_aware: concurrent requests with the same prompt (input_ids or text) stay on one worker while
distinct prompts spread evenly by load (60 concurrent requests over 3 prompts: each prompt wholly on
one worker; 100 distinct: 33/33/34), so repeats of a prompt (multi-turn continuations) land where
its KV prefix is cached. But prompts that share a prefix (a chat template, a system prompt) are
herded together: benchmarks/bench_rollout.py --mesh measured a 3:1 split over two engines for 64
chat prompts, where power_of_two gave 720/816 and round_robin 768/768 and twice one engine's
tokens/s. The n samples of a GRPO prompt travel in one request whatever the policy, so the trainer
defaults to round_robin (rollout.router_policy). power_of_two (load-aware) refuses to start with
fewer than 2 workers ("Power-of-two policy requires at least 2 workers"), and a fleet may be down
to one engine while another restarts. Strictly sequential requests to idle
workers all go to the same worker under cache_aware.

The router re-serialises /generate bodies with extra default fields ("model": null, "stream": false,
...), which the server accepts; docs/rollout.md lists what else it changes.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import time
from pathlib import Path

import httpx

from megarl.procs import lifeline
from megarl.procs.managed import HealthProbe, ManagedProcess, PortTaken, new_log_file
from megarl.procs.net import free_port
from megarl.rollout.fleet.sglang_launch import sglang_python

API_KEY_ENV = "MEGARL_ROUTER_API_KEY"
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")

# Parses the ordinary router flags with sglang_router's own parser and adds the API key from the
# environment, so the key never appears in the world-readable command line.
_ENTRY = (
    "import os, sys\n"
    "from sglang_router.launch_router import launch_router, parse_router_args\n"
    "args = parse_router_args(sys.argv[1:])\n"
    f"args.api_key = os.environ.pop({API_KEY_ENV!r}, None) or None\n"
    "launch_router(args)\n"
)


class RouterProcess(ManagedProcess):
    def __init__(
        self,
        worker_urls: tuple[str, ...] | list[str] = (),
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        prometheus_port: int = 0,
        policy: str = "round_robin",
        api_key: str | None = None,
        max_retries: int = 0,
        health_check_interval_s: int = 5,
        health_failure_threshold: int = 2,
        health_success_threshold: int = 1,
        health_check_timeout_s: int = 5,
        health_check_endpoint: str = "/health",
        worker_startup_timeout_s: int = 600,
        request_timeout_s: int = 1800,
        log_level: str = "info",
        extra_args: tuple[str, ...] = (),
        log_path: str | os.PathLike | None = None,
        startup_timeout_s: float = 60.0,
        python: str | None = None,  # None: sglang_python(), the interpreter SGLang's servers run under
    ):
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r} is not one of {', '.join(POLICIES)}")
        if max_retries < 0:
            raise ValueError(f"router max_retries={max_retries} must be >= 0 (0 turns the router's retries off)")
        self.initial_workers = [_normalise(u) for u in worker_urls]
        self.host, self.requested_port, self.requested_prometheus_port = host, port, prometheus_port
        self.port: int | None = None
        self.prometheus_port: int | None = None
        self.api_key = api_key
        self.options = {
            "--policy": policy,
            "--health-check-interval-secs": health_check_interval_s,
            "--health-failure-threshold": health_failure_threshold,
            "--health-success-threshold": health_success_threshold,
            "--health-check-timeout-secs": health_check_timeout_s,
            "--health-check-endpoint": health_check_endpoint,
            "--worker-startup-timeout-secs": worker_startup_timeout_s,
            "--request-timeout-secs": request_timeout_s,
            "--log-level": log_level,
        }
        # --retry-max-retries counts attempts, the first included; --disable-retries is one attempt.
        self.retry_args = ["--disable-retries"] if max_retries == 0 else ["--retry-max-retries", str(max_retries + 1)]
        self.extra_args, self.startup_timeout_s = list(extra_args), startup_timeout_s
        self.python = python or sglang_python()
        self.log_path = Path(log_path) if log_path else new_log_file("megarl-router-")
        self.process: subprocess.Popen | None = None
        # one client for every control call and probe (procs.HealthProbe says why: ~58 ms of CPU
        # for each httpx.get / httpx.request, and the waits below poll every 20-50 ms)
        self._http = HealthProbe(timeout_s=10.0)

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the router is not started; call start() first")
        return f"http://{self.host}:{self.port}"

    def flags(self) -> list[str]:
        """The `python -m sglang_router.launch_router` flags; never the API key, so safe to log."""
        flags = [
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--prometheus-host",
            self.host,
            "--prometheus-port",
            str(self.prometheus_port),
        ]
        if self.initial_workers:
            flags += ["--worker-urls", *self.initial_workers]
        for flag, value in self.options.items():
            flags += [flag, str(value)]
        return flags + self.retry_args + self.extra_args

    def command(self) -> list[str]:
        return [self.python, "-c", _ENTRY, *self.flags()]

    def start(self) -> RouterProcess:
        if self.alive():
            raise RuntimeError(f"the router at {self.url} is already running (pid {self.process.pid})")
        picks_ports = self.requested_port == 0 or self.requested_prometheus_port == 0
        attempts = 3 if picks_ports else 1
        for attempt in range(attempts):
            self.port = self.requested_port or free_port(self.host)
            self.prometheus_port = self.requested_prometheus_port or free_port(self.host)
            self._spawn()
            try:
                self._wait_until_ready()
                return self
            except PortTaken:
                if attempt == attempts - 1:
                    raise RuntimeError(
                        f"the router could not bind its ports after {attempts} tries "
                        f"(port {self.port}, prometheus port {self.prometheus_port}); "
                        f"log tail from {self.log_path}:\n{self.log_tail()}"
                    ) from None

    def _spawn(self) -> None:
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                lifeline.guarded(self.command()),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        atexit.register(self.stop)

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not self._answers("/liveness"):
            self._fail_if_exited()
            if time.monotonic() > deadline:
                self._startup_timeout("did not answer /liveness")
            time.sleep(0.05)
        # Workers given on the command line register in the background after the server is up.
        while missing := self._unhealthy_initial_workers():
            self._fail_if_exited()
            if time.monotonic() > deadline:
                self._startup_timeout(f"had not registered {', '.join(missing)} as healthy")
            time.sleep(0.05)

    def _answers(self, path: str) -> bool:
        return self._http.ok(self.url + path, timeout_s=2.0)

    def _unhealthy_initial_workers(self) -> list[str]:
        health = self.worker_health()
        return [u for u in self.initial_workers if not health.get(u)]

    def _fail_if_exited(self) -> None:
        code = self.process.poll()
        if code is None:
            return
        tail = self.log_tail()
        self.stop()
        if "address already in use" in tail.lower():
            raise PortTaken()
        raise RuntimeError(
            f"sglang-router exited with code {code} during startup (flags: "
            f"{' '.join(self.flags())}); last log lines from {self.log_path}:\n{tail}"
        )

    def _startup_timeout(self, what: str) -> None:
        tail = self.log_tail()
        url = self.url
        self.stop()
        raise TimeoutError(
            f"sglang-router at {url} {what} within {self.startup_timeout_s:.0f}s; "
            f"last log lines from {self.log_path}:\n{tail}"
        )

    # --- workers -------------------------------------------------------------------------------

    def workers(self) -> list[str]:
        """URLs of every registered worker, healthy or not."""
        return list(self.worker_health())

    def worker_health(self) -> dict[str, bool]:
        return {w["url"]: bool(w["is_healthy"]) for w in self._worker_records()}

    def add_worker(self, url: str, *, api_key: str | None = None, timeout_s: float = 60.0) -> str:
        """Register `url` and return its router id once the router routes to it.

        api_key is the key the router presents to this worker, the router's own key by default
        (one key per run): without one the router probes the worker unauthenticated.
        """
        url = _normalise(url)
        registered = {w["url"]: w["id"] for w in self._worker_records()}
        if url in registered:  # the router would queue a job that fails with "already exists"
            return registered[url]
        key = api_key or self.api_key
        body = {"url": url} | ({"api_key": key} if key else {})
        worker_id = self._request("POST", "/workers", json=body).json()["worker_id"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            record = self._request("GET", f"/workers/{worker_id}").json()
            job = record.get("job_status") or {}
            if job.get("status") == "failed" and job.get("job_type") == "AddWorker":
                raise RuntimeError(
                    f"the router could not register worker {url}: {job.get('message')}; "
                    f"check that {url}/health answers 200 from the router's host"
                )
            if record.get("is_healthy") and not job:
                return worker_id
            time.sleep(0.02)
        self._request("DELETE", f"/workers/{worker_id}")  # drop the pending job, it would keep retrying
        raise TimeoutError(
            f"the router did not register worker {url} within {timeout_s:.0f}s; "
            f"check that {url}/health answers 200 from the router's host"
        )

    def remove_worker(self, url: str, *, timeout_s: float = 10.0) -> None:
        """Deregister `url`; requests already running on it finish, new ones go elsewhere."""
        url = _normalise(url)
        ids = {w["url"]: w["id"] for w in self._worker_records()}
        if url not in ids:
            raise ValueError(
                f"worker {url} is not registered with the router at {self.url}; registered: {sorted(ids) or 'none'}"
            )
        self._request("DELETE", f"/workers/{ids[url]}")
        deadline = time.monotonic() + timeout_s
        while url in self.workers():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router at {self.url} still lists {url} {timeout_s:.0f}s after removing it")
            time.sleep(0.02)

    def _worker_records(self) -> list[dict]:
        return self._request("GET", "/workers").json()["workers"]

    def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        response = self._http.client.request(method, self.url + path, headers=headers, **kwargs)
        if response.status_code >= 400:
            raise RuntimeError(
                f"sglang-router {method} {path} answered {response.status_code}: "
                f"{response.text[:300] or '(empty body)'}"
            )
        return response

    # --- lifecycle -----------------------------------------------------------------------------


def _normalise(url: str) -> str:
    # The router stores URLs verbatim; one spelling keeps add/remove/list consistent.
    return url.rstrip("/")
