"""Failure injection for fleet and loop tests: SIGKILL an engine while it is generating."""

from __future__ import annotations

import os
import signal
import threading

import httpx


def kill_when_busy(fleet, engine: int, done: threading.Event, killed: list) -> None:
    """SIGKILL engine `engine`'s server the moment it has requests in flight (mid-step); stop
    watching when `done` is set. The pid killed is appended to `killed`."""
    url, pid = fleet.engine_urls[engine], fleet.server_pids()[engine][0]
    auth = {"Authorization": f"Bearer {fleet.api_key}"} if fleet.api_key else {}
    while not done.is_set():
        if httpx.get(f"{url}/get_server_info", headers=auth, timeout=10).json()["pending_requests"] > 0:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        done.wait(0.005)


def run_while_killing(fleet, engine: int, work):
    """work() while engine `engine` is SIGKILLed mid-way; returns (work's result, the pid killed)."""
    done, killed = threading.Event(), []
    killer = threading.Thread(target=kill_when_busy, args=(fleet, engine, done, killed))
    killer.start()
    try:
        result = work()
    finally:
        done.set()
        killer.join()
    assert killed, f"engine {engine} was never seen generating, so it was not killed mid-step"
    return result, killed[0]
