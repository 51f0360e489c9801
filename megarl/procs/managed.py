"""Process-group helpers shared by the server and router launchers (one place for stop semantics).

Servers run in their own session (start_new_session), so stopping one signals its whole group:
SIGTERM, then SIGKILL after a grace period, which also takes whatever it left behind (TP ranks).
"""

from __future__ import annotations

import abc
import atexit
import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path

import httpx
import psutil

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class PortTaken(Exception):
    """The port picked as free was taken before the process bound it: pick another."""


def stop_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM `process`'s group, SIGKILL it after `grace_s` (also anything left in the group)."""
    signal_group(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    signal_group(process.pid, signal.SIGKILL)
    process.wait()


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group is already gone
        pass


def new_log_file(prefix: str) -> Path:
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
    os.close(fd)
    return Path(path)


def log_tail(path: Path, lines: int = 40) -> str:
    """The last lines of a log, colour codes removed; quoted in every startup error."""
    try:
        text = _ANSI.sub("", Path(path).read_text(errors="replace"))
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    return "\n".join(text.splitlines()[-lines:])


class HealthProbe:
    """GET a URL until it answers 200, over one HTTP client for the whole wait.

    A start-up wait polls a few times a second for as long as a server takes to import and load
    (tens of seconds on a busy CPU). `httpx.get` builds a new client, and with it an SSL context,
    on every call: ~58 ms of CPU a probe, measured, so a launcher polling every 0.2 s used a
    third of a core while the server it waited for was starting on the same cores. One client:
    ~0.4 ms a probe. Use it as a context manager (the client is closed at the end)."""

    def __init__(self, timeout_s: float = 2.0):
        self.client = httpx.Client(timeout=timeout_s)

    def ok(self, url: str, timeout_s: float | None = None) -> bool:
        try:
            kwargs = {} if timeout_s is None else {"timeout": timeout_s}
            return self.client.get(url, **kwargs).status_code == 200
        except httpx.TransportError:
            return False

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> HealthProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ManagedProcess(abc.ABC):
    """stop / alive / log_tail / `with` for a launcher that keeps its Popen in `self.process` and
    its log in `self.log_path`; subclasses implement start()."""

    process: subprocess.Popen | None = None
    log_path: Path

    @abc.abstractmethod
    def start(self):
        """Spawn the process and return self once it serves."""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s`; safe to call twice."""
        atexit.unregister(self.stop)
        process, self.process = self.process, None
        if process is not None:
            stop_group(process, grace_s)

    def alive(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            return False
        # poll() can miss a fresh death (it answers None when it cannot take Popen's waitpid
        # lock); a zombie is dead whatever poll says (seen in Ray actors right after a SIGKILL)
        try:
            return psutil.Process(self.process.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
