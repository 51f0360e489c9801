"""The status line: the phase and rows on a terminal, above it the step lines byte for byte;
nothing at all on a stream that is not a terminal."""

from __future__ import annotations

import io
import sys
import threading

from megarl.trainer import status
from megarl.trainer.metrics import MetricsLogger
from megarl.trainer.run import Tee
from megarl.trainer.step_metrics import timer

CLEAR = "\r\x1b[2K"  # carriage return, erase the line: the status line is gone before a line


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


METRICS = {"reward/mean": 0.25, "response/length_mean": 2.0, "actor/entropy": 1.5, "perf/step_s": 0.5}


def one_step(terminal, logger: MetricsLogger, step: int) -> dict:
    """What a step does with the status line: timed phases, rows counted while generating."""
    timing: dict = {}
    seen = []
    with timer(timing, "gen"):
        on_rows = status.counting(lambda idx, outs: seen.append(idx), 8)
        on_rows([0], [["row"] * 4])
        on_rows([1], [["row"] * 4])
    with timer(timing, "update"):
        pass
    with timer(timing, "sync"):
        pass
    with status.phase("validation"):
        pass
    logger.log(step, METRICS)
    assert seen == [[0], [1]]  # the callback it wraps still gets every request's prompts
    return timing


def test_a_terminal_shows_the_phases_and_rows_and_keeps_the_step_lines_intact():
    tty, plain = FakeTTY(), io.StringIO()
    with status.shown_on(tty) as terminal:
        assert terminal is not tty
        logger = MetricsLogger(None, 2, stream=Tee(terminal, plain))  # plain: what a log file gets
        timing = one_step(terminal, logger, 1)
        logger.note("saved checkpoint somewhere")
        terminal.write("a line written ")  # in two writes: it waits for its end, whole
        terminal.write("in two parts\n")
        one_step(terminal, logger, 2)
    out = tty.getvalue()
    for label in ("generate", "actor update", "weight sync", "validation"):
        assert label in out, out
    assert "generate 8/8 rows" in out
    assert {"perf/gen_s", "perf/update_s", "perf/sync_s"} <= set(timing)
    # every line the plain stream got is on the terminal unchanged, on a line the status line left
    lines = plain.getvalue().splitlines(keepends=True)
    assert len(lines) == 3 and lines[0].startswith("step 1/2 | reward 0.250 | len 2.00 | ent 1.500")
    for line in lines:
        assert CLEAR + line in out, (line, out)
    assert CLEAR + "a line written in two parts\n" in out
    assert "\x1b" not in plain.getvalue() and "generate" not in plain.getvalue()
    assert out.endswith("\x1b[2K")  # the status line is erased at the end
    assert "\n\x1b[2mvalidation" not in out  # a finished phase is not drawn again under a line
    assert status._line is None


def test_a_stream_that_is_not_a_terminal_gets_no_status_at_all():
    plain = io.StringIO()
    with status.shown_on(plain) as terminal:
        assert terminal is plain and status._line is None
        wrapped = lambda idx, outs: None  # noqa: E731
        assert status.counting(wrapped, 8) is wrapped and status.counting(None, 8) is None
        logger = MetricsLogger(None, 2, stream=terminal)
        one_step(terminal, logger, 1)
        one_step(terminal, logger, 2)
    lines = plain.getvalue().splitlines()
    assert [line.split(" | elapsed")[0] for line in lines] == [
        "step 1/2 | reward 0.250 | len 2.00 | ent 1.500 | s/step 0.50",
        "step 2/2 | reward 0.250 | len 2.00 | ent 1.500 | s/step 0.50",
    ]
    assert "\x1b" not in plain.getvalue() and "\r" not in plain.getvalue()


def test_a_phase_on_another_thread_shows_as_background():
    tty = FakeTTY()
    entered, release = threading.Event(), threading.Event()

    def rollout_ahead():
        with timer({}, "gen"):
            status.counting(None, 16)
            entered.set()
            release.wait(timeout=30)

    with status.shown_on(tty):
        with timer({}, "update"):
            worker = threading.Thread(target=rollout_ahead)
            worker.start()
            assert entered.wait(timeout=30)
            status._line.refresh()
            release.set()
            worker.join(timeout=30)
    assert "actor update" in tty.getvalue() and "background: generate 0/16 rows" in tty.getvalue()


def test_prints_on_the_terminal_meanwhile_go_above_the_status_line(monkeypatch):
    """Ray forwards the workers' output with print() to sys.stdout / sys.stderr."""
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stdout", tty)
    with status.shown_on(tty):
        with timer({}, "update"):
            print("(MegatronActor pid=4242) a worker's line")
        assert sys.stdout is not tty
    assert sys.stdout is tty
    assert CLEAR + "(MegatronActor pid=4242) a worker's line\n" in tty.getvalue()
