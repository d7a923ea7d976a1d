"""The forecast benchmark's cadence check: which pilots it retrains, and its table's moves and counts."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks import forecast_cadence
from benchmarks.forecast_runs import broken_cases, healthy_cases
from pilotrun.report.projection.forecast import DEFAULT_WEIGHTING


def test_the_check_retrains_the_healthy_flat_lr_pilots_of_one_source():
    names = [c.name for c in forecast_cadence.flat_cases(healthy_cases() + broken_cases())]
    assert names == ["wsd-s0", "wsd-s1", "wsd-s2", "constant-s0", "constant-s1", "constant-s2"]


def _given(value: float, inside: bool = True) -> dict:
    return {"value": value, "error": value / 6.0 - 1, "half": 0.05, "half_no_drift": 0.02, "inside": inside}


def test_the_table_gives_each_centres_move_against_every_10_and_counts_a_refusal_apart():
    by = {
        (5, DEFAULT_WEIGHTING): _given(6.06),
        (10, DEFAULT_WEIGHTING): _given(6.0),
        (20, DEFAULT_WEIGHTING): "the pilot has 5 validation evaluation(s) past its warm-up",
        (5, "log-updates"): _given(5.82, inside=False),
        (10, "log-updates"): _given(6.0),
        (20, "log-updates"): "the pilot has 5 validation evaluation(s) past its warm-up",
    }
    rows = [{"case": SimpleNamespace(name="wsd-s0"), "cadence": {"by": by, "same": True}}]
    table = forecast_cadence.cadence_table(rows)
    assert table[2] == (
        f"| wsd-s0 | {DEFAULT_WEIGHTING} | 6.0600 (+1.00%, +-5.00%) | 6.0000 (+0.00%, +-5.00%) | "
        "refused (too few evaluations) | +1.00% |"
    )
    assert table[3].endswith("| -3.00% |")
    assert "every 10 1/1, every 5 0/1" in table[6]
    assert table[-1].startswith("- the retrained pilots' train losses") and "bit for bit" in table[-1]
    rows[0]["cadence"]["same"] = False
    assert "DIFFER" in forecast_cadence.cadence_table(rows)[-1]
