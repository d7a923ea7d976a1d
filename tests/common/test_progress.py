"""pilotrun/common/progress.py: the one plain progress line of prepare, train and the pilot: the first figures
at once, then at most one line per interval, the last at close, never the same figures twice, never a carriage
return."""

from __future__ import annotations

import io

from pilotrun.common import progress as plain_progress
from pilotrun.common.progress import PLAIN_INTERVAL_SECONDS, PlainLine


def test_the_first_at_once_then_at_most_one_per_interval_and_the_last_at_close():
    now = [0.0]
    out = io.StringIO()
    line = PlainLine(out, clock=lambda: now[0])
    assert line.interval == PLAIN_INTERVAL_SECONDS == 10.0
    for second in range(0, 22, 3):  # figures every 3 s for 21 s
        now[0] = float(second)
        line.offer(second, lambda at, second=second: f"figures of {second} s, written at {at:.0f} s")
    now[0] = 25.0
    line.close()
    assert out.getvalue().splitlines() == ["figures of 0 s, written at 0 s",  # at once
                                           "figures of 12 s, written at 12 s",  # the first offer 10 s later
                                           "figures of 21 s, written at 25 s"]  # the last, rendered at close
    assert "\r" not in out.getvalue()


def test_the_same_figures_are_never_written_twice():
    now = [0.0]
    out = io.StringIO()
    line = PlainLine(out, interval=1.0, clock=lambda: now[0])
    for second in range(5):
        now[0] = float(second)
        line.offer("same", lambda at: "same")
    line.close()
    assert out.getvalue() == "same\n"


def test_nothing_offered_writes_nothing_and_the_interval_is_read_when_a_line_starts(monkeypatch):
    out = io.StringIO()
    PlainLine(out).close()
    assert out.getvalue() == ""
    monkeypatch.setattr(plain_progress, "PLAIN_INTERVAL_SECONDS", 0.0)
    every = PlainLine(out, clock=lambda: 0.0)
    for n in range(3):
        every.offer(n, lambda at, n=n: f"line {n}")
    assert out.getvalue().splitlines() == ["line 0", "line 1", "line 2"]
