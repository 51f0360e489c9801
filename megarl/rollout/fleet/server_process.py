"""Start and stop the embedded rollout server as a subprocess.

    with RolloutServerProcess(model_path, max_batch_size=16) as server:
        client = RolloutClient(server.url)

The server runs in its own process group (start_new_session), so stop() can take down everything
it spawned: SIGTERM to the group, then SIGKILL after a grace period. stop() is also registered
with atexit, so an exception or a normal interpreter exit never leaves a server behind, and the
server is started under megarl/procs/lifeline.py's parent-death signal, so a SIGKILL of the parent (a killed
driver or Ray actor) takes it down too. port=0 picks a
free port here (never one of `avoid_ports`) and passes it on; if another process grabs it first,
start() retries on a new one.
Output goes to a log file whose last lines are quoted in every startup error.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from pathlib import Path

import megarl
from megarl.procs import lifeline
from megarl.procs.managed import HealthProbe, ManagedProcess, PortTaken, new_log_file
from megarl.procs.net import free_port

_PACKAGE_ROOT = str(Path(megarl.__file__).resolve().parent.parent)


class RolloutServerProcess(ManagedProcess):
    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_batch_size: int = 32,
        seed: int | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        torch_threads: int | None = None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        startup_timeout_s: float = 180.0,
        python: str = sys.executable,
    ):
        self.model_path, self.host, self.requested_port = str(model_path), host, port
        self.port: int | None = None
        self.options = {
            "--max-batch-size": max_batch_size,
            "--seed": seed,
            "--device": device,
            "--dtype": dtype,
            "--torch-threads": torch_threads,
        }
        self.extra_args, self.python, self.startup_timeout_s = list(extra_args), python, startup_timeout_s
        self.env = env
        # ports a picked free port must not be (EngineLauncher: its earlier servers' ports)
        self.avoid_ports: set[int] = set()
        self.log_path = Path(log_path) if log_path else new_log_file("megarl-rollout-server-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the rollout server is not started; call start() first")
        return f"http://{self.host}:{self.port}"

    def command(self, port: int) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "megarl.rollout.server",
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(port),
        ]
        for flag, value in self.options.items():
            if value is not None:
                cmd += [flag, str(value)]
        return cmd + self.extra_args

    def start(self) -> RolloutServerProcess:
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"the rollout server at {self.url} is already running (pid {self.process.pid})")
        attempts = 3 if self.requested_port == 0 else 1
        for attempt in range(attempts):
            self.port = self.requested_port or free_port(self.host, self.avoid_ports)
            self._spawn()
            try:
                self._wait_until_healthy()
                return self
            except PortTaken:
                if attempt == attempts - 1:
                    raise RuntimeError(
                        f"could not bind a free port after {attempts} tries; log tail:\n{self.log_tail()}"
                    ) from None

    def _spawn(self) -> None:
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                lifeline.guarded(self.command(self.port)),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        atexit.register(self.stop)

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with HealthProbe() as probe:
            while time.monotonic() < deadline:
                if self._healthy_or_failed(probe):
                    return
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(
            f"rollout server at {self.url} was not healthy within {self.startup_timeout_s:.0f}s; "
            f"last log lines from {self.log_path}:\n{self.log_tail()}"
        )

    def _healthy_or_failed(self, probe: HealthProbe) -> bool:
        """True once /health answers; raises if the process exited (PortTaken for a lost port)."""
        code = self.process.poll()
        if code is not None:
            tail = self.log_tail()
            self.stop()
            if "address already in use" in tail.lower():
                raise PortTaken()
            raise RuntimeError(
                f"rollout server exited with code {code} during startup "
                f"(command: {' '.join(self.command(self.port))}); last log lines "
                f"from {self.log_path}:\n{tail}"
            )
        return probe.ok(f"{self.url}/health")
