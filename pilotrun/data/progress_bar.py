"""prepare's progress on the console: a redrawn bar on a terminal, plain lines in a log.

`pilotrun prepare --progress auto|bar|plain|none`, as `pilotrun train --progress`: a tqdm bar redraws its line
with carriage returns, which a terminal shows as one moving line but a log file (nohup, slurm, the pilot's
captured output) keeps as one endless line. So `auto` draws the bar only when stderr is a terminal and writes
plain lines otherwise, at every command's cadence (pilotrun/common/progress.py); `bar` and `plain` choose
either; `none` shows nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from pilotrun.common.errors import DataError
from pilotrun.common.progress import PlainLine

MODES = ("auto", "bar", "plain", "none")


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
    lines (PlainLine): the first figures at once, then at most one line per `interval` seconds, and the last
    at close."""

    def __init__(self, total: int | None, unit: str, desc: str, out: TextIO,
                 interval: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.unit, self.desc = total, unit, desc
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self.started = clock()
        self.line = PlainLine(out, interval, clock)

    def update(self, count: int) -> None:
        self.n += count

    def set_postfix(self, refresh: bool = True, **fields: Any) -> None:
        self.postfix = fields
        self.line.offer((self.n, tuple(self.postfix.items())), self._text)

    def close(self) -> None:
        self.line.offer((self.n, tuple(self.postfix.items())), self._text)  # counted since the last figures
        self.line.close()

    def _text(self, now: float) -> str:
        elapsed = now - self.started
        if self.total:
            done = f"{self.n:,}/{self.total:,} {self.unit} ({100.0 * self.n / self.total:.0f}%)"
            rate = self.n / elapsed if elapsed > 0 else 0.0
            eta = f", ETA {(self.total - self.n) / rate:.0f} s" if 0 < rate and self.n < self.total else ""
        else:
            done, eta = f"{self.n:,} {self.unit}", ""
        fields = "".join(f", {key} {value:,}" if isinstance(value, int) else f", {key} {value}"
                         for key, value in self.postfix.items())
        return f"{self.desc}: {done}, {elapsed:.0f} s{eta}{fields}"


def open_bar(total: int | None, unit: str, desc: str, progress: bool | str, out: TextIO | None = None) -> Any:
    """A tqdm bar, a PlainBar, or a disabled tqdm (which still holds `total` and counts `n`), by the mode."""
    out = sys.stderr if out is None else out
    mode = progress_mode(progress, out)
    if mode == "plain":
        return PlainBar(total, unit, desc, out)
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=True, desc=desc, file=out, disable=mode == "none",
                dynamic_ncols=True)
