"""prepare's console progress: the mode in force, and the plain lines a log file gets instead of a bar."""

from __future__ import annotations

import io

import pytest

from pilotrun.common.errors import DataError
from pilotrun.data.progress_bar import PlainBar, open_bar, progress_mode


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_is_the_bar_on_a_terminal_and_plain_elsewhere():
    assert progress_mode("auto", _Terminal()) == progress_mode(True, _Terminal()) == "bar"
    assert progress_mode("auto", io.StringIO()) == progress_mode(True, io.StringIO()) == "plain"
    assert progress_mode(False) == progress_mode("none") == "none"
    assert progress_mode("plain", _Terminal()) == "plain" and progress_mode("bar", io.StringIO()) == "bar"
    with pytest.raises(DataError, match="progress must be one of"):
        progress_mode("fancy")


def test_plain_lines_come_at_once_then_once_per_interval_and_at_close():
    now = [0.0]
    out = io.StringIO()
    bar = PlainBar(1000, "tok", "prepare (train tokens)", out, interval=10.0, clock=lambda: now[0])
    for step in range(1, 9):  # eight chunks, two seconds apart
        now[0] = 2.0 * step
        bar.update(100)
        bar.set_postfix(docs=10 * step, docs_per_s="5", refresh=False)
    bar.close()
    assert out.getvalue().splitlines() == [
        # the first chunk
        "prepare (train tokens): 100/1,000 tok (10%), 2 s, ETA 18 s, docs 10, docs_per_s 5",
        "prepare (train tokens): 600/1,000 tok (60%), 12 s, ETA 8 s, docs 60, docs_per_s 5",  # 10 s later
        "prepare (train tokens): 800/1,000 tok (80%), 16 s, ETA 4 s, docs 80, docs_per_s 5",  # at close
    ]


def test_a_line_already_shown_is_not_repeated_at_close_and_an_open_count_has_no_total():
    out = io.StringIO()
    bar = PlainBar(None, "tok", "prepare (train tokens)", out, clock=lambda: 0.0)
    bar.update(42)
    bar.set_postfix(docs=3)
    bar.close()
    assert out.getvalue() == "prepare (train tokens): 42 tok, 0 s, docs 3\n"


def test_the_bar_by_mode():
    out = io.StringIO()
    assert isinstance(open_bar(10, "doc", "prepare (documents)", "auto", out), PlainBar)
    quiet = open_bar(10, "doc", "prepare (documents)", "none", out)
    quiet.update(3)
    quiet.close()
    assert (quiet.total, out.getvalue()) == (10, "")  # still holds its total: prepare reads it
