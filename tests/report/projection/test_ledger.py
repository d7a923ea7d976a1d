"""pilotrun/report/projection/ledger.py: the run's time ledger over every session adds up to its elapsed time,
whatever interrupted it, and its redone part is the rolled-back updates' training time."""

from __future__ import annotations

import math

import pytest

from pilotrun.report.projection.ledger import PARTS, against_projection, format_against, time_ledger
from pilotrun.report.record_check.summarize import format_summary, summarize_run
from tests.report.synthetic import SyntheticRun, crashed_and_resumed


def _sums_exactly(ledger) -> None:
    assert set(ledger["parts"]) == set(PARTS)
    assert math.isclose(sum(ledger["parts"].values()), ledger["elapsed_seconds"], rel_tol=0, abs_tol=1e-6)
    assert all(v >= -1e-9 for v in ledger["parts"].values()), ledger["parts"]


def _rolled_back_train_seconds(summary) -> float:
    return sum(e["window"]["train_seconds"] for e in summary.rolled_back_events if e["event"] == "train")


def _kept_train_seconds(summary) -> float:
    return sum(e["window"]["train_seconds"] for e in summary.kept_events if e["event"] == "train")


def test_a_sigkilled_and_resumed_run_sums_and_its_lost_work_is_redone_or_dead(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert summary.valid, summary.reasons
    ledger = summary.overall["time_ledger"]
    _sums_exactly(ledger)
    parts = ledger["parts"]
    assert parts["redone"] == pytest.approx(_rolled_back_train_seconds(summary), abs=1e-9)
    assert parts["redone"] == pytest.approx(10 * 0.5)  # windows 21..30 rolled back; 31..33 died unlogged
    assert parts["productive"] == pytest.approx(_kept_train_seconds(summary), abs=1e-9)
    assert parts["productive"] == pytest.approx(60 * 0.5)
    assert ledger["sessions"][0]["source"] == "events" and ledger["sessions"][1]["source"] == "session_end"
    assert summary.overall["goodput"] == pytest.approx(parts["productive"] / ledger["elapsed_seconds"])
    # The partial window the kill lost (updates 31..33, 3 x 0.625 s) lies after the session's last line: dead.
    assert parts["dead"] == pytest.approx(3 * 0.625, abs=0.05)
    assert "goodput" in format_summary(summary) and "time ledger: elapsed" in format_summary(summary)


def test_clean_stop_from_step_rollback_and_a_resume_with_nothing_to_do_all_sum(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(40)
    run.end_session("interrupted")  # a clean stop (SIGTERM): its checkpoint at 40, then session_end
    run.pause(120.0)
    run.resume(from_step=20)  # --from-step 20: updates 21..40 are rolled back and trained again
    run.train_until(run.max_steps)
    run.end_session()
    run.pause(7.5)
    run.resume()  # from 60, the final step: nothing to do
    run.end_session()
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert summary.valid, summary.reasons
    ledger = summary.overall["time_ledger"]
    _sums_exactly(ledger)
    parts = ledger["parts"]
    assert parts["redone"] == pytest.approx(_rolled_back_train_seconds(summary), abs=1e-9)
    assert parts["redone"] == pytest.approx(20 * 0.5)
    assert parts["productive"] == pytest.approx(60 * 0.5)
    assert [s["dead_before"] for s in ledger["sessions"]] == pytest.approx([0.0, 120.0, 7.5], abs=0.02)
    last = ledger["sessions"][-1]["parts"]
    assert last["productive"] == last["redone"] == 0 and last["startup"] > 0  # no update: all start-up
    assert parts["checkpoint"] == pytest.approx(0.3 * 4) and parts["eval"] == pytest.approx(0.2 * 8)


def test_an_empty_record_has_an_empty_ledger():
    ledger = time_ledger([], [], [], {})
    assert ledger.elapsed_seconds == 0 and ledger.goodput is None and sum(ledger.parts.values()) == 0


def test_actual_over_projected():
    ledger = time_ledger([], [], [], {})
    ledger.elapsed_seconds, ledger.goodput = 50.0, 0.4
    projection = {"target_steps": 100, "total_wall": {"seconds": 200.0}, "goodput": {"value": 0.5},
                  "train_tokens_per_s": {"median": 1000.0}}
    compared = against_projection(projection, ledger, {"updates_applied": 50, "train_tokens_per_s": 900.0})
    assert compared["elapsed_seconds"] == {"actual": 50.0, "projected": 100.0, "ratio": 0.5}
    assert compared["goodput"]["ratio"] == pytest.approx(0.8)
    assert compared["train_tokens_per_s"]["ratio"] == pytest.approx(0.9)
    assert "= 0.50" in format_against(compared)
    assert against_projection(None, ledger, {}) is None


def _projection_of_100():
    return {"target_steps": 100, "total_wall": {"seconds": 200.0}, "goodput": {"value": 0.5},
            "train_tokens_per_s": {"median": 1000.0}, "training": {"seconds": 100.0, "band": [80.0, 125.0]},
            "checkpoint": {"seconds": 40.0}, "evaluation": {"seconds": 20.0}, "startup": {"seconds": 10.0},
            "overhead": {"seconds": 30.0}}


def test_the_elapsed_band_is_the_training_band_with_the_rest_as_projected():
    ledger = time_ledger([], [], [], {})
    ledger.elapsed_seconds = 95.0
    ledger.parts.update(productive=48.0, checkpoint=20.0, eval=10.0, startup=10.0, other=7.0)
    band = against_projection(_projection_of_100(), ledger, {"updates_applied": 50})["band"]
    # rest = 200 - 100 = 100; at half the updates: (100 + 80) / 2 .. (100 + 125) / 2
    assert (band["low"], band["high"], band["inside"], band["why"]) == (90.0, 112.5, True, None)
    ledger.elapsed_seconds = 60.0
    assert (
        against_projection(_projection_of_100(), ledger, {"updates_applied": 50})["band"]["inside"] is False
    )


def test_a_miss_says_why_with_the_part_that_differs_most_first():
    ledger = time_ledger([], [], [], {})
    ledger.elapsed_seconds = 180.0  # 50 updates: projected 100, band 90..112.5
    ledger.parts.update(productive=50.0, checkpoint=20.0, eval=10.0, startup=20.0, other=15.0, dead=65.0)
    compared = against_projection(_projection_of_100(), ledger, {"updates_applied": 50})
    band = compared["band"]
    assert band["inside"] is False and [p["part"] for p in band["parts"]][:2] == ["dead time", "startup"]
    assert band["parts"][0] == {"part": "dead time", "actual": 65.0, "projected": 0.0, "difference": 65.0}
    assert band["parts"][1]["projected"] == 10.0  # start-up is once per session, never scaled by updates
    assert band["why"].startswith("elapsed 180 s is above the band 90-112.5 s: dead time 65 s against 0 s")
    assert "outside the projected band: elapsed 180 s" in format_against(compared)
    no_band = dict(_projection_of_100(), training={"seconds": 100.0})
    assert against_projection(no_band, ledger, {"updates_applied": 50})["band"] is None


@pytest.mark.slow
def test_a_real_run_with_a_rollback_and_a_resume_with_nothing_to_do(builtin_data_dir, tmp_path):
    from tests.scenarios.test_real_records import _train

    run_dir = tmp_path / "run"
    _train(builtin_data_dir, run_dir, "train.max_steps=5", "train.eval_every=4")
    _train(builtin_data_dir, run_dir, "train.max_steps=8", "train.eval_every=4", resume=True, from_step=3)
    _train(builtin_data_dir, run_dir, "train.max_steps=8", "train.eval_every=4", resume=True)
    summary = summarize_run(run_dir, require_step=8)
    assert summary.valid, summary.reasons
    ledger = summary.overall["time_ledger"]
    _sums_exactly(ledger)
    assert [s["source"] for s in ledger["sessions"]] == ["session_end"] * 3
    parts = ledger["parts"]
    # The first session's split counts the train phase up to its end; its windows after step 3 were rolled
    # back. What the train phase holds outside any window (the instant between the last window and the end)
    # is float-small, so redone equals the rolled-back windows' training seconds to within a millisecond.
    assert parts["redone"] == pytest.approx(_rolled_back_train_seconds(summary), abs=1e-3)
    assert parts["productive"] == pytest.approx(_kept_train_seconds(summary), abs=1e-9)
    assert ledger["sessions"][2]["parts"]["productive"] == 0 and parts["startup"] > 0


def test_background_checkpoint_time_is_split_from_the_blocking_part_and_never_lowers_goodput(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    summary = summarize_run(tmp_path / "r")
    before = time_ledger(summary.sessions, summary.kept_events, summary.rolled_back_events, summary.run)
    for event in summary.kept_events:
        if event["event"] == "checkpoint":
            event.update(background=True, background_seconds=2.0, blocking_seconds=event["seconds"])
    after = time_ledger(summary.sessions, summary.kept_events, summary.rolled_back_events, summary.run)
    written = sum(e["event"] == "checkpoint" for e in summary.kept_events)
    assert written and after.checkpoint_split == {"blocking_seconds": before.parts["checkpoint"],
                                                  "background_seconds": pytest.approx(2.0 * written)}
    assert after.parts == before.parts and after.goodput == before.goodput
    from pilotrun.report.projection.ledger import format_ledger

    assert "beside training (not lost)" in format_ledger(after.to_dict())
