"""Reaper: a small process that outlives a SIGKILL'd driver just long enough to stop its run.

A local Ray cluster's gcs_server and raylet die with the driver (Ray starts them under a
parent-death signal), and its workers notice the raylet is gone within seconds. Ray's dashboard
and runtime-env agents do not: they see the raylet die, then try to tell the (dead) GCS about it
and give up only after a 60 s RPC timeout (measured: 61 s after a driver SIGKILL). Nothing in the
driver can run after a SIGKILL, so a separate process does the cleanup:

    reaper = Reaper.start(exclude={...children that are not this run's...})  # before ray.init
    ...
    reaper.stop()            # after an orderly shutdown: the reaper exits and kills nothing

While the driver lives, the reaper polls the driver's process tree (every POLL_S) and remembers
each descendant by pid and start time; start() returns once it has looked the first time. When the driver dies (its end of a pipe closes without a
"done", or its pid is gone) the reaper SIGKILLs every remembered process still running, then
exits. Only processes that were the driver's descendants are touched, each checked against its
start time, so a reused pid is never hit. The file is run by path with `python -I`, so it needs
only the standard library and psutil, not the driver's PYTHONPATH.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys

logger = logging.getLogger(__name__)

POLL_S = 0.5
DONE = b"done\n"
READY = b"ready\n"


class Reaper:
    """The driver's handle on its reaper process."""

    def __init__(self, process: subprocess.Popen, write_fd: int):
        self.process, self._write_fd = process, write_fd

    @classmethod
    def start(cls, exclude: set[int] = frozenset(), poll_s: float = POLL_S) -> "Reaper":
        read_fd, write_fd = os.pipe()  # the write end stays in this process only (not inheritable)
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()),
                 ",".join(str(p) for p in sorted(exclude)), str(poll_s)],
                stdin=read_fd, stdout=subprocess.PIPE, start_new_session=True)
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        with process.stdout:  # "ready" once it has seen this process's children: from now on it watches
            ready = process.stdout.readline()
        if ready != READY:
            os.close(write_fd)
            process.kill()
            process.wait()
            raise RuntimeError(f"the reaper process ({__file__}) did not start (it said {ready!r}); "
                               "its error is above")
        return cls(process, write_fd)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Orderly shutdown is done: the reaper exits without killing anything. Idempotent."""
        if self._write_fd is None:
            return
        fd, self._write_fd = self._write_fd, None
        try:
            os.write(fd, DONE)
        except OSError:
            pass  # the reaper is gone already
        finally:
            os.close(fd)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        if code != 0:
            logger.warning("the reaper process exited with status %s (its error is above): a SIGKILL of this "
                           "process would have left Ray's agents running for a minute", code)


# ---- the reaper process ----------------------------------------------------------------------------

def _watch(driver_pid: int, exclude: set[int], poll_s: float) -> None:
    import psutil

    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return
    exclude = exclude | {os.getpid()}
    known: dict[tuple[int, float], psutil.Process] = {}
    message, told_ready = b"", False
    while _alive(driver):
        try:
            for child in driver.children():
                if child.pid not in exclude:  # nor its descendants: not started by this run
                    for process in (child, *child.children(recursive=True)):
                        known.setdefault((process.pid, process.create_time()), process)
        except psutil.Error:
            pass  # the driver (or a child being listed) just died: seen on the next check
        if not told_ready:
            os.write(sys.stdout.fileno(), READY)
            told_ready = True
        readable, _, _ = select.select([sys.stdin.fileno()], [], [], poll_s)
        if readable:
            chunk = os.read(sys.stdin.fileno(), 64)
            message += chunk
            if message.startswith(DONE):
                return  # orderly shutdown: nothing to do
            if not chunk:
                break  # the driver's end closed without "done": it died
    for process in known.values():
        try:
            if process.is_running():  # False (and no signal) for a pid reused by another process
                process.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def _alive(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(argv: list[str]) -> None:
    driver_pid, exclude, poll_s = int(argv[0]), {int(p) for p in argv[1].split(",") if p}, float(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the driver to handle
    _watch(driver_pid, exclude, poll_s)


if __name__ == "__main__":
    main(sys.argv[1:])
