"""Progress of a long step: units done / total, time elapsed and an estimate of the time left.

A step that runs for minutes without a word cannot be told from a hang. Every command that has such
steps (convert, calibration, builder build, the decode benchmark) shows them through `track`:
- on a terminal, a rich bar (units done / total, elapsed, time left), erased when the step ends;
- otherwise (a pipe, a CI log) one plain line every `line_seconds()` while the step runs, from a
  timer thread, so the log says the step is alive even while a single unit takes long, and a log
  holds no bar redraws. A step that ends sooner prints nothing here; its caller says when it ended.

The estimate assumes the units left cost what the units done cost on average.

No torch and no rich at import (rich is imported only to draw a bar, and lines are used when it is
missing), so anything may use this module, the runtime included.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

# seconds between two progress lines when the output is not a terminal: "a line every few seconds"
LINE_SECONDS = 5.0
# environment override of LINE_SECONDS (a CI that wants fewer lines, a test that wants them sooner)
SECONDS_ENV = "GSM_EDGE_PROGRESS_SECONDS"


def line_seconds() -> float:
    """Seconds between progress lines: $GSM_EDGE_PROGRESS_SECONDS, else LINE_SECONDS."""
    text = os.environ.get(SECONDS_ENV)
    if text is None or not text.strip():
        return LINE_SECONDS
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{SECONDS_ENV}={text!r}: expected a number of seconds > 0")
    return v


def duration(seconds: float) -> str:
    """A short human duration: 42 s, 3 min 05 s, 1 h 02 min."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _count(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() or x >= 10 else f"{x:,.1f}"


class Progress:
    """One step's counter: `advance(n)` adds units done. Use through `track`."""

    def __init__(self, name: str, total: float | None, unit: str, log: Callable[[str], Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.total, self.unit, self.log, self.clock = name, total, unit, log, clock
        self.done = 0.0
        self.t0 = clock()
        self._bar: Any = None
        self._task: Any = None
        self._lock = threading.Lock()

    def __call__(self, n: float = 1) -> None:
        self.advance(n)

    def advance(self, n: float = 1) -> None:
        with self._lock:
            self.done += n
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def set_total(self, total: float | None) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def describe(self, name: str) -> None:
        """Name the part of the step that runs now (a build moving from one graph to the next)."""
        self.name = name
        if self._bar is not None:
            self._bar.update(self._task, description=name)

    def restart(self, name: str, total: float | None = None) -> None:
        """Count a new part of the step from zero: its own units, total and elapsed time."""
        self.name, self.total, self.done, self.t0 = name, total, 0.0, self.clock()
        if self._bar is not None:  # a new task: rich's reset keeps a total it is given as None
            self._bar.remove_task(self._task)
            self._task = self._bar.add_task(name, total=total, unit=self.unit)

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def eta(self) -> float | None:
        """Seconds left at the average rate so far; None before the first unit or without a total."""
        if self.total is None or self.done <= 0:
            return None
        return max(0.0, self.total - self.done) * self.elapsed() / self.done

    def line(self) -> str:
        """`name: 12/48 chunks (25 %), 40 s elapsed, about 2 min 00 s left`."""
        el = duration(self.elapsed())
        if self.total is None:
            counted = f" {_count(self.done)} {self.unit}," if self.done else ""
            return f"{self.name}:{counted} {el} elapsed"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta = self.eta()
        left = "time left unknown until a unit is done" if eta is None else f"about {duration(eta)} left"
        return f"{self.name}: {_count(self.done)}/{_count(self.total)} {self.unit} ({pct:.0f} %), {el} elapsed, {left}"


@contextmanager
def track(name: str, total: float | None = None, unit: str = "steps", *, log: Callable[[str], Any] | None = None,
          bar: bool | None = None, every: float | None = None, stream: TextIO | None = None,
          end_line: bool = True) -> Iterator[Progress]:
    """Show the progress of the step run inside the block; yields the Progress (call it, or `.advance(n)`).

    log: where lines go (default: stderr); bar: a rich bar (default: when `stream`, default stderr, is a
    terminal and rich is installed); every: seconds between lines without a bar (default `line_seconds()`);
    end_line: without a bar, a step that printed progress lines also says when it ended (`name: done in 42 s`),
    so the next step's first line never comes more than one interval after the last one (callers that print
    their own end line pass False).
    """
    stream = stream if stream is not None else sys.stderr
    log = log if log is not None else (lambda m: print(m, file=stream, flush=True))
    every = line_seconds() if every is None else every
    p = Progress(name, total, unit, log)
    if bar is None:
        bar = _isatty(stream)
    progress = _rich_progress(stream) if bar else None
    if progress is not None:
        with progress:
            p._bar, p._task = progress, progress.add_task(name, total=total, unit=unit)
            try:
                yield p
            finally:
                p._bar = None
        return
    stop = threading.Event()
    ticks = [0]

    def tick() -> None:
        while not stop.wait(every):
            log(p.line())
            ticks[0] += 1

    ticker = threading.Thread(target=tick, name=f"progress: {name}", daemon=True)
    ticker.start()
    try:
        yield p
    finally:
        stop.set()
        ticker.join()
    if end_line and ticks[0]:
        log(f"{p.name}: done in {duration(p.clock() - p.t0)}")


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or stand-in stream
        return False


def _rich_progress(stream: TextIO) -> Any:
    """A transient rich Progress on `stream`: description, bar, units, elapsed, time left; None without rich."""
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            ProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text
    except ImportError:
        return None

    class Units(ProgressColumn):
        def render(self, task: Any) -> Text:
            unit = task.fields.get("unit", "")
            if task.total is None:
                return Text(f"{_count(task.completed)} {unit}")
            return Text(f"{_count(task.completed)}/{_count(task.total)} {unit}")

    return Progress(TextColumn("{task.description}"), BarColumn(), Units(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=Console(file=stream), transient=True)
