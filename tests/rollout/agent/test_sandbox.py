"""The python tool's sandbox (megarl/rollout/agent/sandbox.py): no network through either layer
(each checked alone, and shown to matter: without them the same connect succeeds), the CPU,
memory, output and wall-clock limits, and the process-group kill of every child."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from megarl.rollout.agent.sandbox import CHILD, SandboxLimits, SandboxUnavailable, _check_isolation, run_python

CONNECT = """
import socket
s = socket.socket()
s.settimeout(5)
s.connect(("127.0.0.1", {port}))
print("connected")
"""


@pytest.fixture(scope="module")
def listening_port():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


def test_runs_a_program_and_reports_both_isolation_layers():
    result = run_python("print(sum(range(10)))")
    assert result.ok and result.stdout == "45\n"
    assert result.isolation == {"netns": True, "seccomp": True}  # the test hosts (a VM, root) have both


@pytest.mark.parametrize(
    "isolation,error", [("netns", "Network is unreachable"), ("seccomp", "Operation not permitted"), ("auto", "")]
)
def test_network_refused_by_each_layer(listening_port, isolation, error):
    result = run_python(CONNECT.format(port=listening_port), SandboxLimits(isolation=isolation))
    assert result.exit_code == 1 and "connected" not in result.stdout
    assert error in result.stderr
    if isolation == "auto":  # the seccomp layer refuses socket() before the namespace is asked
        assert "Operation not permitted" in result.stderr


def test_without_isolation_the_same_program_connects(listening_port):
    """The refusals above are the sandbox's doing: unconfined, the connect succeeds."""
    result = run_python(CONNECT.format(port=listening_port), SandboxLimits(isolation="none"))
    assert result.ok and result.stdout == "connected\n"


def test_the_child_refuses_to_run_the_program_when_the_required_layer_is_missing(tmp_path):
    """A layer that did not take effect (simulated: not attempted) stops the process before the
    program's first line (exit 97), and the parent raises SandboxUnavailable on such a report."""
    marker = tmp_path / "ran"
    program = tmp_path / "program.py"
    program.write_text(f"open({str(marker)!r}, 'w').write('x')")
    r, w = os.pipe()
    cfg = {
        "program": str(program),
        "status_fd": w,
        "netns": False,
        "seccomp": False,
        "require": ["netns"],
        "cpu_s": 5,
        "memory_bytes": 2**29,
        "file_bytes": 2**20,
    }
    code = subprocess.call([sys.executable, "-I", str(CHILD), json.dumps(cfg)], pass_fds=(w,))
    os.close(w)
    with os.fdopen(r) as status:
        report = json.loads(status.read())
    assert code == 97 and not marker.exists()
    with pytest.raises(SandboxUnavailable, match="no network isolation took effect"):
        _check_isolation("netns", report, b"")
    _check_isolation("seccomp", {"netns": None, "seccomp": True}, b"")  # one required layer is enough


def test_runaway_loop_is_stopped_by_the_cpu_limit():
    result = run_python("while True:\n    pass", SandboxLimits(cpu_s=1, timeout_s=60))
    # not the wall clock (60 s: room for a loaded machine, where 1 CPU second takes several)
    assert result.exit_code == -signal.SIGXCPU and not result.timed_out and result.cpu_limited
    assert "SIGXCPU" in result.describe()


def test_wall_clock_timeout_kills_a_sleeping_program():
    result = run_python("import time\nwhile True:\n    time.sleep(1)", SandboxLimits(timeout_s=1))
    assert result.timed_out and result.exit_code == -signal.SIGKILL and result.wall_s >= 1.0


def _alive(pid: int) -> bool:
    """Running (a killed child re-parented to init may linger as a zombie until reaped: not alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


FORKS = """
import os, sys, time
for _ in range(16):
    pid = os.fork()
    if pid == 0:
        time.sleep(120)
        os._exit(0)
    print(pid, flush=True)
{tail}
"""


@pytest.mark.parametrize("tail,timed_out", [("time.sleep(120)", True), ("", False)])
def test_children_are_killed_with_the_group(tail, timed_out):
    """Children still running when the program times out, or when it exits and leaves them behind."""
    result = run_python(FORKS.format(tail=tail), SandboxLimits(timeout_s=1.5))
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 16 and result.timed_out is timed_out
    assert not [p for p in pids if _alive(p)]


def test_a_child_cannot_leave_the_process_group():
    result = run_python("import os\nos.setsid()")
    assert result.exit_code == 1 and "PermissionError" in result.stderr


def test_memory_hog_fails_at_the_address_space_limit():
    result = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", SandboxLimits(memory_mb=256))
    assert result.exit_code == 1 and "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_output_is_truncated_and_an_endless_printer_stopped():
    result = run_python("while True:\n    print('y' * 99)", SandboxLimits(max_output_bytes=1000, timeout_s=20))
    assert result.output_truncated and not result.timed_out and len(result.stdout) == 1000
    assert "[output truncated]" in result.describe()


def test_errors_are_described_for_the_model():
    result = run_python("print('partial')\n1 / 0")
    assert not result.ok and result.describe() == "partial\n\nZeroDivisionError: division by zero"
