"""The sandboxed process's first code: confine itself, then run the user's program.

Run by sandbox.py as `python -I sandbox_child.py CONFIG_JSON` in a fresh process (its own session
and process group), before any user code and while it is still single-threaded (a user namespace
can only be entered by a single-threaded process). Standard library only: `-I` leaves megarl and
site-packages' user paths out. In order:

1. network: unshare(CLONE_NEWUSER | CLONE_NEWNET) - a new network namespace holds only a loopback
   device, which is down, so every connect() fails (ENETUNREACH), 127.0.0.1 included;
2. seccomp: a BPF filter (built here, no library) that makes socket() fail with EPERM (no socket
   of any family can be made: with no inherited socket, no network), io_uring_setup (whose
   requests would bypass the filter) and setsid()/setpgid() (a child leaving the process group
   would escape the group kill) fail too; other architectures' calls kill the process;
3. limits: RLIMIT_CPU (seconds, per process), RLIMIT_AS (address space), RLIMIT_FSIZE (bytes one
   file may grow to), RLIMIT_CORE 0;
4. the program (the file `program`) runs as __main__.

Steps 1 and 2 are each tried; what took effect is written as one JSON line to the status pipe
(`status_fd`, which the parent reads); when none of the layers in `require` took effect the
process exits (97) before the program's first line (sandbox.py raises SandboxUnavailable).
"""

import ctypes
import json
import os
import platform
import resource
import struct
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM = 1
# (AUDIT_ARCH, {name: syscall number}) of the architectures the filter knows
ARCHES = {
    "x86_64": (0xC000003E, {"socket": 41, "setsid": 112, "setpgid": 109, "io_uring_setup": 425}),
    "aarch64": (0xC00000B7, {"socket": 198, "setsid": 157, "setpgid": 154, "io_uring_setup": 425}),
}


def enter_network_namespace(libc) -> str | None:
    """None when the process is now in a network namespace of its own, else why not."""
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return f"unshare(CLONE_NEWUSER|CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}"
    return None


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def seccomp_program(arch: str) -> bytes:
    """BPF: wrong architecture -> kill; x32 syscalls -> EPERM; the denied calls -> EPERM; else allow."""
    audit_arch, numbers = ARCHES[arch]
    ld_w_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    denied = [numbers[n] for n in ("socket", "setsid", "setpgid", "io_uring_setup")]
    prog = [
        _insn(ld_w_abs, 0, 0, 4),  # A = seccomp_data.arch
        _insn(jeq, 1, 0, audit_arch),
        _insn(ret, 0, 0, RET_KILL_PROCESS),
        _insn(ld_w_abs, 0, 0, 0),
    ]  # A = seccomp_data.nr
    if arch == "x86_64":  # the x32 ABI sets bit 30 of nr
        prog.append(_insn(jge, len(denied) + 1, 0, 0x40000000))  # -> EPERM
    for k, nr in enumerate(denied):  # jump to the EPERM return
        prog.append(_insn(jeq, len(denied) - k, 0, nr))
    prog.append(_insn(ret, 0, 0, RET_ALLOW))
    prog.append(_insn(ret, 0, 0, RET_ERRNO | EPERM))
    return b"".join(prog)


def install_seccomp(libc) -> str | None:
    """None when the filter is installed, else why not."""
    arch = platform.machine()
    if arch not in ARCHES:
        return f"no seccomp filter for architecture {arch}"
    code = seccomp_program(arch)
    buf = ctypes.create_string_buffer(code, len(code))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = SockFprog(len(code) // 8, ctypes.addressof(buf))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"prctl(PR_SET_NO_NEW_PRIVS) failed: {os.strerror(ctypes.get_errno())}"
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        return f"prctl(PR_SET_SECCOMP) failed: {os.strerror(ctypes.get_errno())}"
    return None


def set_limits(cfg: dict) -> None:
    cpu = max(1, int(cfg["cpu_s"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu, SIGKILL a second later
    memory = int(cfg["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    file_bytes = int(cfg["file_bytes"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    report = {"netns": None, "seccomp": None}
    if cfg["netns"]:
        why = enter_network_namespace(libc)
        report["netns"] = True if why is None else why
    if cfg["seccomp"]:
        why = install_seccomp(libc)
        report["seccomp"] = True if why is None else why
    set_limits(cfg)
    with os.fdopen(cfg["status_fd"], "w") as status:
        status.write(json.dumps(report) + "\n")
    if cfg["require"] and not any(report[layer] is True for layer in cfg["require"]):
        os._exit(97)  # no required isolation took effect: the program never runs
    sys.argv = ["program"]
    with open(cfg["program"], encoding="utf-8") as f:
        source = f.read()
    del cfg, libc, report
    code = compile(source, "program", "exec")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102  (the sandbox's job)


if __name__ == "__main__":
    main()
