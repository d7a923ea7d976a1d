"""summarize: a session logs nothing after its session_end; events that follow it (a stall that ended after
the watchdog declared the session hung) are named as a break of the record, not counted as the session's
work."""

from __future__ import annotations

from pilotrun.report.record_check.summarize import summarize_run
from tests.report.synthetic import SyntheticRun


def test_events_after_a_sessions_end_are_a_break_of_the_record(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(10)
    run.end_session("hung")
    run.train_until(14)  # the stall ended: the same session goes on writing
    run.end_session("completed")
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert not summary.valid
    breaks = [r for r in summary.reasons if "after this session's session_end" in r]
    assert len(breaks) == 1 and "(hung at step 10)" in breaks[0] and "the record breaks here" in breaks[0]


def test_a_session_that_ends_once_is_not_a_break(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(10)
    run.end_session("hung")
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert not [r for r in summary.reasons if "after this session's session_end" in r]
