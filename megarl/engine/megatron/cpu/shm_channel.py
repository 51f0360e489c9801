"""One shared-memory segment per process group: the channel that megarl's CPU collectives
(collectives.py) run over.

Layout: a header of int64 words per rank (its sequence number, then per buffer a status and n+1
cumulative byte offsets), then two data buffers of `slot` bytes per rank. A rank posts op k into
buffer k % 2 and publishes k; a peer reads once every rank published k. Waiting spins, then
yields the core, then sleeps between looks, and raises when a peer's process is gone or after the
group timeout, naming the op and the rank.
"""

from __future__ import annotations

import array
import mmap
import os
import socket
import time
import uuid

import torch
import torch.distributed as dist

SPIN_S = 0.0001  # spin this long (the common case: the peer is microseconds away) ...
YIELD_S = 0.02  # ... then yield the core (to any process that wants it: an engine that
SLEEP_S = 0.0005  # generates while the ranks train) this long, then sleep between looks
TIMEOUT_S = 1800.0  # as megarl's process groups (controller/worker.py)


def _host_key() -> str:
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class Channel:
    def __init__(self, group, mm: mmap.mmap, pids: list[int], slot: int):
        self.group, self.mm, self.pids, self.slot = group, mm, pids, slot
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.ranks = dist.get_process_group_ranks(group)
        self.words = _words(self.n)
        self.hdr = memoryview(mm)[: self.n * self.words * 8].cast("q")
        self.data = torch.frombuffer(mm, dtype=torch.uint8)
        self.base = _header_bytes(self.n)
        self.seq = 0

    @staticmethod
    def size(n: int, slot: int) -> int:
        return _header_bytes(n) + n * 2 * slot

    def field(self, p: int, seq: int) -> int:
        """Where rank p's status for op seq is (its offsets follow); alternates like the buffers."""
        return p * self.words + 1 + (seq % 2) * (self.n + 2)

    def buf(self, p: int, seq: int, nbytes: int) -> torch.Tensor:
        start = self.base + (p * 2 + seq % 2) * self.slot
        return self.data[start : start + nbytes]

    def post(self, tensor: torch.Tensor | None, offsets: list[int] | None = None) -> int:
        """Copy tensor into this rank's slot and publish it; returns the op's sequence number. A
        tensor over the slot publishes status -1: every rank then takes gloo (wait returns False)."""
        self.seq += 1
        seq, w, h = self.seq, self.words, self.hdr
        nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
        status = -1 if nbytes > self.slot else nbytes
        if status > 0:
            self.buf(self.rank, seq, nbytes).view(tensor.dtype).view(tensor.shape).copy_(tensor)
        at = self.field(self.rank, seq)
        if offsets is not None:
            h[at + 1 : at + 2 + self.n] = array.array("q", offsets)
        h[at] = status
        h[self.rank * w] = seq  # last: peers read the data once they see it
        return seq

    def wait(self, seq: int, op: str) -> bool:
        """Until every rank posted seq; returns False when one overflowed (all take gloo)."""
        h, w = self.hdr, self.words
        t0 = time.perf_counter()
        for p in range(self.n):
            spins = 0
            while h[p * w] < seq:
                spins += 1
                if spins < 256:
                    continue
                spins = 0
                waited = time.perf_counter() - t0
                if waited < SPIN_S:
                    continue
                if waited < YIELD_S:
                    os.sched_yield()
                    continue
                time.sleep(SLEEP_S)
                self._check_peer(p, op, waited)
        return all(h[self.field(p, seq)] >= 0 for p in range(self.n))

    def _check_peer(self, p: int, op: str, waited: float) -> None:
        try:
            with open(f"/proc/{self.pids[p]}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        where = f"{op} on group ranks {self.ranks} (this is rank {self.ranks[self.rank]})"
        if state in ("gone", "Z", "X"):
            raise RuntimeError(
                f"cpu_collectives: {where}: rank {self.ranks[p]} (pid {self.pids[p]}) exited before joining it"
            )
        if waited > TIMEOUT_S:
            raise RuntimeError(f"cpu_collectives: {where}: rank {self.ranks[p]} did not join within {TIMEOUT_S:.0f} s")

    def offsets(self, p: int, seq: int) -> list[int]:
        start = self.field(p, seq) + 1
        return list(self.hdr[start : start + self.n + 1])


def _words(n: int) -> int:
    """int64 header words per rank: seq, then per buffer a status and n+1 cumulative byte offsets."""
    return 1 + 2 * (n + 2)


def _header_bytes(n: int) -> int:
    return -(-(n * _words(n) * 8) // 4096) * 4096


def open_channel(group, want: bool, slot: int) -> Channel | None:
    """Collective over the group (every member makes the same first call): agree on one host,
    map one segment of `slot` bytes per rank and buffer. None: this group stays on gloo (some rank
    does not `want` it, the ranks are on different hosts, or a rank could not map the segment)."""
    gather = _object_gather
    n = dist.get_world_size(group)
    # every rank takes part in this agreement whatever it wants (its peers may want otherwise)
    infos = gather((_host_key(), os.getpid(), want), group)
    if n < 2 or not all(want for _, _, want in infos) or len({key for key, _, _ in infos}) != 1:
        return None
    path, mm = None, None
    if dist.get_rank(group) == 0:
        path = f"/dev/shm/megarl-coll-{uuid.uuid4().hex}"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError:
            path = None
        else:
            try:
                os.posix_fallocate(fd, 0, Channel.size(n, slot))  # ENOSPC now, not SIGBUS later
            except OSError:
                os.unlink(path)
                path = None
            finally:
                os.close(fd)
    path = _object_broadcast(path, group)
    if path is not None:
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, Channel.size(n, slot))
            finally:
                os.close(fd)
        except OSError:
            mm = None
    # every rank mapped it and sees every peer's process (one PID namespace: a dead peer is
    # noticed through /proc), or none uses it; then the file goes
    pids = [pid for _, pid, _ in infos]
    mapped = gather(mm is not None and all(os.path.exists(f"/proc/{pid}") for pid in pids), group)
    if dist.get_rank(group) == 0 and path is not None:
        os.unlink(path)
    if not all(mapped):
        return None
    return Channel(group, mm, pids, slot)


def _object_gather(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _object_broadcast(obj, group):
    box = [obj]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]
