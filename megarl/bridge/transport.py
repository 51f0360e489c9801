"""The one interface every weight transport implements, and the source it reads from.

    transport = make_transport(spec, rank, world_size, address)   # once per run, on every trainer rank (factory.py)
    stats = transport.sync(source, version, server_urls)          # after every update, on every rank
    transport.sync(source, version, [url], restarted=True)        # a restarted engine (same URL or not)
    transport.close()

A sync is all or nothing on the embedded engines: buckets are staged and applied on commit, so a
sync that fails halfway leaves every engine serving the weights it had (WeightSyncError). SGLang
applies buckets as they arrive; there a failed sync is repaired by the next full sync.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Protocol

import torch

from megarl.bridge.engines import EngineSet, WeightSyncError
from megarl.bridge.spec import BridgeSpec

NamedTensor = tuple[str, torch.Tensor]
log = logging.getLogger(__name__)


class WeightSource(Protocol):
    """What the trainer engine offers (MegatronEngine). Every method is called on every rank."""

    def export_weights(self) -> Iterator[NamedTensor]:
        """Every HF tensor, full, on every rank (PP broadcast, TP/EP gathers)."""

    def export_owned_weights(self) -> Iterator[NamedTensor]:
        """The full HF tensors this rank sends (PP stage / EP owner); collectives stay in TP/ETP groups."""

    def local_pieces(self) -> list:
        """shards.LocalPiece: the HF boxes this rank can produce with no communication."""


class WeightTransport(ABC):
    def __init__(self, spec: BridgeSpec, rank: int, world_size: int, address: str = "127.0.0.1"):
        self.spec, self.rank, self.world_size, self.address = spec, rank, world_size, address
        self._engines: EngineSet | None = None

    @property
    def engines(self) -> EngineSet:
        if self._engines is None:
            self._engines = EngineSet(
                self.spec.timeout_s, self.spec.api_key, self.spec.pause_generation, self.spec.pause_mode
            )
        return self._engines

    def sync(self, source: WeightSource, version: str, server_urls=None, restarted: bool = False) -> dict:
        """`restarted`: the engines at `server_urls` are new processes (a fleet restart), so what
        was kept for those URLs (clients, their TP size, update groups, the reshard plan) belongs
        to their dead predecessors: a restart may come back on the same URL (a fixed
        rollout.port, or a free port the OS hands out again)."""
        start = time.perf_counter()
        urls = list(server_urls or self.spec.server_urls)
        if restarted:
            self._broken()
            if self._engines is not None:
                self._engines.forget(urls)
        stats = self._sync(source, str(version), urls)
        if stats:
            stats["perf/weight_sync_s"] = time.perf_counter() - start
        return stats

    @abstractmethod
    def _sync(self, source: WeightSource, version: str, urls: list[str]) -> dict:
        """Move the weights; stats from the ranks that sent something, {} elsewhere."""

    def close(self) -> None:
        if self._engines is not None:
            self._engines.close()
            self._engines = None

    def _staged(self, version: str, urls: list[str], send, stream) -> None:
        """Rank 0's frame around a sync: pause, send(stream), commit, continue; abort on
        failure. The stream is drained whatever happens: its collectives keep the other ranks in
        lockstep (a rank that stopped halfway would pair its next sync with their old one)."""
        engines = self.engines
        try:
            engines.use(urls)
            engines.pause()
            send(stream)
            engines.commit(version)
        except BaseException as exc:
            drain(stream)
            engines.abort()
            if isinstance(exc, WeightSyncError) or not isinstance(exc, Exception):
                raise
            raise WeightSyncError(f"weight sync to version {version} failed: {exc}") from exc
        finally:
            self._resume_quietly()

    def _agree(self, error: str | None) -> list[str]:
        """Every rank's error at this point (a collective: all ranks call it); a dead peer is one."""
        import torch.distributed as dist

        errors = [None] * self.world_size
        try:
            dist.all_gather_object(errors, error)
            return [e for e in errors if e]
        except Exception as exc:  # noqa: BLE001  (a peer died mid-sync: its socket closed)
            return [e for e in (error, f"trainer rank {self.rank} lost a peer during the sync ({exc})") if e]

    def _begin(self, urls: list[str], version: str) -> None:
        """Rank 0 pauses generation on every engine; all ranks go on only if
        that worked (a dead engine fails the sync here, before any rank starts sending)."""
        error = None
        if self.rank == 0:
            try:
                self.engines.use(urls)
                self.engines.pause()
            except Exception as exc:  # noqa: BLE001  (shared with every rank just below)
                error = f"trainer rank 0: {exc}"
        failed = self._agree(error)
        if failed:
            if self.rank == 0:
                self._resume_quietly()
            raise WeightSyncError(f"weight sync to version {version} could not start: " + "; ".join(failed))

    def _resume_quietly(self) -> None:
        try:
            self.engines.resume()
        except WeightSyncError as exc:  # an engine is gone: the fleet restarts it
            log.warning("continue_generation after a failed sync: %s", exc)

    def _conclude(self, error: str | None, version: str, controls: bool | None = None) -> None:
        """After the senders: every rank learns every rank's error (a dead rank counts as one); the
        rank that controls this sync's engines (`controls`; rank 0 by default) commits (all
        succeeded) or aborts (the engines drop what they staged), then continues generation; every
        rank raises a WeightSyncError if any rank failed."""
        failed = self._agree(error)
        if self.rank == 0 if controls is None else controls:
            try:
                if failed:
                    self.engines.abort()
                else:
                    self.engines.commit(version)
            except WeightSyncError as exc:  # a commit that failed on an engine fails the sync
                failed = [str(exc)]
            finally:
                self._resume_quietly()
        if failed:
            self._broken()
            raise WeightSyncError(
                f"weight sync to version {version} failed; the engines keep serving their "
                "previous weights: " + "; ".join(failed)
            )

    def _broken(self) -> None:  # noqa: B027 (a hook: most transports keep no groups)
        """A failed sync left update groups unusable (gloo groups do not survive an error)."""


def drain(stream) -> None:
    """Consume what is left of an export stream (taking part in its collectives), keeping nothing."""
    try:
        for _ in stream:
            pass
    except Exception as exc:  # noqa: BLE001  (a peer is gone: the caller is already failing)
        log.warning("could not finish the export after a failed sync: %s", exc)
