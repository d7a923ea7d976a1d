"""pilotrun/report/projection/long_run.py: the lock's projection is the pilot's own measurements' arithmetic,
and the watcher's figures are the pilot's."""

from __future__ import annotations

import math
import random

import pytest

from pilotrun.report.projection.ledger import time_ledger
from pilotrun.report.projection.long_run import loss_noise, project, steady_windows, watch_figures
from pilotrun.report.record_check.summarize import summarize_run
from tests.report.synthetic import SyntheticRun, crashed_and_resumed


def _cadenced(run: SyntheticRun) -> SyntheticRun:
    run.run["recipe"]["train"].update(checkpoint_every=run.checkpoint_every, eval_every=run.eval_every)
    return run


def _pilot(tmp_path):
    crashed_and_resumed(tmp_path / "r", make_run=lambda d, **k: _cadenced(SyntheticRun(d, **k))).write()
    return summarize_run(tmp_path / "r")


def test_the_projection_is_the_pilots_measurements_times_the_long_runs_counts(tmp_path):
    summary = _pilot(tmp_path)
    p = project(summary, 1000, mtbf_hours=1.0, device_hour_cost=2.5)
    # The synthetic pilot: 32 tokens per update, 0.5 training seconds each (64 tok/s in every steady window),
    # checkpoints of 0.3 s every 20 updates, evaluations of 0.2 s every 10.
    assert p["train_tokens_per_s"]["median"] == pytest.approx(64.0)
    assert p["training"]["seconds"] == pytest.approx(1000 * 32 / 64.0)
    assert p["checkpoint"]["count"] == 50 and p["checkpoint"]["seconds"] == pytest.approx(50 * 0.3)
    assert p["evaluation"]["count"] == 100 and p["evaluation"]["seconds"] == pytest.approx(100 * 0.2)
    ledger = time_ledger(summary.sessions, summary.kept_events, summary.rolled_back_events, summary.run)
    startup = sorted(s.parts["startup"] for s in ledger.sessions)
    assert p["startup"]["seconds"] == pytest.approx(sum(startup) / 2)  # the median of two sessions
    attempted = sum(s.updates_attempted for s in summary.sessions)
    per_update = (ledger.parts["report"] + ledger.parts["other"]) / attempted
    assert p["overhead"]["seconds"] == pytest.approx(1000 * per_update)
    failure_free = sum(
        p[k]["seconds"] for k in ("startup", "training", "checkpoint", "evaluation", "overhead")
    )
    failures = p["failures"]
    assert failures["expected"] == pytest.approx(failure_free / 3600.0)
    interval = 20 * failure_free / 1000  # 20 updates at the projected seconds per update
    assert failures["seconds"] == pytest.approx(
        failures["expected"] * (interval / 2 + p["startup"]["seconds"])
    )
    assert p["total_wall"]["seconds"] == pytest.approx(failure_free + failures["seconds"])
    young = p["checkpoint_interval"]
    assert young["young_seconds"] == pytest.approx(math.sqrt(2 * 0.3 * 3600.0))
    assert young["young_updates"] == pytest.approx(young["young_seconds"] / (failure_free / 1000))
    assert young["daly_seconds"] == pytest.approx(young["young_seconds"] - 0.3)
    assert p["device_hours"]["value"] == pytest.approx(p["total_wall"]["seconds"] / 3600.0)
    assert p["cost"]["value"] == pytest.approx(2.5 * p["device_hours"]["value"])
    assert p["goodput"]["value"] == pytest.approx(p["training"]["seconds"] / p["total_wall"]["seconds"])
    assert all("from" in part for part in p.values() if isinstance(part, dict) and "seconds" in part)


def test_without_mtbf_there_are_no_failures_and_a_pilot_without_windows_cannot_be_projected(tmp_path):
    summary = _pilot(tmp_path)
    p = project(summary, 100)
    assert "failures" not in p and "cost" not in p
    assert p["total_wall"]["seconds"] == pytest.approx(
        sum(p[k]["seconds"] for k in ("startup", "training", "checkpoint", "evaluation", "overhead")))
    summary.kept_events = [e for e in summary.kept_events if e["event"] != "train"]
    assert "unavailable" in project(summary, 100)


def test_the_watch_figures_are_the_pilots_band_envelope_and_bounds(tmp_path):
    summary = _pilot(tmp_path)
    figures = watch_figures(summary, {"max_skip_rate": 0.05, "max_clip_rate": 0.3})
    assert figures["throughput"]["median"] == pytest.approx(64.0)
    assert figures["throughput"]["low"] == pytest.approx(64.0 * 0.8)
    steady = steady_windows(summary.kept_events)
    assert figures["throughput"]["windows"] == len(steady) == 12 - 2  # each session's first window left out
    points = figures["loss_envelope"]["points"]
    assert points[0][0] == 5 and points[-1][0] == 60
    assert figures["skip_rate"] == {"pilot": 0.0, "bound": 0.05} and figures["clip_rate"]["bound"] == 0.3
    assert figures["window_interval_seconds"] == pytest.approx(5 * 0.625, abs=0.05)


def test_loss_noise_is_robust_to_one_outlier():
    assert loss_noise([1.0, 1.0]) == 0.0
    draws = random.Random(0)
    wobble = [1.0 + draws.gauss(0.0, 0.01) for _ in range(200)]
    assert loss_noise(wobble) == pytest.approx(0.01, rel=0.25)
    assert loss_noise(wobble[:100] + [9.0] + wobble[101:]) == pytest.approx(loss_noise(wobble), rel=0.1)


def test_a_checkpoint_costs_what_it_blocked_the_loop_and_a_failure_also_loses_the_write_in_flight(tmp_path):
    summary = _pilot(tmp_path)
    for event in summary.kept_events + summary.rolled_back_events:
        if event["event"] == "checkpoint":  # as background saves record them: 0.05 s staged, 0.25 s beside
            event.update(seconds=0.05, blocking_seconds=0.05, background=True, background_seconds=0.25)
    p = project(summary, 1000, mtbf_hours=1.0)
    assert p["checkpoint"]["each"] == pytest.approx(0.05) and p["checkpoint"][
        "background_each"
    ] == pytest.approx(0.25)
    assert p["checkpoint"]["seconds"] == pytest.approx(50 * 0.05)
    assert p["checkpoint_interval"]["young_seconds"] == pytest.approx(math.sqrt(2 * 0.05 * 3600.0))
    failure_free = sum(
        p[k]["seconds"] for k in ("startup", "training", "checkpoint", "evaluation", "overhead")
    )
    interval = 20 * failure_free / 1000
    failures = p["failures"]
    assert failures["seconds"] == pytest.approx(
        failures["expected"] * (interval / 2 + 0.25 + p["startup"]["seconds"])
    )
    assert "blocking" in p["checkpoint"]["from"] and "blocking" in p["checkpoint_interval"]["from"]


def test_checkpoint_costs_read_older_records_as_blocking_for_their_seconds():
    from pilotrun.report.projection.long_run import checkpoint_costs

    older = [{"event": "checkpoint", "seconds": s} for s in (1.0, 2.0, 3.0)]
    assert checkpoint_costs(older) == (2.0, 0.0)
    mixed = older + [{"event": "checkpoint", "seconds": 0.1, "blocking_seconds": 0.1, "background": True,
                      "background_seconds": 4.0}]
    assert checkpoint_costs(mixed) == (pytest.approx(1.5), 4.0)
