"""Notice a dead trainer rank while the controller waits on something else (the rollout).

A rank that dies during an actor call is found at once (worker_group._gather waits on every rank).
During generation the controller calls no actor, so a dead rank would go unnoticed until the next
call, minutes later for long rollouts. Inside `RankWatch(groups, on_death)` a thread checks every
`every_s` that each group's ranks are alive (one no-op RPC per rank per check, none at all for a
phase shorter than `every_s`); on a death it calls `on_death()` (the trainer aborts the engines'
requests so generation returns) and the block raises the rank's WorkerError when it ends.
"""

from __future__ import annotations

import threading


class RankWatch:
    def __init__(self, groups: list, on_death, every_s: float = 5.0):
        self.groups, self.on_death, self.every_s = [g for g in groups if g is not None], on_death, every_s
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RankWatch:
        self._thread = threading.Thread(target=self._watch, name="rank-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:  # what the block failed with is a consequence (aborted requests)
            raise self.error from exc

    def _watch(self) -> None:
        from megarl.controller.worker_group import WorkerError

        while not self._stop.wait(self.every_s):
            try:
                for group in self.groups:
                    group.check_alive(timeout_s=self.every_s)
            except WorkerError as err:
                self.error = err
                self.on_death()
                return
