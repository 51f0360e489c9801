"""Tie a child process's life to its parent's: when the parent dies, even by SIGKILL, so does it.

Servers and the router run in their own session (start_new_session) so that stop() can take their
whole group down, which also means nothing takes them down when whoever started them is killed
without a chance to clean up (a SIGKILL'd driver, an OOM-killed Ray actor): they would serve on,
holding ports, memory and GPUs. Linux's parent-death signal closes that gap:

    cmd = lifeline.guarded([sys.executable, "-m", "megarl.rollout.server", ...])
    subprocess.Popen(cmd, start_new_session=True, ...)   # SIGKILLed when this process dies

`guarded` prefixes the command with this file (run as a script), which sets prctl(PR_SET_PDEATHSIG, SIGKILL),
checks the parent is still the one that spawned it (it may have died before the prctl: the signal
would then never come), and execs the command; the setting survives the exec (not into a setuid
program), so the pid stays the server's. Processes that a guarded process spawns itself in Python
(TP follower ranks) call `die_with_parent` at their start instead.

The kernel sends the signal when the *thread* that forked the child exits, not the process: so a
child may only be guarded when spawned from the main thread (Ray runs a synchronous actor's
methods there); from any other thread `guarded` leaves the command as it is, and the caller's
ordinary stop() remains its only way down. Elsewhere than Linux the guard is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def supported() -> bool:
    return sys.platform.startswith("linux")


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent (thread) exits. If the parent is
    no longer `expected_parent` it already died: die now. Returns False where unsupported."""
    if not supported():
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != expected_parent:  # the parent died before the prctl: no signal will come
        os.kill(os.getpid(), sig)
        os._exit(128 + int(sig))  # only reached for a signal this process handles
    return True


def guarded(cmd: list[str]) -> list[str]:
    """`cmd`, run so that it is SIGKILLed when this process dies (see the module docstring)."""
    if not supported():
        return list(cmd)
    if threading.current_thread() is not threading.main_thread():
        log.debug(
            "not guarding %s: spawned from thread %s, whose exit would kill it",
            cmd[:3],
            threading.current_thread().name,
        )
        return list(cmd)
    # run by path, isolated (-I: no PYTHONPATH, no script dir on sys.path; -S: no site), so it
    # needs no environment and starts in milliseconds; the command gets the environment as given
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), "--", *cmd]


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.exit(f"usage: python {os.path.basename(__file__)} PARENT_PID -- COMMAND [ARGS...]")
    die_with_parent(int(argv[0]))
    cmd = argv[2:]
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        sys.exit(f"megarl lifeline: cannot run {cmd[0]!r}: {exc}")


if __name__ == "__main__":
    main(sys.argv[1:])
