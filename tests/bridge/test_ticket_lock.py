"""The bridge's FIFO bucket lock: turns are taken in ticket order, and a holder whose heartbeat
stops fails the waiters with its rank named (instead of blocking the sync forever)."""

from __future__ import annotations

import threading

import pytest

from megarl.bridge import WeightSyncError
from megarl.bridge.ticket_lock import TicketLock
from megarl.wire import update_group


@pytest.fixture()
def store():
    host = update_group.host_store("127.0.0.1", timeout_s=10)
    host.set("done/0", "1")
    return host


def _client(store):
    return update_group.connect_store("127.0.0.1", store.port, timeout_s=10)


def test_turns_follow_ticket_order(store):
    order, locks = [], [TicketLock(_client(store), _client(store), rank, poll_s=0.05) for rank in range(3)]
    first = locks[0].acquire()  # rank 0 holds the lock while the others queue behind it
    started = []

    def take(lock):
        ticket = lock.acquire()
        order.append(lock.rank)
        lock.release(ticket)

    for lock in locks[1:]:
        thread = threading.Thread(target=take, args=(lock,))
        thread.start()
        started.append(thread)
        while int(store.add("ticket", 0)) < lock.rank + 1:  # its ticket is taken: the queue order is fixed
            pass
    assert order == []  # nobody overtakes the holder
    locks[0].release(first)
    for thread in started:
        thread.join(timeout=10)
    assert order == [1, 2]


def test_a_dead_holder_is_named_once_its_heartbeat_stops(store):
    holder = TicketLock(_client(store), _client(store), 3, poll_s=0.05)
    waiter = TicketLock(_client(store), _client(store), 5, stale_s=0.3, poll_s=0.05)
    holder.start_heartbeat()
    holder.acquire()
    holder.stop_heartbeat()  # the holder "dies": no release, no more beats
    with pytest.raises(WeightSyncError, match="trainer rank 3 stopped while sending"):
        waiter.acquire()
