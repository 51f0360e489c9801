"""The engines one sync talks to: a kept client per engine, its TP size, its place in an update
group, and the control calls around a sync, made to every engine at once."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable

from megarl.rollout.client.client import RolloutClient

log = logging.getLogger(__name__)
EMBEDDED_VERSION = "megarl-embedded"  # what the embedded server answers in /get_server_info "version"


class WeightSyncError(RuntimeError):
    """A sync did not complete; the engines were told to drop what they staged and serve the
    weights they had (embedded engines), or must be sent a full update again (SGLang)."""


class Engine:
    def __init__(self, url: str, timeout_s: float, api_key: str | None):
        # no retries: a weight-update request that is re-sent would wait for a collective that
        # already happened; a failure is reported and the whole sync is repeated instead
        self.url = url
        self.client = RolloutClient(url, timeout_s=timeout_s, api_key=api_key, max_retries=0)
        info = self.client.get_server_info()
        self.tp = int(info.get("tp_size") or 1)
        self.nnodes = int(info.get("nnodes") or 1)  # hosts its TP ranks span
        # the embedded engine stages buckets and applies them on commit (all or nothing); SGLang
        # loads each bucket as it arrives
        self.stages = info.get("version") == EMBEDDED_VERSION
        # this sync's update was applied whole by one request (a single bucket): nothing to commit
        self.applied = False

    def close(self) -> None:
        self.client.close()


class EngineSet:
    """Kept across syncs; `use(urls)` points it at the engines of this sync (restarts move them)."""

    def __init__(
        self, timeout_s: float, api_key: str | None, pause_generation: bool = True, pause_mode: str = "in_place"
    ):
        self.timeout_s, self.api_key, self.pause_generation = timeout_s, api_key, pause_generation
        self.pause_mode = pause_mode
        self._known: dict[str, Engine] = {}
        self.engines: list[Engine] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="bridge-http")

    def use(self, urls) -> list[Engine]:
        for url in urls:
            if url not in self._known:
                self._known[url] = Engine(url, self.timeout_s, self.api_key)
        self.engines = [self._known[u] for u in urls]
        for engine in self.engines:
            engine.applied = False
        return self.engines

    def forget(self, urls) -> None:
        """Drop what is kept for `urls` (restarted engines): the next use() asks them afresh."""
        for url in urls:
            engine = self._known.pop(url, None)
            if engine is not None:
                engine.close()

    @property
    def total_ranks(self) -> int:
        return sum(e.tp for e in self.engines)

    def rank_offsets(self, first: int) -> list[int]:
        """Group rank of each engine's TP rank 0 when engine ranks follow `first` trainer ranks."""
        offsets, at = [], first
        for e in self.engines:
            offsets.append(at)
            at += e.tp
        return offsets

    def submit(self, fn: Callable, *args, **kwargs) -> concurrent.futures.Future:
        return self._pool.submit(fn, *args, **kwargs)

    def each(self, call: Callable[[int, Engine], object], what: str) -> list:
        """call(i, engine) on every engine at once; WeightSyncError naming every engine that failed."""
        futures = [self._pool.submit(call, i, e) for i, e in enumerate(self.engines)]
        return wait_all(futures, [e.url for e in self.engines], what)

    # ---- the calls around a sync ----------------------------------------------------------------
    def pause(self) -> None:
        """Hold generation between forward steps while weights change. The prefix cache is flushed
        by the update itself (SGLang's `flush_cache` on the last bucket; the embedded engine keeps
        no KV cache between batches): a separate /flush_cache first would cost one more round
        trip per engine per step (~1 ms here) and is refused anyway while requests are paused."""
        if self.pause_generation:
            self.each(lambda i, e: e.client.pause_generation(mode=self.pause_mode), "pause_generation")

    def commit(self, version: str) -> None:
        self.each(
            lambda i, e: e.client.commit_weight_update(version) if e.stages and not e.applied else None,
            "commit_weight_update",
        )

    def abort(self) -> None:
        """Best effort after a failed sync: drop staged buckets (never raises; logs what failed)."""
        try:
            self.each(lambda i, e: e.client.abort_weight_update() if e.stages else None, "abort_weight_update")
        except WeightSyncError as exc:
            log.warning("after a failed sync, dropping staged weights failed too: %s", exc)

    def resume(self) -> None:
        if self.pause_generation:
            self.each(lambda i, e: e.client.continue_generation(), "continue_generation")

    def close(self) -> None:
        for engine in self._known.values():
            engine.close()
        self._known.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)


def wait_all(futures: list, names: list[str], what: str) -> list:
    """Every future's result, waiting for all of them; one error naming each failure."""
    results, errors = [], []
    for name, future in zip(names, futures):
        try:
            results.append(future.result())
        except Exception as exc:  # noqa: BLE001  (collected, then raised together)
            results.append(None)
            errors.append(f"{name}: {exc}")
    if errors:
        raise WeightSyncError(f"{what} failed on {len(errors)} of {len(names)}: " + "; ".join(errors))
    return results
