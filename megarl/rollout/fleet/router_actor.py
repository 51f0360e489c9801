"""RouterActor: sglang-router as a Ray actor, so the driver starts no server process itself.

The actor owns a RouterProcess (megarl/rollout/fleet/router.py) on the node Ray placed it on; the fleet
adds and removes engines through it as they die and come back.
"""

from __future__ import annotations

from megarl.rollout.fleet.router import RouterProcess


class RouterActor:
    def __init__(self, worker_urls: list[str], policy: str, host: str, log_path: str, api_key: str | None):
        self.router = RouterProcess(list(worker_urls), host=host, policy=policy, log_path=log_path, api_key=api_key)

    def start(self) -> str:
        """The router's URL as other nodes reach it (the node's IP when bound to every interface)."""
        from megarl.procs.net import get_node_ip

        self.router.start()
        if self.router.host in ("0.0.0.0", "::", ""):
            return f"http://{get_node_ip()}:{self.router.port}"
        return self.router.url

    def add_worker(self, url: str) -> None:
        self.router.add_worker(url)

    def remove_worker(self, url: str) -> None:
        self.router.remove_worker(url)

    def workers(self) -> list[str]:
        return self.router.workers()

    def stop(self) -> None:
        self.router.stop()
