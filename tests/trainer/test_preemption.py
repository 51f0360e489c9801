"""Stopping on a signal (trainer/preemption.py): SIGTERM, SIGUSR1 or a first Ctrl-C ask for a stop
at the step boundary; a second Ctrl-C, or a step longer than the grace period, stops at once.
Real runs stopped this way and resumed: test_preemption_runs.py."""

from __future__ import annotations

import io
import os
import signal
import threading
import time

import pytest

from megarl.trainer.preemption import GracefulStop, StopNow


def _deliver(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0)  # Python runs the handler at the next bytecode boundary of the main thread


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_first_signal_asks_for_a_stop_without_interrupting(signum):
    stop, out = GracefulStop(grace_s=60, stream=io.StringIO()), None
    with stop.handling(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        _deliver(signum)
        out = stop._stream.getvalue()
        assert stop.requested and stop.signal == signal.Signals(signum).name
        _deliver(signal.SIGTERM)  # a repeated SIGTERM (schedulers send several) changes nothing
    assert out.startswith(f"megarl: {signal.Signals(signum).name} received: finishing this step")
    assert signal.getsignal(signal.SIGTERM) is not stop._handle  # the previous handlers are back


def test_a_second_ctrl_c_stops_at_once():
    stop = GracefulStop(grace_s=60, stream=io.StringIO())
    with pytest.raises(StopNow, match="interrupted again"), stop.handling(signal.SIGTERM, signal.SIGINT):
        _deliver(signal.SIGTERM)
        _deliver(signal.SIGINT)


def test_a_step_longer_than_the_grace_period_is_interrupted():
    stop = GracefulStop(grace_s=0.2, stream=io.StringIO())
    deadline = time.monotonic() + 30
    with pytest.raises(StopNow, match="did not end within trainer.stop_grace_s=0.2 s of SIGTERM"):
        with stop.handling(signal.SIGTERM, signal.SIGINT):
            _deliver(signal.SIGTERM)
            while time.monotonic() < deadline:  # a step that never ends
                time.sleep(0.01)
    assert time.monotonic() < deadline


def test_off_the_main_thread_nothing_is_installed():
    stop, seen = GracefulStop(grace_s=1), []

    def work():
        with stop.handling(signal.SIGTERM):
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [before]
