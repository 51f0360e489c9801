"""When a worker's engine parts leave the device (colocation with rollout engines and other groups).

Configured parts (`OffloadConfig`: params, grads, optimizer) live in host memory between calls and
come back only for the calls that need them: a forward needs the parameters, an update needs all
three. The time spent moving them is reported with the worker's metrics.
"""

from __future__ import annotations

import contextlib
import time

from megarl.config.schema import OffloadConfig


class OffloadPolicy:
    def __init__(self, engine, config: OffloadConfig | None):
        self.engine = engine
        self.config = config or OffloadConfig()
        self._seconds = {"offload": 0.0, "onload": 0.0}

    @property
    def enabled(self) -> bool:
        c = self.config
        return c.params or c.grads or c.optimizer

    def release(self, params: bool = True) -> None:
        """Offload the configured parts (the parameters only when `params`)."""
        if not self.enabled:
            return
        c = self.config
        start = time.perf_counter()
        self.engine.offload(params=c.params and params, grads=c.grads, optimizer=c.optimizer)
        self._seconds["offload"] += time.perf_counter() - start

    def _bring_back(self, **parts) -> None:
        if self.engine.offloaded():
            start = time.perf_counter()
            self.engine.onload(**parts)
            self._seconds["onload"] += time.perf_counter() - start

    @contextlib.contextmanager
    def forward(self, release_after: bool = True):
        """Parameters on the device inside; released afterwards unless `release_after` is False."""
        self._bring_back(params=True, grads=False, optimizer=False)
        yield
        if release_after:
            self.release()

    @contextlib.contextmanager
    def update(self, keep_params: bool = False):
        """Everything on the device inside; afterwards the configured parts leave again (the
        parameters stay when `keep_params`, e.g. for the weight sync that follows an update)."""
        self._bring_back(params=True, grads=True, optimizer=True)
        yield
        self.release(params=not keep_params)

    def metrics(self, prefix: str) -> dict:
        """Seconds spent moving since the last call (then reset); empty when nothing is offloaded."""
        if not self.enabled:
            return {}
        out = {f"perf/{prefix}_offload_s": self._seconds["offload"], f"perf/{prefix}_onload_s": self._seconds["onload"]}
        self._seconds = {"offload": 0.0, "onload": 0.0}
        return out
