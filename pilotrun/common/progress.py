"""Progress as plain lines, what a log file can hold: prepare's and the pilot's at one cadence, train's one
per window (an interval of 0: training/callbacks/window_log.PlainProgress).

A redrawn bar (tqdm, the pilot's line on a terminal) rewrites its line with carriage returns, which a terminal
shows as one moving line but a log file (nohup, slurm, the pilot's captured output) keeps as one endless line.
Off a terminal every command writes `PlainLine`s instead: the first figures at once (a start is visible), then
at most one line per `PLAIN_INTERVAL_SECONDS` (a 2-hour prepare is a few hundred lines of log), and the last
figures at close when they were not the last line written (the end is visible). The same figures are never
written twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TextIO

PLAIN_INTERVAL_SECONDS = 10.0
_NOTHING = object()  # the figures of no line yet


class PlainLine:
    """`offer(figures, render)` new figures; `close()` at the end. `render(now)` makes the line's text when it
    is written (so that a line written at close says the time of the close); `figures` is what makes two
    offers the same (a line already written for them is not written again). `interval` None:
    PLAIN_INTERVAL_SECONDS."""

    def __init__(self, out: TextIO, interval: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.out, self.clock = out, clock
        self.interval = PLAIN_INTERVAL_SECONDS if interval is None else interval
        self.written_at: float | None = None
        self.written: Hashable = _NOTHING
        self.figures: Hashable = _NOTHING
        self.render: Callable[[float], str] | None = None

    def offer(self, figures: Hashable, render: Callable[[float], str]) -> None:
        self.figures, self.render = figures, render
        if figures == self.written:
            return
        now = self.clock()
        if self.written_at is None or now - self.written_at >= self.interval:
            self._write(now)

    def close(self) -> None:
        if self.render is not None and self.figures != self.written:
            self._write(self.clock())

    def _write(self, now: float) -> None:
        self.written_at, self.written = now, self.figures
        print(self.render(now), file=self.out, flush=True)
