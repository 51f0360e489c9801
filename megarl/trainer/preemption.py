"""Stopping on a signal without losing the run.

SIGTERM (a Slurm time limit or preemption, `docker stop`, Kubernetes), SIGUSR1 (Slurm's
`--signal=B:USR1@SECONDS` ahead of the time limit: launch/slurm.sbatch) and a first Ctrl-C ask the
loop to stop at the next step boundary: the step in progress finishes, the rollout source stops,
a checkpoint is saved (unless that step's was just saved) and `megarl train` exits 0 with one line
saying where; `trainer.resume=auto` continues from it.

    signal --> finish the step --> stop generating --> save --> exit 0
      |                                                  (within trainer.stop_grace_s of the signal)
      +-- second Ctrl-C, or the grace is over --> stop at once (exit 130; the last checkpoint stands)

A repeated SIGTERM or SIGUSR1 changes nothing (schedulers may send several). Handlers are the
main thread's (Python delivers signals there); the loop runs there. Before the loop starts (Ray
and the model coming up) SIGTERM and Ctrl-C stop at once (controller/cluster.py): nothing to save
yet; SIGUSR1 is noted and honoured after the first step.
"""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import signal
import sys
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@dataclasses.dataclass
class Stopped:
    """How a run that stopped on a signal ended."""

    signal: str
    step: int
    total_steps: int
    checkpoint: str

    def line(self) -> str:
        return (
            f"megarl: stopped by {self.signal} after step {self.step}/{self.total_steps}; checkpoint "
            f"{self.checkpoint}; continue with trainer.resume=auto"
        )


class StopNow(KeyboardInterrupt):
    """Stop at once: a second Ctrl-C, or the step did not end within the grace period."""


class GracefulStop:
    def __init__(self, grace_s: float, stream=None):
        self.grace_s = grace_s
        self.signal: str | None = None  # the first stop signal's name
        self._stream = stream
        self._over = False
        self._timer: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @contextlib.contextmanager
    def handling(self, *signums: int) -> Iterator[None]:
        """Our handler for `signums` inside the block, the previous ones after it. Off the main
        thread (where Python cannot install handlers) a no-op."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.getsignal(s) for s in signums}
        for s in signums:
            signal.signal(s, self._handle)
        try:
            yield
        finally:
            if self._timer is not None and signal.SIGINT in signums:  # the loop is over
                self._timer.cancel()
            for s, handler in previous.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal = name
            self._say(
                f"megarl: {name} received: finishing this step, then saving a checkpoint and stopping "
                f"(within trainer.stop_grace_s={self.grace_s:g} s; Ctrl-C again stops at once)"
            )
            self._timer = threading.Timer(self.grace_s, self._grace_over)
            self._timer.daemon = True
            self._timer.start()
            return
        if self._over:
            raise StopNow(
                f"the step did not end within trainer.stop_grace_s={self.grace_s:g} s of {self.signal}; "
                "stopped without saving (the last checkpoint stands)"
            )
        if signum == signal.SIGINT:
            raise StopNow("interrupted again while stopping; stopped without saving (the last checkpoint stands)")

    def _grace_over(self) -> None:
        self._over = True
        _thread.interrupt_main(signal.SIGINT)  # runs _handle in the main thread

    def _say(self, text: str) -> None:
        stream = self._stream or sys.stderr
        stream.write(text + "\n")
        stream.flush()
