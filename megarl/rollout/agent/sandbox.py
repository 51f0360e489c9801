"""Run untrusted Python in a separate, confined process: the agent loop's `python` tool.

    result = run_python("print(6 * 7)", SandboxLimits(timeout_s=5))
    result.stdout == "42\n", result.ok

What confines it (sandbox_child.py applies 1-3 in the child before the program's first line):

1. No network. `isolation="auto"` (the default) applies both layers it can and refuses to run
   the program when neither took effect (SandboxUnavailable):
   - a network namespace of its own (unshare(CLONE_NEWUSER | CLONE_NEWNET)): no interface but a
     loopback that is down, so connect() fails even to 127.0.0.1. Needs unprivileged user
     namespaces (the test hosts: yes, root or not; Docker's default seccomp profile refuses
     unshare, so a typical container gets only the second layer);
   - a seccomp filter: socket() fails with EPERM for every address family, and nothing is
     inherited but stdout/stderr pipes (close_fds), so the program has no socket to talk through.
     Also denied: io_uring_setup, setsid, setpgid. Works wherever seccomp filters may be installed
     (Docker allows them; an x86_64 or aarch64 kernel).
   "netns" or "seccomp" require that one layer; "none" runs without either (trusted code only).
2. Limits: RLIMIT_CPU `cpu_s` per process (SIGXCPU, then SIGKILL), RLIMIT_AS `memory_mb` (an
   allocation beyond it raises MemoryError), RLIMIT_FSIZE `file_mb` per written file.
3. Its own session and process group (start_new_session), which its children inherit and - with
   setsid/setpgid denied by the seccomp layer - cannot leave.

The parent keeps `max_output_bytes` of stdout and of stderr and kills the process as soon as either
produces more (output_truncated); it kills the process at `timeout_s` wall-clock (timed_out);
and whatever happened, once the program's process exits or is killed, SIGKILL goes to the whole
process group before the exit status is collected, and the call returns once none of the group
is left running, so no child outlives the call (a background child, a fork bomb). The program runs in a fresh temporary directory (its cwd and HOME, removed
afterwards) with a minimal environment, under `python -I` (no user site-packages, no PYTHONPATH).
Not confined: reading files the user running the trainer can read; CPU use of many children
within the wall-clock timeout (each has its own RLIMIT_CPU).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CHILD = Path(__file__).with_name("sandbox_child.py")
ISOLATION = ("auto", "netns", "seccomp", "none")
_LAYERS = {"auto": ("netns", "seccomp"), "netns": ("netns",), "seccomp": ("seccomp",), "none": ()}


class SandboxUnavailable(RuntimeError):
    """The required network isolation could not be set up on this host."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock, the whole run
    cpu_s: int = 5  # CPU seconds per process (RLIMIT_CPU)
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    max_output_bytes: int = 4096  # kept of stdout and of stderr each; more kills the process
    file_mb: int = 16  # the largest file it may write (RLIMIT_FSIZE)
    isolation: str = "auto"  # network: auto | netns | seccomp | none (module doc)

    def __post_init__(self):
        if self.isolation not in ISOLATION:
            raise ValueError(f"sandbox isolation {self.isolation!r} is not one of {ISOLATION}")
        for name in ("timeout_s", "cpu_s", "memory_mb", "max_output_bytes", "file_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sandbox {name}={getattr(self, name)} must be > 0")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal
    timed_out: bool = False
    output_truncated: bool = False
    wall_s: float = 0.0
    isolation: dict = field(default_factory=dict)  # {"netns": True | reason | None, "seccomp": ...}

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated

    @property
    def cpu_limited(self) -> bool:
        return self.exit_code in (-signal.SIGXCPU, -signal.SIGKILL) and not self.timed_out

    def describe(self) -> str:
        """What the model is shown: stdout, and on failure why (stderr's tail, the limit hit)."""
        parts = [self.stdout]
        if self.output_truncated:
            parts.append("[output truncated]")
        if self.timed_out:
            parts.append("[timed out]")
        elif self.exit_code not in (0, None):
            if self.exit_code < 0:
                parts.append(f"[killed by {signal.Signals(-self.exit_code).name}]")
            elif not self.stderr.strip():
                parts.append(f"[exit {self.exit_code}]")
            if self.stderr.strip():
                parts.append(self.stderr.strip().splitlines()[-1])
        return "\n".join(p for p in parts if p)


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a Python program in the sandbox (module doc); never raises for what the
    program does, only SandboxUnavailable when the required isolation is missing."""
    workdir = Path(tempfile.mkdtemp(prefix="megarl-sandbox-"))
    status_r, status_w = os.pipe()
    try:
        (workdir / "program.py").write_text(code, encoding="utf-8")
        cfg = {
            "program": str(workdir / "program.py"),
            "status_fd": status_w,
            "netns": limits.isolation in ("auto", "netns"),
            "seccomp": limits.isolation in ("auto", "seccomp"),
            "require": list(_LAYERS[limits.isolation]),
            "cpu_s": limits.cpu_s,
            "memory_bytes": limits.memory_mb * 2**20,
            "file_bytes": limits.file_mb * 2**20,
        }
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(workdir),
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8",
        }
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-I", str(CHILD), json.dumps(cfg)],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            start_new_session=True,
        )
        os.close(status_w)
        status_w = -1
        try:
            out, err, status, timed_out, truncated = _collect(
                proc, status_r, start + limits.timeout_s, limits.max_output_bytes
            )
        finally:
            _kill_group(proc)
        isolation = json.loads(status) if status.strip() else {}
        _check_isolation(limits.isolation, isolation, err)
        return SandboxResult(
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            exit_code=proc.returncode,
            timed_out=timed_out,
            output_truncated=truncated,
            wall_s=time.monotonic() - start,
            isolation=isolation,
        )
    finally:
        os.close(status_r)
        if status_w >= 0:
            os.close(status_w)
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(proc: subprocess.Popen, status_fd: int, deadline: float, cap: int):
    """Read stdout, stderr and the status line until the program's process exits (the pidfd
    says so), the deadline passes or an output exceeds `cap`; then take what is already written."""
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), status_fd: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in buffers:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pidfd = os.pidfd_open(proc.pid)
    sel.register(pidfd, selectors.EVENT_READ)
    timed_out = truncated = exited = False
    try:
        while not (exited or truncated):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(remaining):
                if key.fd == pidfd:
                    exited = True
                elif _read_into(key.fd, buffers[key.fd], sel):
                    truncated = truncated or (key.fd != status_fd and len(buffers[key.fd]) > cap)
        if exited:  # what it wrote before exiting is in the pipes now
            for fd in list(buffers):
                while fd in sel.get_map() and _read_into(fd, buffers[fd], sel):
                    pass
    finally:
        sel.close()
        os.close(pidfd)
    out, err = bytes(buffers[proc.stdout.fileno()]), bytes(buffers[proc.stderr.fileno()])
    truncated = truncated or len(out) > cap or len(err) > cap
    return out[:cap], err[:cap], bytes(buffers[status_fd]).decode(), timed_out, truncated


def _read_into(fd: int, buffer: bytearray, sel) -> bool:
    """One read; False (and unregistered) at EOF or when nothing more is there."""
    try:
        chunk = os.read(fd, 65536)
    except BlockingIOError:
        return False
    if not chunk:
        sel.unregister(fd)
        return False
    buffer.extend(chunk)
    return True


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the program's process group, then collect its exit status. The group leader is
    not reaped before the kill, so its pid (= the group id) cannot have been reused."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    _wait_group_gone(proc.pid)
    for stream in (proc.stdout, proc.stderr):
        stream.close()


def _wait_group_gone(pgid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL is delivered at once but a process takes a few ms to die: wait until no process of
    the group is left running (a zombie awaiting its reaper has run its last instruction)."""
    deadline = time.monotonic() + timeout_s
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.005)


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            members.append(int(entry.name))
    return members


def _check_isolation(required: str, report: dict, stderr: bytes) -> None:
    if required == "none":
        return
    if not report:
        raise SandboxUnavailable(
            f"the sandbox process died before confining itself: {stderr.decode('utf-8', 'replace')[-500:]}"
        )
    if not any(report.get(layer) is True for layer in _LAYERS[required]):
        raise SandboxUnavailable(
            f"sandbox isolation={required}: no network isolation took effect ({report}); the program was "
            "stopped before its first line. Allow unprivileged user namespaces or seccomp filters, or set "
            "rollout.agent.sandbox.isolation=none for trusted code only"
        )
