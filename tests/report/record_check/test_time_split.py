"""summarize reads a session_end's time split with or without the profile and report phases (older records
lack them) and refuses one whose phases do not add up to its wall clock."""

from __future__ import annotations

import pytest

from pilotrun.report.record_check.summarize import format_summary, summarize_run
from pilotrun.report.record_check.time_split import SPLIT_PHASES
from pilotrun.run.record import PHASES
from tests.report.synthetic import SyntheticRun


def completed_run(tmp_path) -> SyntheticRun:
    run = SyntheticRun(tmp_path / "r", max_steps=20, checkpoint_every=10)
    run.start_session()
    run.train_until(20)
    run.end_session()
    return run


def session_end(run: SyntheticRun) -> dict:
    return next(e for e in run.events if e["event"] == "session_end")


def test_the_readers_phases_are_the_trainers():
    assert SPLIT_PHASES == tuple(f"{phase}_seconds" for phase in PHASES)


def test_a_record_without_the_profile_and_report_phases_reads_them_as_zero(tmp_path):
    run = completed_run(tmp_path)
    assert "profile_seconds" not in session_end(run)["time_split"]  # written the way older trainers wrote it
    run.write()
    summary = summarize_run(run.run_dir)
    assert summary.valid, summary.reasons
    (session,) = summary.sessions
    assert (session.profile_seconds, session.report_seconds) == (0.0, 0.0)
    assert session.time_source == "session_end" and session.other_seconds > 0
    assert summary.overall["time_split"]["profile_seconds"] == 0.0
    assert "profile 0.0 s, report 0.0 s" in format_summary(summary)


def test_the_profile_and_report_phases_are_read_and_summed(tmp_path):
    run = completed_run(tmp_path)
    split = session_end(run)["time_split"]
    split["profile_seconds"], split["report_seconds"] = 1.5, 0.25
    split["other_seconds"] -= 1.75  # the same wall clock, split finer
    run.write()
    summary = summarize_run(run.run_dir)
    assert summary.valid, summary.reasons
    (session,) = summary.sessions
    assert (session.profile_seconds, session.report_seconds) == (1.5, 0.25)
    assert sum(getattr(session, k) for k in SPLIT_PHASES) == pytest.approx(session.wall_seconds)
    assert summary.overall["time_split"]["report_seconds"] == 0.25


@pytest.mark.parametrize("change, words", [
    ({"profile_seconds": 2.0}, "time_split phases add up to"),  # two seconds nobody spent
    ({"report_seconds": -0.5, "other_seconds_plus": 0.5}, "negative seconds in report_seconds"),
    ({"profile_seconds": "soon"}, "lacks a finite number"),
])
def test_a_time_split_that_is_no_account_of_the_wall_clock_is_refused(tmp_path, change, words):
    run = completed_run(tmp_path)
    split = session_end(run)["time_split"]
    for key, value in change.items():
        if key == "other_seconds_plus":
            split["other_seconds"] += value
        else:
            split[key] = value
    run.write()
    summary = summarize_run(run.run_dir)
    assert not summary.valid
    assert any("session_end" in reason and words in reason for reason in summary.reasons), summary.reasons


def test_a_killed_session_derives_its_profile_seconds_from_its_windows(tmp_path):
    run = SyntheticRun(tmp_path / "r", max_steps=40, checkpoint_every=10)
    run.start_session()
    run.train_until(30)
    run.kill()
    run.resume()
    run.train_until(40)
    run.end_session()
    windows = [e["window"] for e in run.events if e["event"] == "train" and e["session_id"] == "s1"]
    windows[1]["profiled_attempts"], windows[1]["profiled_tokens"], windows[1]["profile_seconds"] = (
        1,
        32,
        0.75,
    )
    run.write()
    summary = summarize_run(run.run_dir)
    assert summary.valid, summary.reasons
    killed = summary.sessions[0]
    assert killed.time_source == "events" and killed.profile_seconds == 0.75 and killed.report_seconds == 0.0
    assert sum(getattr(killed, k) for k in SPLIT_PHASES) == pytest.approx(killed.wall_seconds)
    # Its training-only throughput counts only the training phase's tokens.
    tokens = sum(w["tokens"] for w in windows) - 32
    assert killed.train_tokens_per_s == pytest.approx(tokens / sum(w["train_seconds"] for w in windows))
