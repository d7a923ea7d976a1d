"""The forecast benchmark's interval check: its table's counts (inside, outside, refused apart) and the method
chosen on one half of the pilots."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks import forecast_intervals


def _given(half: float, inside: bool = True) -> dict:
    return {"error": 0.01, "half": half, "half_no_drift": half / 2, "inside": inside, "rho": 0.5}


def _row(name: str, kind: str, halves: dict, mixture: bool = False) -> dict:
    intervals = {}
    for (every, method), half in halves.items():
        intervals[(every, method)] = half if isinstance(half, (str, dict)) else _given(half)
    return {"case": SimpleNamespace(name=name, kind=kind, mixture=mixture), "intervals": intervals}


def _halves(at_10: float, at_5) -> dict:
    """ar1-inflated and block-bootstrap alike; residual-bootstrap narrower at every 5."""
    out = {}
    for method in ("ar1-inflated", "block-bootstrap"):
        out.update({(10, method): at_10, (5, method): at_5})
    out.update({(10, "residual-bootstrap"): at_10, (5, "residual-bootstrap"): at_10 / 2})
    return out


def test_the_table_counts_inside_outside_and_refused_apart_and_the_flat_pilots_width_at_each_cadence():
    rows = [
        _row("wsd-s0", "wsd", _halves(0.06, 0.06)),
        _row("cosine-s0", "cosine", _halves(0.02, "the interval is too wide to be of use")),
    ]
    rows[0]["intervals"][(5, "block-bootstrap")] = _given(0.04, inside=False)
    table = forecast_intervals.interval_table(rows)
    assert table[2] == (
        "| ar1-inflated **default** | 2/2, 4.00% (2.00%) | 1/2, 6.00% (3.00%), 1 refused | 6.00% -> 6.00% |"
    )
    assert table[3] == (
        "| block-bootstrap | 2/2, 4.00% (2.00%) | 0/2, 4.00% (2.00%), 1 outside, 1 refused | 6.00% -> 4.00% |"
    )
    assert table[4].endswith("| 6.00% -> 3.00% |")


def test_a_method_that_narrows_with_the_cadence_loses_a_tie_on_coverage_to_one_that_does_not():
    rows = [_row(f"wsd-s{seed}", "wsd", _halves(0.06, 0.06)) for seed in range(4)]
    held_out = forecast_intervals.interval_held_out(rows)
    # residual-bootstrap, narrowest at every 5, is not chosen; of the two equal ones the first listed
    assert [line.split(" | ")[1] for line in held_out[2:]] == ["ar1-inflated", "ar1-inflated"]
    for row in rows:
        row["intervals"][(5, "ar1-inflated")] = _given(0.05)
    held_out = forecast_intervals.interval_held_out(rows)
    assert [line.split(" | ")[1] for line in held_out[2:]] == ["block-bootstrap", "block-bootstrap"]
    rows[0]["intervals"][(10, "block-bootstrap")] = _given(0.06, inside=False)  # fewer inside: not chosen
    held_out = forecast_intervals.interval_held_out(rows)
    assert [line.split(" | ")[1] for line in held_out[2:]] == ["ar1-inflated", "block-bootstrap"]
