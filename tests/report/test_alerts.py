"""pilotrun/report/alerts.py: each alert's condition on a record, with a handed-in clock and lock holder."""

from __future__ import annotations

import pytest

from pilotrun.report.alerts import Watcher, envelope_bound
from tests.report.synthetic import SyntheticRun, crashed_and_resumed


def _killed(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(33)
    run.kill()
    return run.write(), run


def test_a_killed_session_with_no_resume_started_is_an_alert_until_one_holds_the_folder(tmp_path):
    run_dir, run = _killed(tmp_path)
    holder = {"value": None}
    watcher = Watcher(run_dir, clock=lambda: run.clock, holder=lambda _: holder["value"])
    new, _ = watcher.check()
    assert [a.kind for a in new] == ["session_end"] and "killed (no session_end)" in new[0].message
    holder["value"] = {"pid": 1}
    _, cleared = watcher.check()
    assert [a.kind for a in cleared] == ["session_end"]


def test_a_stall_is_k_window_intervals_of_silence_while_a_session_holds_the_folder(tmp_path):
    run_dir, run = _killed(tmp_path)  # the last line is a train window at step 30; windows of 5 x 0.625 s
    now = {"t": run.clock}
    watcher = Watcher(run_dir, stall_windows=2.0, clock=lambda: now["t"], holder=lambda _: {"pid": 1})
    assert watcher.check() == ([], [])
    interval, _ = watcher.window_interval()
    assert interval == pytest.approx(5 * 0.625, abs=0.05)
    last = watcher.events[-1]["time"]
    now["t"] = last + 1.9 * interval
    assert watcher.check()[0] == []
    now["t"] = last + 2.1 * interval  # the synthetic recipe names no cadence, so nothing is allowed on top
    new, _ = watcher.check()
    assert [a.kind for a in new] == ["stall"] and new[0].extra["windows"] == pytest.approx(2.1)
    assert new[0].bound == pytest.approx(2.0 * interval)
    now["t"] = last + 0.1
    run_dir.joinpath("metrics.jsonl").open("a").close()
    assert watcher.check() == ([], [])  # still standing: nothing new was written


def test_a_failing_rule_of_the_table_is_an_alert(tmp_path):
    run = crashed_and_resumed(tmp_path / "r", make_run=lambda d, **k: _overflowing(SyntheticRun(d, **k)))
    run.write()
    new, _ = Watcher(tmp_path / "r", holder=lambda _: None).check(final=True)
    assert "rule:skip_rate" in {a.key for a in new}


def _overflowing(run):
    run.overflow_at = set(range(2, 60, 3))
    return run


def test_the_envelope_follows_the_pilot_and_holds_its_last_level_past_its_end():
    envelope = {"points": [[0, 10.0], [10, 6.0], [20, 4.0], [30, 4.0]], "noise": 0.1, "sigmas": 5, "share": 0.0}
    assert envelope_bound(envelope, 5) == pytest.approx(8.0 + 0.5)
    assert envelope_bound(envelope, 1000) == pytest.approx(4.0 + 0.5)
    assert envelope_bound({"points": []}, 3) is None
