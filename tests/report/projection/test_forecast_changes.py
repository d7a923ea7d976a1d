"""The changes on resume that leave what the lock's forecast assumed (pilotrun/report/projection/
forecast_changes.py), and summarize's grade of a run that made one."""

from __future__ import annotations

import pytest

from pilotrun.report.projection import forecast_record as fr
from pilotrun.report.projection.forecast_changes import (
    as_dicts,
    changes_the_forecast,
    describe_changes,
    forecast_changes,
)
from pilotrun.report.record_check.summarize import summarize_run
from tests.report.projection.test_forecast_record import resumed_with, synthetic


@pytest.mark.parametrize(
    "key, changes",
    [
        ("optim.muon.lr", True),
        ("optim.grad_clip", True),
        ("train.loss_scale_growth_interval", True),
        ("data.mixture.weights", True),
        ("optim.schedule.horizon", True),  # ignored against the lock, not on resume: the curve's schedule
        ("train.eval.batches", True),  # the measured loss
        ("train.eval.every", False),
        ("train.checkpoint.every", False),
        ("train.max_steps", False),
        ("train.num_threads", False),
    ],
)
def test_what_a_change_on_resume_leaves_of_the_forecasts_assumptions(key, changes):
    assert changes_the_forecast(key) is changes


def test_the_changes_of_the_sessions_given_that_leave_the_assumptions_in_update_order():
    run = {
        "sessions": [
            {"session_id": "s1", "start_step": 0},
            {"session_id": "s2", "start_step": 100},
            {"session_id": "s3", "start_step": 300},
        ],
        "allowed_changes": [
            {"session_id": "s3", "key": "optim.muon.lr", "old": 0.006, "new": 0.003},
            {"session_id": "s2", "key": "optim.muon.lr", "old": 0.003, "new": 0.006},
            {"session_id": "s2", "key": "optim.adamw.lr", "old": 0.003, "new": 0.006},
        ],
        "free_changes": [{"session_id": "s2", "key": "train.eval.every", "old": 10, "new": 25}],
    }
    found = forecast_changes(run, ["s1", "s2", "s3"])
    assert [(c.key, c.new, c.from_update) for c in found] == [
        ("optim.muon.lr", 0.006, 101),
        ("optim.adamw.lr", 0.006, 101),
        ("optim.muon.lr", 0.003, 301),
    ]
    assert [c.key for c in forecast_changes(run, ["s1", "s3"])] == ["optim.muon.lr"]
    assert forecast_changes(run, ["s1"]) == []
    assert describe_changes(as_dicts(found)) == (
        "optim.muon.lr 0.003 -> 0.006, optim.adamw.lr 0.003 -> 0.006 from update 101; optim.muon.lr 0.006 -> "
        "0.003 from update 301"
    )


def test_summarize_grades_a_changed_run_as_today_and_names_the_change(tmp_path):
    pilot = synthetic(tmp_path / "pilot", 200, 10)
    summary = summarize_run(pilot.run_dir)
    fc = fr.lock_forecast(summary, 2000)
    healthy = synthetic(tmp_path / "healthy", 2000, 100)
    changed = resumed_with(tmp_path / "changed", [("allowed", "optim.grad_clip", 1.0, 0.5)])
    graded = [
        fr.against(fc, pilot.run["recipe"], "0" * 64, run.run, summarize_run(run.run_dir).kept_events)
        for run in (healthy, changed)
    ]
    assert graded[0]["changes"] == []
    assert graded[1]["changes"] == [
        {"key": "optim.grad_clip", "old": 1.0, "new": 0.5, "session_id": "s2", "from_update": 501}
    ]
    assert {k: v for k, v in graded[1].items() if k != "changes"} == {
        k: v for k, v in graded[0].items() if k != "changes"
    }  # graded as today: the same losses, the same grade
    line = fr.describe_against(graded[1])
    assert line.startswith(fr.describe_against(graded[0]) + "; graded as of a changed recipe: ")
    assert line.endswith(
        "graded as of a changed recipe: optim.grad_clip 1.0 -> 0.5 from update 501 (on resume; the forecast "
        "assumed the lock's recipe, so from update 501 it is a reference, not a prediction)"
    )
