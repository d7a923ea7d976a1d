"""The forecast benchmark's live replay (benchmarks/forecast_live.py): watch following a finished record one
evaluation at a time says when each alert would have been raised, and an alert names a run's breakage only
where its healthy twin raises none of its class after the break (synthetic runs of a known law:
tests/report/projection/test_forecast_record.py)."""

from __future__ import annotations

import pytest

from benchmarks import forecast_live
from benchmarks.forecast_runs import Case
from pilotrun.report.projection import forecast_record as fr
from pilotrun.report.record_check.summarize import summarize_run
from tests.report.projection.test_forecast_record import synthetic


@pytest.fixture(scope="module")
def lock(tmp_path_factory):
    summary = summarize_run(synthetic(tmp_path_factory.mktemp("pilot") / "r", 200, 10).run_dir)
    return {
        "recipe": summary.run["recipe"],
        "data": {"metadata_sha256": "0" * 64},
        "forecast": fr.lock_forecast(summary, 2000),
    }


def test_a_run_leaving_its_course_is_named_at_the_evaluation_after_which_watch_raised_it(tmp_path, lock):
    # +0.3 (5%) from step 300: risen above its own course at 300 and 400, raised after the evaluation at 400
    broken = synthetic(tmp_path / "broken", 2000, 100, shift=lambda step: 0.3 if step > 200 else 0.0)
    twin = synthetic(tmp_path / "twin", 2000, 100)
    first = forecast_live.first_raised(broken.run_dir, lock)
    assert first["forecast"][:2] == (400, "forecast")
    assert "forecast" not in forecast_live.first_raised(twin.run_dir, lock)
    case, healthy = Case("c-s0-x", "cosine", 0, broken="lr_x2"), Case("c-s0", "cosine", 0)
    pairs = {case.name: (None, broken.run_dir), healthy.name: (None, twin.run_dir)}
    locks = {case.name: lock, healthy.name: lock}
    named = forecast_live.breakage_alerts(case, [healthy], pairs, locks, 2000)
    assert named[0] == (400, "forecast", first["forecast"][2])
    # what the twin raises after the break too does not name the breakage: the run against itself names none
    assert forecast_live.breakage_alerts(case, [healthy], {**pairs, case.name: pairs[healthy.name]}, locks,
                                         2000) == []
    assert forecast_live.twin_of(case, [Case("c-s1", "cosine", 1)]) is None


def test_what_names_a_breakage_is_counted_apart_by_what_it_reads_the_loss_or_the_record(tmp_path, lock):
    """A run resumed at 500 with a changed recipe whose loss rises 5% from step 300: the forecast's alert
    reads the loss, the change on resume reads the record (one class however many resumes: its kind)."""
    from tests.report.projection.test_forecast_record import resumed_with

    broken = resumed_with(
        tmp_path / "broken",
        [("allowed", "optim.grad_clip", 1.0, 0.5)],
        shift=lambda step: 0.3 if step > 200 else 0.0,
    )
    twin = synthetic(tmp_path / "twin", 2000, 100)
    case, healthy = Case("c-s0-x", "cosine", 0, broken="lr_x2"), Case("c-s0", "cosine", 0)
    pairs = {case.name: (None, broken.run_dir), healthy.name: (None, twin.run_dir)}
    locks = {case.name: lock, healthy.name: lock}
    named = forecast_live.breakage_alerts(case, [healthy], pairs, locks, 2000)
    split = forecast_live.by_evidence(named)
    assert [a[:2] for a in split["loss"]] == [(400, "forecast")]
    assert split["record"] == [(600, "forecast_change", 1)]
    assert forecast_live.by_evidence([]) == {"loss": [], "record": []}
