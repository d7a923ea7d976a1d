"""prepare's progress on the console: a redrawn bar on a terminal, plain lines in a log.

`pilotrun prepare --progress auto|bar|plain|none`, as `pilotrun train --progress`: a tqdm bar redraws its line
with carriage returns, which a terminal shows as one moving line but a log file (nohup, slurm, the pilot's
captured output) keeps as one endless line. So `auto` draws the bar only when stderr is a terminal and writes
one plain line per interval otherwise; `bar` and `plain` choose either; `none` shows nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from pilotrun.errors import DataError

MODES = ("auto", "bar", "plain", "none")
# A long prepare off a terminal writes a line this often: a 2-hour prepare is ~700 lines of log, and a small
# one still gets its first line at once and its last at the end.
PLAIN_INTERVAL_SECONDS = 10.0


def progress_mode(progress: bool | str, stream: TextIO | None = None) -> str:
    """The mode in force: True or "auto" -> "bar" when `stream` (stderr) is a terminal, else "plain"; False or
    "none" -> "none"; "bar" and "plain" as given."""
    mode = {True: "auto", False: "none"}[progress] if isinstance(progress, bool) else progress
    if mode not in MODES:
        raise DataError(f"progress must be one of {', '.join(MODES)}, got {progress!r}")
    if mode == "auto":
        stream = sys.stderr if stream is None else stream
        mode = "bar" if bool(getattr(stream, "isatty", lambda: False)()) else "plain"
    return mode


class PlainBar:
    """The part of tqdm's interface prepare uses (`n`, `total`, `update`, `set_postfix`, `close`) as plain
    lines: the first figures at once, then at most one line per `interval` seconds, and the last at close."""

    def __init__(self, total: int | None, unit: str, desc: str, out: TextIO,
                 interval: float = PLAIN_INTERVAL_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.unit, self.desc, self.out = total, unit, desc, out
        self.interval, self.clock = interval, clock
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self.started = clock()
        self.last_line: float | None = None
        self.shown: tuple | None = None

    def update(self, count: int) -> None:
        self.n += count

    def set_postfix(self, refresh: bool = True, **fields: Any) -> None:
        self.postfix = fields
        if self.last_line is None or self.clock() - self.last_line >= self.interval:
            self._line()

    def close(self) -> None:
        if self.shown != (self.n, tuple(self.postfix.items())):
            self._line()

    def _line(self) -> None:
        self.last_line = self.clock()
        self.shown = (self.n, tuple(self.postfix.items()))
        elapsed = self.last_line - self.started
        if self.total:
            done = f"{self.n:,}/{self.total:,} {self.unit} ({100.0 * self.n / self.total:.0f}%)"
            rate = self.n / elapsed if elapsed > 0 else 0.0
            eta = f", ETA {(self.total - self.n) / rate:.0f} s" if 0 < rate and self.n < self.total else ""
        else:
            done, eta = f"{self.n:,} {self.unit}", ""
        fields = "".join(f", {key} {value:,}" if isinstance(value, int) else f", {key} {value}"
                         for key, value in self.postfix.items())
        print(f"{self.desc}: {done}, {elapsed:.0f} s{eta}{fields}", file=self.out, flush=True)


def open_bar(total: int | None, unit: str, desc: str, progress: bool | str, out: TextIO | None = None) -> Any:
    """A tqdm bar, a PlainBar, or a disabled tqdm (which still holds `total` and counts `n`), by the mode."""
    out = sys.stderr if out is None else out
    mode = progress_mode(progress, out)
    if mode == "plain":
        return PlainBar(total, unit, desc, out)
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=True, desc=desc, file=out, disable=mode == "none",
                dynamic_ncols=True)
