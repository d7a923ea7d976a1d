"""watch against the lock's forecast, on synthetic long runs whose validation losses follow the pilot's law,
go wrong
part way, or belong to another recipe (tests/report/projection/test_forecast_record.py builds them)."""

from __future__ import annotations

import copy

import pytest

from pilotrun.report.projection import forecast_record as fr
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.watch.alerts import Watcher
from tests.report.projection.test_forecast_record import synthetic


@pytest.fixture(scope="module")
def pilot_dir(tmp_path_factory):
    return synthetic(tmp_path_factory.mktemp("pilot") / "r", 200, 10).run_dir


@pytest.fixture(scope="module")
def lock(pilot_dir):
    summary = summarize_run(pilot_dir)
    return {
        "recipe": summary.run["recipe"],
        "data": {"metadata_sha256": "0" * 64},
        "forecast": fr.lock_forecast(summary, 2000),
    }


def watched(run_dir, lock):
    watcher = Watcher(run_dir, lock=lock, holder=lambda path: None)
    watcher.check(final=True)
    return watcher, [a for a in watcher.raised if a.kind == "forecast"], watcher.new_notes()


def test_a_healthy_long_run_raises_no_forecast_alert(tmp_path, lock):
    run = synthetic(tmp_path / "long", 2000, 100)
    _, alerts, notes = watched(run.run_dir, lock)
    assert alerts == [] and not [n for n in notes if "forecast" in n]


def test_a_run_leaving_the_band_past_the_pilots_reach_is_alerted_after_two_evaluations(tmp_path, lock):
    run = synthetic(tmp_path / "long", 2000, 100, shift=lambda step: 0.6 if step > 300 else 0.0)
    _, alerts, _ = watched(run.run_dir, lock)
    assert len(alerts) == 1
    assert (
        alerts[0].step == 500
        and alerts[0].extra == {"first": 400}
        and "above the forecast's band" in alerts[0].message
    )
    assert alerts[0].figure > alerts[0].bound


def test_one_evaluation_outside_is_not_an_alert(tmp_path, lock):
    run = synthetic(tmp_path / "long", 2000, 100, shift=lambda step: 0.6 if step == 600 else 0.0)
    assert watched(run.run_dir, lock)[1] == []


def test_a_run_the_forecast_does_not_apply_to_hears_it_once_and_is_not_held_to_it(tmp_path, lock):
    run = synthetic(tmp_path / "long", 2000, 100, kind="wsd", shift=lambda step: 0.4)
    _, alerts, notes = watched(run.run_dir, lock)
    said = [n for n in notes if "forecast does not apply" in n]
    assert alerts == [] and len(said) == 1 and "schedule family optim.schedule.kind" in said[0]


def test_a_lock_without_a_forecast_is_watched_as_before(tmp_path, lock):
    run = synthetic(tmp_path / "long", 2000, 100, shift=lambda step: 0.6 if step > 300 else 0.0)
    older = copy.deepcopy(lock)
    del older["forecast"]
    _, alerts, notes = watched(run.run_dir, older)
    assert alerts == [] and not [n for n in notes if "forecast" in n]
    unavailable = {
        **older,
        "forecast": {"unavailable": "no forecast: the pilot has 3 validation evaluation(s)"},
    }
    assert watched(run.run_dir, unavailable)[1] == []


def test_a_run_rising_above_its_own_course_is_alerted_before_the_band_is_held(tmp_path, lock):
    # +5% from step 300 on: inside the forecast's band (at least +-8%, held from twice the pilot's 200
    # updates), above the law refitted to the pilot's and the run's own evaluations (held from the pilot's
    # reach on).
    run = synthetic(tmp_path / "long", 2000, 100, shift=lambda step: 0.3 if step > 200 else 0.0)
    _, alerts, _ = watched(run.run_dir, lock)
    assert len(alerts) == 1 and alerts[0].step == 400 and alerts[0].extra == {"first": 300}
    assert "above" in alerts[0].message and "refitted to the pilot's and this run's own" in alerts[0].message
    assert alerts[0].figure > alerts[0].bound


def test_a_lock_from_before_the_rise_check_is_watched_as_before(tmp_path, lock):
    run = synthetic(tmp_path / "long", 2000, 100, shift=lambda step: 0.3 if step > 200 else 0.0)
    older = copy.deepcopy(lock)
    del older["forecast"]["rise"]
    assert watched(run.run_dir, older)[1] == []  # +5% is inside the band: no alert, as before the rise check
    leaving = synthetic(tmp_path / "leaving", 2000, 100, shift=lambda step: 0.6 if step > 300 else 0.0)
    _, alerts, _ = watched(leaving.run_dir, older)
    assert [(a.step, a.extra) for a in alerts] == [(500, {"first": 400})]
    assert "above the forecast's band" in alerts[0].message


def test_a_lock_written_at_the_earlier_drift_weight_is_graded_and_watched_by_its_own_numbers(
    tmp_path, lock, pilot_dir, monkeypatch
):
    """Before the 90% interval's drift weight was chosen held out, freeze wrote it at 0.5: such a lock is
    graded by the interval it holds (never recomputed at today's weight) and watched as today (the band's
    weight did not change). A final loss between today's upper edge and the earlier one is inside the earlier
    lock's interval and outside today's."""
    from pilotrun.report.projection import forecast as fc_module
    from tests.report.projection.test_forecast_record import law_loss

    monkeypatch.setitem(fc_module.WIDEN, fc_module.LEVEL, 0.5)
    older = {**lock, "forecast": fr.lock_forecast(summarize_run(pilot_dir), 2000)}
    monkeypatch.undo()
    old_high, new_high = older["forecast"]["final"]["high"], lock["forecast"]["final"]["high"]
    assert old_high > new_high and older["forecast"]["curve"] != lock["forecast"]["curve"]
    between = (old_high + new_high) / 2 - law_loss(2000, 0.004)(2000)
    run = synthetic(tmp_path / "long", 2000, 100, shift=lambda step: between if step == 2000 else 0.0)
    summary = summarize_run(run.run_dir)
    graded_old, graded_new = (
        fr.against(lk["forecast"], lk["recipe"], "0" * 64, run.run, summary.kept_events)
        for lk in (older, lock)
    )
    assert graded_old["inside"] and not graded_new["inside"]
    assert graded_old["low"] == older["forecast"]["final"]["low"] and graded_old["high"] == old_high
    bands = [[row[4:] for row in lk["forecast"]["curve"]] for lk in (older, lock)]
    assert bands[0] == bands[1]  # the band watch holds a run to is the same at either weight
    leaving = synthetic(tmp_path / "leaving", 2000, 100, shift=lambda step: 0.6 if step > 300 else 0.0)
    for lk in (older, lock):
        _, alerts, _ = watched(leaving.run_dir, lk)
        assert [(a.step, a.extra) for a in alerts] == [(500, {"first": 400})]
