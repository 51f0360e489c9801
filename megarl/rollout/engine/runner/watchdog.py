"""Ends a TP process when the mesh loses a rank, so no rank waits forever for a dead peer.

A collective with a dead peer fails at once under gloo ("Connection closed by peer", measured),
but a rank that is not in a collective would not notice: rank 0 idling between requests, or a
follower when a rank on another node dies. So every process beats a counter in the rendezvous
store (hosted by rank 0) and watches the others' counters and its own child processes; a child
that exits, a counter that stops, or a store that disappears (rank 0 gone) is fatal. Children are
watched from the start; heartbeats only once every rank has loaded its shard (`watch_peers`), since
loading a large model takes longer than any sensible heartbeat timeout.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

HEARTBEAT_INTERVAL_S = 1.0
PEER_TIMEOUT_S = 20.0  # default; generous: a loaded 2-core machine can stall a process for seconds


class Watchdog:
    def __init__(
        self,
        store_host: str,
        store_port: int,
        rank: int,
        world_size: int,
        on_failure: Callable[[str], None],
        peer_timeout_s: float = PEER_TIMEOUT_S,
        children: dict[int, object] | None = None,
    ):
        self.store_host, self.store_port, self.rank, self.world_size = store_host, store_port, rank, world_size
        self.peer_timeout_s = peer_timeout_s
        self._on_failure = on_failure
        self._children = dict(children or {})  # rank -> multiprocessing.Process started by this process
        self._stop = threading.Event()
        self._peers = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tp-watchdog-{rank}", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def watch_peers(self) -> None:
        """Start beating and watching the other ranks' heartbeats (call once all ranks are up)."""
        self._peers.set()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            store, seen = None, None
            while not self._stop.is_set():
                if self._peers.is_set() and store is None:  # the store is certainly up once all ranks joined
                    store = dist.TCPStore(
                        self.store_host,
                        self.store_port,
                        is_master=False,
                        wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=self.peer_timeout_s),
                    )
                    seen = {r: (-1, time.monotonic()) for r in range(self.world_size) if r != self.rank}
                if store is not None:
                    store.add(_key(self.rank), 1)
                problem = self._dead_child() or (store is not None and self._silent_peer(store, seen))
                if problem:
                    return self._fail(problem)
                self._stop.wait(HEARTBEAT_INTERVAL_S)
        except Exception as exc:  # noqa: BLE001  (any store failure means the mesh is gone; reported)
            self._fail(
                f"lost the rendezvous store at {self.store_host}:{self.store_port} ({exc!r}): "
                "node rank 0's server is gone"
            )

    def _dead_child(self) -> str | None:
        for rank, process in self._children.items():
            if process.exitcode is not None:
                return f"TP rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
        return None

    def _silent_peer(self, store, seen: dict) -> str | None:
        now = time.monotonic()
        for rank, (count, since) in seen.items():
            current = store.add(_key(rank), 0)
            if current != count:
                seen[rank] = (current, now)
            elif now - since > self.peer_timeout_s:
                return (
                    f"TP rank {rank} sent no heartbeat for {self.peer_timeout_s:.0f}s: its process or node is "
                    "gone or stuck"
                )
        return None

    def _fail(self, message: str) -> None:
        if not self._stop.is_set():
            self._on_failure(message)


def _key(rank: int) -> str:
    return f"megarl/tp/heartbeat/{rank}"
