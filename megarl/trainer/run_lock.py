"""One live run per run dir: an exclusive `flock` on RUN_DIR/.lock, held by the driver.

The kernel drops the lock when the driver dies, however it dies (SIGKILL included), so a stale lock
never blocks a resume. The file says who holds it (pid, host, command, start time), so a refused
run can name the other one. The descriptor is not inherited by the processes the driver starts
(Python opens files close-on-exec). flock on NFS is advisory at best: on a shared file system run
dirs of concurrent runs should differ anyway (trainer.experiment_name).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_FILE = ".lock"


class RunDirBusy(RuntimeError):
    """Another live run holds the run dir."""


class RunDirLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirBusy(
                f"run dir {self.path.parent} is in use by another live run: {holder}; wait for it or "
                "stop it, or give this run its own trainer.experiment_name / trainer.output_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(
            fd,
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "command": " ".join(sys.argv),
                }
            ).encode(),
        )
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        info = {}
    if not info:
        return "a process that has not written its name yet"
    return f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}: {info.get('command')}"
