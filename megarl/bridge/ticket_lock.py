"""A FIFO lock over the trainer's bridge store: one bucket in flight at a time across all senders.

With one update group per sending rank (each pipeline stage, each expert owner), two senders that
broadcast to the same engines at once would deadlock: each engine serves one update at a time and
could join the senders' groups in opposite orders (slime serialises with a Ray lock for the same
reason). A sender takes a ticket when its bucket is ready and waits until the previous ticket is
done; gathering the next bucket still overlaps the transfer of this one.

A holder that dies would block the queue forever, so every rank in a sync beats a heartbeat
counter; a waiter whose predecessor's heartbeat stops for `stale_s` fails the sync, naming it.

Two store connections: a TCPStore client serialises its calls, so a release or a heartbeat from
another thread would queue behind a blocked wait (up to `poll_s` per bucket, measured: 1 s).
"""

from __future__ import annotations

import datetime
import threading
import time

from megarl.bridge.engines import WeightSyncError


class TicketLock:
    def __init__(self, store, signal_store, rank: int, stale_s: float = 30.0, poll_s: float = 1.0):
        """`store` is used by the acquiring thread; `signal_store`, a second connection to the same
        store, by releases and heartbeats (other threads)."""
        self.store, self.signals, self.rank, self.stale_s, self.poll_s = store, signal_store, rank, stale_s, poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> int:
        ticket = int(self.store.add("ticket", 1))
        self.store.set(f"holder/{ticket}", str(self.rank))
        if ticket > 1:
            self._wait_for(ticket - 1)
            for key in (f"done/{ticket - 1}", f"holder/{ticket - 1}"):
                self.store.delete_key(key)  # only this ticket's holder waits on them
        return ticket

    def release(self, ticket: int) -> None:
        self.signals.set(f"done/{ticket}", "1")

    def _wait_for(self, previous: int) -> None:
        key, seen, changed = f"done/{previous}", None, time.monotonic()
        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=self.poll_s))
                return
            except RuntimeError as exc:  # DistStoreError on timeout: check the holder is alive
                if "timeout" not in str(exc).lower():
                    raise
            holder = self.store.get(f"holder/{previous}").decode()
            beat = int(self.store.add(f"beat/{holder}", 0))
            if beat != seen:
                seen, changed = beat, time.monotonic()
            elif time.monotonic() - changed > self.stale_s:
                raise WeightSyncError(
                    f"trainer rank {holder} stopped while sending a weight bucket (no heartbeat for "
                    f"{self.stale_s:.0f} s); the sync is abandoned and the engines keep their weights"
                )

    # ---- heartbeat: on while this rank takes part in a sync --------------------------------------
    def start_heartbeat(self) -> None:
        self._stop.clear()
        self.signals.add(f"beat/{self.rank}", 1)
        self._thread = threading.Thread(target=self._beat, name="bridge-heartbeat", daemon=True)
        self._thread.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _beat(self) -> None:
        while not self._stop.wait(self.poll_s / 2):
            try:
                self.signals.add(f"beat/{self.rank}", 1)
            except RuntimeError:  # the store's host (trainer rank 0) is gone: the sync fails there
                return
