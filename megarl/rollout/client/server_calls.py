"""RolloutClient's control and inspection calls: the cache, health probes, the server's model,
parallel layout, weight version and load, and aborts.

A mixin: the transport (`_run`, `_request`, `_json`, `_http`, `base_url`) is RolloutClient's (client.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx


class ServerCalls:
    _run: Callable[..., Any]
    _request: Callable[..., Awaitable[httpx.Response]]
    _json: Callable[..., Awaitable[Any]]
    _http: httpx.AsyncClient
    base_url: str

    def flush_cache(self) -> bool:
        """True when flushed; False when the server refused because requests are still running."""
        response = self._run(self._request("POST", "/flush_cache", None, "/flush_cache"))
        return response.status_code == 200

    def health(self) -> bool:
        """One quick probe, no retries: is the server up and its scheduler alive?"""
        return self._run(self._probe("/health", timeout_s=5.0))

    def health_generate(self) -> bool:
        """One probe, no retries: can the server generate a token right now?"""
        return self._run(self._probe("/health_generate", timeout_s=60.0))

    async def _probe(self, path: str, timeout_s: float) -> bool:
        try:
            return (await self._http.get(f"{self.base_url}{path}", timeout=timeout_s)).status_code == 200
        except httpx.TransportError:
            return False

    def get_model_info(self) -> dict:
        return self._run(self._json("GET", "/get_model_info"))

    def get_server_info(self) -> dict:
        return self._run(self._json("GET", "/get_server_info"))

    def get_parallelism_config(self) -> dict:
        """Which slice of each full HF tensor every engine rank holds (the embedded engine's layout)."""
        return self._run(self._json("GET", "/get_parallelism_config"))

    def get_weight_version(self) -> str | None:
        return self._run(self._json("GET", "/get_weight_version"))["weight_version"]

    def get_load(self) -> list[dict]:
        """SGLang's /get_load: per data-parallel rank, num_reqs (running + queued),
        num_waiting_reqs and num_tokens; a server answering one dict gets it wrapped in a list."""
        load = self._run(self._json("GET", "/get_load"))
        return load if isinstance(load, list) else [load]

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        self._run(self._json("POST", "/abort_request", {"rid": rid, "abort_all": abort_all}))
