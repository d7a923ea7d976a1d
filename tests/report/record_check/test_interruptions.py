"""pilotrun/report/record_check/interruptions.py: sessions counted by how they ended, what each unplanned end
cost in the time ledger, and the run's interruptions beside the lock's MTBF; through summarize, on synthetic
records."""

from __future__ import annotations

import math

import pytest

from pilotrun.report.record_check.interruptions import against_mtbf, mtbf_of, poisson_at_least
from pilotrun.report.record_check.summarize import format_summary, summarize_run
from tests.report.synthetic import SyntheticRun


def every_kind_of_end(run_dir, mtbf_hours=None):
    """hung at 33 (12 s of dead time), interrupted at 45 (30 s), killed at 52 (60 s), a deadline at 58 (5 s),
    then completed at 60."""
    run = SyntheticRun(run_dir)
    if mtbf_hours is not None:
        run.run["frozen"] = {"lock_projection": {"failures": {"mtbf_hours": mtbf_hours}}}
    run.start_session()
    run.train_until(33)
    run.end_session("hung")
    for pause, until, end in (
        (12.0, 45, "interrupted"),
        (30.0, 52, None),
        (60.0, 58, "deadline"),
        (5.0, 60, "completed"),
    ):
        run.pause(pause)
        run.resume()
        run.train_until(until)
        run.kill() if end is None else run.end_session(end)
    run.write()
    return run


def test_summarize_counts_sessions_per_reason_and_prices_each_unplanned_end(tmp_path):
    every_kind_of_end(tmp_path / "r")
    summary = summarize_run(tmp_path / "r")
    assert summary.valid, summary.reasons
    o = summary.overall
    assert o["session_ends"] == {"completed": 1, "interrupted": 1, "deadline": 1, "hung": 1, "killed": 1}
    cost = o["interruption_costs"]
    assert set(cost) == {"interrupted", "deadline", "hung", "killed"}
    ledger = {entry["session_id"]: entry for entry in o["time_ledger"]["sessions"]}
    # The hung session's cost: its training after checkpoint 20 (redone), the dead time before s2, s2's
    # start-up.
    assert cost["hung"]["redone_seconds"] == ledger["s1"]["parts"]["redone"] > 0
    assert cost["hung"]["dead_seconds"] == ledger["s2"]["dead_before"] == pytest.approx(12.0, abs=0.1)
    assert cost["hung"]["restart_seconds"] == ledger["s2"]["parts"]["startup"]
    assert cost["killed"]["dead_seconds"] >= 60.0  # and its lost partial window since its last line
    assert cost["hung"]["seconds"] == pytest.approx(
        sum(cost["hung"][k] for k in ("redone_seconds", "dead_seconds", "restart_seconds"))
    )
    # Every dead second of the ledger is some end's cost.
    assert math.fsum(c["dead_seconds"] for c in cost.values()) == pytest.approx(
        o["time_ledger"]["parts"]["dead"]
    )
    assert o["against_mtbf"] is None  # not started from a lock with an MTBF
    text = format_summary(summary)
    assert "sessions by end: completed 1, interrupted 1, deadline 1, hung 1, killed 1; " in text
    assert "hung cost " in text


def test_interruptions_beside_the_lock_s_mtbf(tmp_path):
    every_kind_of_end(tmp_path / "often", mtbf_hours=10.0)
    o = summarize_run(tmp_path / "often").overall
    mtbf = o["against_mtbf"]
    assert mtbf["interruptions"] == 3  # hung, interrupted, killed: the deadline was planned
    hours = o["time_ledger"]["elapsed_seconds"] / 3600
    assert mtbf["elapsed_hours"] == hours and mtbf["expected"] == hours / 10.0
    assert mtbf["hours_between"] == hours / 3 and mtbf["faster"] and mtbf["p_at_least"] < 0.01
    assert "restarting faster than the lock expects" in format_summary(summarize_run(tmp_path / "often"))
    every_kind_of_end(tmp_path / "rarely", mtbf_hours=0.001)  # one failure expected every 3.6 s
    assert summarize_run(tmp_path / "rarely").overall["against_mtbf"]["faster"] is False


def test_the_poisson_tail_on_both_sides_of_the_mean():
    assert poisson_at_least(0, 3.0) == 1.0 and poisson_at_least(1, 0.0) == 0.0
    assert poisson_at_least(1, 2.0) == pytest.approx(1 - math.exp(-2.0))
    assert poisson_at_least(3, 0.5) == pytest.approx(1 - math.exp(-0.5) * (1 + 0.5 + 0.125))
    # far past the mean, still a probability, not a rounding error
    assert 0 < poisson_at_least(60, 5.0) < 1e-30
    assert poisson_at_least(1000, 1000.0) == pytest.approx(0.5, abs=0.02)


def test_no_mtbf_or_no_time_is_no_comparison():
    ends = {"hung": 2}
    assert against_mtbf(ends, 3600.0, None) is None and against_mtbf(ends, 0.0, 5.0) is None
    assert against_mtbf(ends, 3600.0, True) is None and against_mtbf(ends, 3600.0, float("nan")) is None
    assert against_mtbf({"completed": 1}, 3600.0, 5.0)["faster"] is False
    assert (
        mtbf_of({"failures": {"mtbf_hours": 4}}) == 4
        and mtbf_of(None) is None
        and mtbf_of({"failures": 1}) is None
    )
