"""Failure injection for fleet and loop tests: SIGKILL an engine while it holds requests."""

from __future__ import annotations

import os
import signal
import threading

import httpx


def kill_when_busy(fleet, engine: int, done: threading.Event, killed: list) -> None:
    """SIGKILL engine `engine`'s server the moment it has requests in flight (mid-step); stop
    watching when `done` is set. The pid killed is appended to `killed`. A poll that fails (a
    server slow to answer under load) is polled again; should the watch itself fail, the engine
    is let go on (run_while_killing paused it), so the work fails its check rather than hangs."""
    url, pid = fleet.engine_urls[engine], fleet.server_pids()[engine][0]
    try:
        while not done.is_set():
            try:
                busy = httpx.get(f"{url}/get_server_info", headers=_auth(fleet), timeout=30).json()["pending_requests"]
            except httpx.HTTPError:
                busy = 0
            if busy > 0:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            done.wait(0.005)
    finally:
        if not killed:  # the engine still runs: let it answer again
            httpx.post(f"{url}/continue_generation", json={}, headers=_auth(fleet), timeout=30)


def run_while_killing(fleet, engine: int, work):
    """work() while engine `engine` is SIGKILLed mid-way; returns (work's result, the pid killed).
    The engine is paused in place first, so the requests it receives wait in its queue until the
    kill: a tiny model on a fast CPU answers a whole step quicker than a poll sees it busy."""
    url, done, killed = fleet.engine_urls[engine], threading.Event(), []
    httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}, headers=_auth(fleet), timeout=30)
    killer = threading.Thread(target=kill_when_busy, args=(fleet, engine, done, killed))
    killer.start()
    try:
        result = work()
    finally:
        done.set()
        killer.join()
    assert killed, f"engine {engine} was never seen holding a request, so it was not killed mid-step"
    return result, killed[0]


def _auth(fleet) -> dict:
    return {"Authorization": f"Bearer {fleet.api_key}"} if fleet.api_key else {}
