"""The forecast benchmark's annealed-point measurement: the gap it reads at each cooldown's end, and the
option chosen on one half of the cases and graded on the other."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks import forecast_anneal
from benchmarks.forecast_runs import anneal_points


def _summary(points: dict[int, float]) -> SimpleNamespace:
    return SimpleNamespace(kept_events=[{"event": "val", "step": s, "loss": v} for s, v in points.items()])


def test_the_annealed_points_are_a_cooldown_from_every_checkpoint_of_the_pilots_second_half():
    assert anneal_points() == [(50, 10), (60, 10), (70, 10), (80, 10), (90, 10), (100, 10), (100, 25)]


def test_the_gap_is_the_pilots_own_loss_less_the_annealed_one_where_the_pilot_evaluated():
    pilot = _summary({60: 7.0, 70: 6.9, 80: 6.8})
    ends = {(50, 10): (60, 7.25, None), (60, 10): (70, 6.5, None), (100, 10): (110, 6.0, None),
            (50, 25): (75, 6.0, None)}  # 110: past the pilot; 75: not a 10-update cooldown's end
    assert forecast_anneal.gaps(pilot, ends) == [(60, 7.0 - 7.25), (70, 6.9 - 6.5)]


def _row(name: str, **options) -> dict:
    return {"case": SimpleNamespace(name=name, kind="constant"), "options": options}


def test_the_option_chosen_holds_the_most_of_its_half_inside_then_is_the_narrowest():
    wide = {"error": 0.01, "inside": True, "half": 0.06}
    narrow_in = {"error": 0.01, "inside": True, "half": 0.03}
    narrow_out = {"error": 0.05, "inside": False, "half": 0.02}
    rows = [
        _row("a", default=wide, narrower=narrow_in, narrowest=narrow_out),
        _row("b", default=wide, narrower=narrow_in, narrowest=narrow_in),
    ]
    assert forecast_anneal._choose(rows) == "narrower"
    rows[1]["options"]["narrower"] = None  # refused: not inside
    assert forecast_anneal._choose(rows) == "default"


def test_held_out_grades_the_choice_on_the_other_half():
    inside = {"error": 0.01, "inside": True, "half": 0.03}
    outside = {"error": 0.04, "inside": False, "half": 0.01}
    rows = [
        _row("a", default={**inside, "half": 0.05}, narrow=inside),
        _row("b", default={**inside, "half": 0.05}, narrow=outside),
    ]
    table = forecast_anneal.option_held_out(rows)
    assert table[2] == "| a | narrow | 1/1 | b | 0/1 | 4.00% | 1.00% | 0 |"
    assert table[3] == "| b | default | 1/1 | a | 1/1 | 1.00% | 5.00% | 0 |"


def test_the_whole_lock_table_counts_a_refused_lock_as_not_inside_and_each_alert_on_a_healthy_run():
    given = {"final_step": 1000, "measured": 6.0, "predicted": 6.3, "low": 6.0, "high": 6.6, "inside": True,
             "error": 0.05}
    rows = [
        {"whole": {"default": {"graded": given, "first": None}, "annealed": {"graded": given, "first": 250}}},
        {"whole": {"default": {"graded": {"unavailable": "no forecast: x"}, "first": None},
                   "annealed": {"graded": {**given, "inside": False}, "first": None}}},
    ]
    table = forecast_anneal.whole_table(rows)
    assert table[2] == "| as freeze writes it | 1/2 | 5.00% | 4.76% | 0/2 | 1 |"
    assert table[3] == "| with the 7 annealed points | 1/2 | 5.00% | 4.76% | 1/2 | 0 |"
