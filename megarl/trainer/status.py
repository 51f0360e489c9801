"""The status line: on a terminal, one line under the step lines saying what the trainer is doing
now, and how many of the step's rows are generated while it generates:

    step 4/200 | reward 0.035 | ... | s/step 0.31 | elapsed 24s
    generate 96/256 rows, 3 s

It names the phase every `step_metrics.timer` block times (generate, reward, old log-probs,
actor update, weight sync, ...) and the blocks wrapped in `phase` (validation, a checkpoint's
save); a phase on another thread (one_step_off's rollout of the next batch) follows as
"background: ...". `shown_on(stream)` draws it (rich's Live, redrawn twice a second) while the
run writes its lines through the stream it returns: each line is written whole above the status
line, which is cleared first and drawn again below it, byte for byte what the stream would have
got; so are lines printed to sys.stdout / sys.stderr meanwhile (Ray's forwarded worker output)
when they are the terminal. It never reaches train.log. When the stream is not a terminal (CI, a
pipe, a file, TERM=dumb) there is no status line: `shown_on` hands back the stream itself, and a
phase costs one check of a module global.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator

LABELS = {
    "gen": "generate",
    "gen_baseline": "generate greedy baselines",
    "gen_wait": "wait for the rollout",
    "gen_overlap_wait": "wait for the next batch's rollout",
    "reward": "reward",
    "release": "engines release memory",
    "old_log_prob": "old log-probs",
    "ref": "reference log-probs",
    "values": "values",
    "adv": "advantages",
    "critic_update": "critic update",
    "update": "actor update",
    "resume": "engines reload weights",
    "sync": "weight sync",
    "resume_kv": "engines re-allocate KV cache",
}


class Phase:
    """One phase in progress on one thread; `total` rows when they are counted."""

    def __init__(self, name: str):
        self.label = LABELS.get(name, name.replace("_", " "))
        self.started = time.perf_counter()
        self.done, self.total = 0, None

    def describe(self, now: float) -> str:
        rows = f" {self.done}/{self.total} rows" if self.total is not None else ""
        return f"{self.label}{rows}, {now - self.started:.0f} s"


class StatusLine:
    """The line itself: the phases in progress by thread, drawn by a rich Live on `console`."""

    def __init__(self, console):
        from rich.live import Live

        self.console = console
        self.owner = threading.get_ident()  # the loop's thread: its phase comes first
        self.stacks: dict[int, list[Phase]] = {}
        self.lock = threading.Lock()
        self.last_refresh = 0.0
        self.live = Live(
            console=console,
            get_renderable=self.render,
            transient=True,  # cleared at the end: the terminal keeps only the run's lines
            refresh_per_second=2,
            redirect_stdout=False,  # shown_on routes them itself, byte for byte
            redirect_stderr=False,
        )

    def render(self):
        from rich.text import Text

        now = time.perf_counter()
        with self.lock:
            tops = {t: stack[-1] for t, stack in self.stacks.items() if stack}
        parts = [tops.pop(self.owner).describe(now)] if self.owner in tops else []
        parts += [f"background: {p.describe(now)}" for p in tops.values()]
        # cropped to the width: a wrapped line would not be cleared whole
        return Text(" | ".join(parts), style="dim", no_wrap=True, overflow="ellipsis")

    def enter(self, name: str) -> Phase:
        phase = Phase(name)
        with self.lock:
            self.stacks.setdefault(threading.get_ident(), []).append(phase)
        self.refresh()
        return phase

    def leave(self, phase: Phase) -> None:
        with self.lock:
            stack = self.stacks.get(threading.get_ident(), [])
            if phase in stack:
                stack.remove(phase)
        self.refresh()  # else the finished phase would show under the lines written until the next tick

    def refresh(self, at_most_every_s: float = 0.0) -> None:
        now = time.perf_counter()
        if now - self.last_refresh >= at_most_every_s:
            self.last_refresh = now
            self.live.refresh()


class LineWriter:
    """A text stream for the terminal under the status line: whole lines go above it, a partial
    line waits for its end (the status line's redraw would erase it)."""

    def __init__(self, line: StatusLine, stream):
        self.line, self.stream, self.pending = line, stream, ""
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            head, newline, tail = (self.pending + text).rpartition("\n")
            self.pending = tail
        if newline:
            self.line.console.print(_Raw(head + newline), end="", soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        with self.lock:
            text, self.pending = self.pending, ""
        if text:
            self.line.console.print(_Raw(text + "\n"), end="", soft_wrap=True)
        self.stream.flush()

    def __getattr__(self, name: str):  # isatty, fileno, encoding, ...: the terminal's
        return getattr(self.stream, name)


class _Raw:
    """Text written exactly as given (rich would expand tabs and read markup in a str)."""

    def __init__(self, text: str):
        self.text = text

    def __rich_console__(self, console, options):
        from rich.segment import Segment

        yield Segment(self.text)


_line: StatusLine | None = None  # the status line shown now, if any (one terminal per process)


@contextlib.contextmanager
def shown_on(stream) -> Iterator:
    """A status line under what is written to `stream` while the block runs, when `stream` is a
    terminal; yields the stream to write lines to (`stream` itself when it is not one)."""
    global _line
    if _line is not None or not _isatty(stream):
        yield stream
        return
    from rich.console import Console

    console = Console(file=stream, highlight=False)
    if not console.is_interactive:  # TERM=dumb: no cursor control
        yield stream
        return
    line = StatusLine(console)
    writer = LineWriter(line, stream)
    swapped = {name: getattr(sys, name) for name in ("stdout", "stderr") if _isatty(getattr(sys, name))}
    line.live.start(refresh=True)  # drawn (empty) now: the first line written clears it too
    _line = line
    try:
        for name, original in swapped.items():
            setattr(sys, name, writer if original is stream else LineWriter(line, original))
        yield writer
    finally:
        for name, original in swapped.items():
            getattr(sys, name).flush()
            setattr(sys, name, original)
        writer.flush()
        _line = None
        line.live.stop()


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def enter(name: str) -> Phase | None:
    """The trainer begins phase `name` (a timer's name); None when no status line is shown."""
    return _line.enter(name) if _line is not None else None


def leave(phase: Phase | None) -> None:
    if phase is not None and _line is not None:
        _line.leave(phase)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A phase no timer measures (validation, a checkpoint's save)."""
    current = enter(name)
    try:
        yield
    finally:
        leave(current)


def counting(on_rows: Callable | None, total: int) -> Callable | None:
    """RolloutManager.generate's `on_rows` callback that also counts the rows generated into the
    current phase (out of `total`), then calls `on_rows`; `on_rows` itself without a status line."""
    line = _line
    if line is None:
        return on_rows
    with line.lock:
        stack = line.stacks.get(threading.get_ident())
        current = stack[-1] if stack else None
    if current is None:
        return on_rows
    current.total = total

    def count(prompt_indices: list[int], outputs: list[list]) -> None:
        current.done += sum(len(o) for o in outputs)
        line.refresh(at_most_every_s=0.0 if current.done >= total else 0.25)
        if on_rows is not None:
            on_rows(prompt_indices, outputs)

    return count
