"""pilotrun/report/projection/band.py: the projection's band carries the spread the pilot measured (start-up,
checkpoint saves, evaluations, window-to-window throughput at its CPU share), and a long run outside it is
told which assumption moved. Every record here is synthetic (tests/report/synthetic.py): its clock is made by
hand."""

from __future__ import annotations

import pytest

from pilotrun.report.projection.band import (
    SPREAD_FLOOR,
    cpu_share_band,
    elapsed_band,
    measured_spread,
    observed,
    total_band,
)
from pilotrun.report.projection.ledger import against_projection, format_against, time_ledger
from pilotrun.report.projection.long_run import project
from pilotrun.report.record_check.summarize import format_summary, summarize_run
from tests.report.synthetic import SyntheticRun, crashed_and_resumed

TARGET = 400


def _shaped(run: SyntheticRun) -> SyntheticRun:
    """The issue's shape: a CPU run of about 20 s for 400 updates, its windows cycling through three speeds
    and three host loads, the process getting 0.9 CPU seconds per training second, start-ups of a third of a
    second."""
    run.run["recipe"]["train"].update(checkpoint_every=run.checkpoint_every, eval_every=run.eval_every)
    run.train_seconds_per_update = lambda step: (0.040, 0.0415, 0.043)[(step - 1) // 5 % 3]
    run.host_seconds_per_update = lambda step: (0.003, 0.002, 0.0025)[(step - 1) // 5 % 3]
    run.cpu_seconds_per_update = lambda step: 0.9 * run.train_seconds_per_update(step)
    run.eval_seconds = lambda step: 0.02
    run.checkpoint_seconds = lambda step: 0.05
    run.startup_seconds = lambda session: {1: 0.30, 2: 0.36}[session]
    return run


@pytest.fixture(scope="module")
def projection(tmp_path_factory):
    """The lock's projection of a pilot (killed and resumed: two sessions, two start-ups) for 400 updates."""
    folder = tmp_path_factory.mktemp("pilot") / "r"
    crashed_and_resumed(folder, make_run=lambda d, **k: _shaped(SyntheticRun(d, **k))).write()
    return project(summarize_run(folder), TARGET)


def _long_run(tmp_path, projection, change=None):
    """A frozen run of 400 updates in one session with the pilot's figures (after `change(run)`), its
    summary."""
    run = _shaped(SyntheticRun(tmp_path / "long", max_steps=TARGET))
    run.startup_seconds = lambda session: 0.33
    if change is not None:
        change(run)
    run.start_session()
    run.train_until(TARGET)
    run.end_session()
    run.run["frozen"] = {"lock_projection": projection}
    run.write()
    summary = summarize_run(tmp_path / "long")
    assert summary.valid, summary.reasons
    return summary, summary.overall["against_projection"]


def _old_lock(projection):
    """The same projection as a lock from before the parts' bands held it: the training band only."""
    old = {
        k: (
            {kk: vv for kk, vv in v.items() if kk not in ("band_from", "each_band", "measured", "cpu_share")}
            if isinstance(v, dict)
            else v
        )
        for k, v in projection.items()
    }
    for key in ("checkpoint", "evaluation", "startup", "overhead", "total_wall"):
        old[key].pop("band")
    return old


def test_the_lock_states_each_parts_band_and_where_it_came_from(projection):
    p = projection
    startup = p["startup"]
    # 0.30 s and 0.36 s, and the synthetic clock's ticks around the start line (one for the killed session,
    # whose start is run.json's started_at; two for the one that ended, whose clock starts a tick before its
    # line)
    assert startup["measured"] == pytest.approx([0.31, 0.38], abs=1e-4)
    middle = (0.31 + 0.38) / 2
    assert startup["band"] == pytest.approx([middle / SPREAD_FLOOR, middle * SPREAD_FLOOR], abs=1e-4)
    assert "fewer than 3 measured" in startup["band_from"]
    assert p["checkpoint"]["each_band"] == pytest.approx([0.05, 0.05])
    # 3 saves measured: their min..max
    assert p["checkpoint"]["band"] == pytest.approx([20 * 0.05, 20 * 0.05])
    assert p["evaluation"]["band"] == pytest.approx([40 * 0.02, 40 * 0.02])
    # the host seconds per update of the steady windows: 0.0025 in the middle, 0.002 and 0.003 at p10 and p90
    assert p["overhead"]["band"] == pytest.approx(
        [p["overhead"]["seconds"] * 0.8, p["overhead"]["seconds"] * 1.2]
    )
    assert p["training"]["seconds"] == pytest.approx(TARGET * 0.0415)
    assert p["training"]["band"] == pytest.approx([TARGET * 0.040, TARGET * 0.043])
    share = p["training"]["cpu_share"]
    assert share["median"] == pytest.approx(0.9) and share["low"] == pytest.approx(0.72)
    parts = ("training", "checkpoint", "evaluation", "startup", "overhead")
    assert p["total_wall"]["band"] == pytest.approx([sum(p[k]["band"][0] for k in parts),
                                                     sum(p[k]["band"][1] for k in parts)])
    assert (
        all(p[k].get("band_from") for k in parts) and "sum of the parts' lows" in p["total_wall"]["band_from"]
    )
    assert p["total_wall"]["band"][0] < p["total_wall"]["seconds"] < p["total_wall"]["band"][1]


def test_the_issues_run_at_1_04x_with_a_slow_start_up_lands_inside_the_band(tmp_path, projection):
    """A start-up of 0.67 s against the pilot's ~0.35 s and training near the pilot's slower windows: 1.04x
    the projected time. The old band (the training band alone) put it outside, blaming the start-up; the
    pilot's own start-up spread covers it."""
    def slow_start(run):
        run.startup_seconds = lambda session: 0.65  # 0.67 s with the start line's 0.02
        run.train_seconds_per_update = lambda step: 0.0425  # between the pilot's median and slowest windows
    summary, compared = _long_run(tmp_path, projection, slow_start)
    assert compared["elapsed_seconds"]["ratio"] == pytest.approx(1.04, abs=0.005)
    band = compared["band"]
    assert band["inside"] is True and band["why"] is None, band["why"]
    startup = next(p for p in band["parts"] if p["part"] == "startup")
    assert startup["actual"] == pytest.approx(0.67, abs=1e-6) and startup["outside"] == 0.0
    assert f"in the projected band {band['low']:.4g}-{band['high']:.4g} s" in format_summary(summary)
    # the same run against a lock without the parts' bands is compared as before: outside (the training band
    # with the rest as projected), naming the start-up among the differences
    old = _old_lock(projection)
    ledger = time_ledger(summary.sessions, summary.kept_events, summary.rolled_back_events, summary.run)
    before = against_projection(old, ledger, summary.overall, summary.kept_events)["band"]
    assert before["inside"] is False and "startup 0.67 s against 0.345 s projected" in before["why"]
    assert before["high"] < compared["elapsed_seconds"]["actual"] < band["high"]


def test_a_run_whose_cpu_share_fell_is_outside_and_names_the_cpu_share(tmp_path, projection):
    def busier(run):
        run.train_seconds_per_update = lambda step: 0.08
        run.cpu_seconds_per_update = lambda step: 0.45 * 0.08
    summary, compared = _long_run(tmp_path, projection, busier)
    band = compared["band"]
    assert band["inside"] is False and band["parts"][0]["part"] == "training"
    assert band["run"]["cpu_share"] == pytest.approx(0.45)
    reason = band["why"].split(": ", 1)[1]
    assert reason.startswith("training 32 s against ")
    assert "throughput at CPU share 0.45 against the pilot's 0.90: the machine was busier" in reason
    assert [p["part"] for p in band["parts"] if p["outside"]] == ["training"]
    assert "outside the projected band: elapsed" in format_summary(summary)


def test_a_slower_run_at_the_pilots_cpu_share_says_the_share_did_not_move(tmp_path, projection):
    def slower(run):
        run.train_seconds_per_update = lambda step: 0.08
    _summary, compared = _long_run(tmp_path, projection, slower)
    assert (
        "CPU share 0.90 against the pilot's 0.90 (within 0.72-1.08: the process got the share the pilot had)"
        in compared["band"]["why"]
    )


def test_a_run_with_slow_checkpoints_names_the_checkpoints_first(tmp_path, projection):
    def slow_saves(run):
        run.checkpoint_seconds = lambda step: 0.6
        run.startup_seconds = lambda session: 1.5
    _summary, compared = _long_run(tmp_path, projection, slow_saves)
    band = compared["band"]
    assert band["inside"] is False
    assert [p["part"] for p in band["parts"] if p["outside"]] == ["checkpoint", "startup"]  # 11 s, then 0.7 s
    reason = band["why"].split(": ", 1)[1]
    assert reason.startswith("checkpoints 12 s against 1-1 s projected (20 saves, 0.6 s each against the "
                             "pilot's 0.05-0.05 s); start-up 1.52 s against ")
    assert "outside the projected band" in format_against(compared)


def test_the_spread_rule_and_the_total_of_the_parts():
    assert measured_spread([]) == ([0.0, 0.0], "none measured")
    low_high, rule = measured_spread([1.0])
    assert low_high == [1.0 / SPREAD_FLOOR, 1.0 * SPREAD_FLOOR] and "fewer than 3" in rule
    assert measured_spread([1.0, 4.0, 2.0]) == ([1.0, 4.0], "min..max of the 3 measured")
    assert measured_spread([0.1, 4.0])[0] == [0.1, 2.05 * SPREAD_FLOOR]  # each end the wider of the two
    total = total_band({"training": {"seconds": 10.0, "band": [9.0, 12.0]}, "overhead": {"seconds": 1.0}})
    assert total["band"] == [10.0, 13.0] and "training, overhead" in total["band_from"]
    assert cpu_share_band([]) is None


def test_a_lock_without_the_parts_bands_gets_no_new_band():
    old = {
        "target_steps": 10,
        "total_wall": {"seconds": 5.0},
        "training": {"seconds": 4.0, "band": [3.0, 5.0]},
    }
    assert elapsed_band(old, {}, 5.0, 1.0, observed(None, 1, {})) is None


def test_mid_run_the_band_scales_with_the_updates_but_the_start_up_is_paid_once():
    projection = {"target_steps": 100, "total_wall": {"seconds": 110.0, "band": [100.0, 130.0]},
                  "training": {"seconds": 100.0, "band": [90.0, 115.0]},
                  "startup": {"seconds": 10.0, "band": [10.0, 15.0]}}
    run = observed(None, 1, {})
    band = elapsed_band(projection, {"productive": 50.0, "startup": 12.0}, 62.0, 0.5, run)
    assert (band["low"], band["high"], band["inside"]) == (55.0, 72.5, True)
    band = elapsed_band(projection, {"productive": 50.0, "startup": 12.0, "dead": 30.0}, 92.0, 0.5, run)
    assert band["inside"] is False and band["why"].endswith(
        ": dead time 30 s with no session running, none projected"
    )


def test_a_run_faster_than_the_band_on_a_quieter_machine_says_so():
    """The other way round: a pilot on a busy machine (CPU share 0.45), its long run getting the whole
    core."""
    projection = {"target_steps": 100, "total_wall": {"seconds": 100.0, "band": [90.0, 110.0]},
                  "train_tokens_per_s": {"median": 100.0, "p10": 90.0, "p90": 110.0},
                  "training": {"seconds": 100.0, "band": [90.0, 110.0],
                               "cpu_share": {"median": 0.45, "low": 0.36, "high": 0.6}}}
    run = observed(None, 1, {"train_tokens_per_s": 154.0})
    run["cpu_share"] = 0.98
    band = elapsed_band(projection, {"productive": 60.0, "redone": 5.0}, 65.0, 1.0, run)
    assert band["inside"] is False and band["low"] == 90.0
    assert band["why"] == (
        "elapsed 65 s is below the band 90-110 s: training 65 s against 90-110 s projected, 5 s of "
        "it redone (rolled back, trained again) (training-only 154 tok/s against the pilot's 90-110 "
        "(p10-p90); "
        "throughput at CPU share 0.98 against the pilot's 0.45: the machine was quieter than the "
        "pilot's)"
    )
