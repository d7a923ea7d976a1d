"""bench_forecast's interval check: every healthy pilot trained again evaluating every 5 updates instead of
every 10 (forecast_cadence.train_at: the same seed, data, recipe and updates), each forecast at both cadences
under every interval method of forecast.INTERVAL_METHODS (how the bootstrap's refits resample the fit's
residuals), graded against its long run; the method chosen on one half of the pilots and graded on the other,
both ways. docs/FORECAST.md says what it found. Split from bench_forecast.py by size."""

from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.forecast_cadence import FLAT, STORED_EVERY, train_at
from benchmarks.forecast_runs import Case, _pilot_dir, prepare

FINE_EVERY = 5
CADENCES = (FINE_EVERY, STORED_EVERY)


def generate_fine(work: Path, cases: list[Case], workers: int = 2) -> dict[str, dict[int, Path]]:
    """Each case's pilot at every 5 updates (trained where not stored) and its stored one at every 10."""
    data = prepare(work)
    with ThreadPoolExecutor(workers) as pool:
        fine = list(pool.map(lambda case: train_at(work, data, case, FINE_EVERY), cases))
    return {
        c.name: {FINE_EVERY: f, STORED_EVERY: _pilot_dir(work, c)} for c, f in zip(cases, fine, strict=True)
    }


def measure(pilots: dict[int, Path], long: Path, target: int) -> dict:
    """Per (cadence, interval method) the final forecast against the long run's measured final: {"error",
    "half", "half_no_drift", "inside", "rho"} or the refusal's reason."""
    from benchmarks.forecast_tables import with_and_without_drift
    from pilotrun.report.projection.forecast import INTERVAL_METHODS
    from pilotrun.report.projection.forecast_record import val_points
    from pilotrun.report.record_check.summarize import summarize_run

    long_summary = summarize_run(long)
    measured = dict(val_points(long_summary.kept_events))[target]
    out: dict = {}
    for every, path in pilots.items():
        summary = summarize_run(path)
        for method in INTERVAL_METHODS:
            made = with_and_without_drift(summary, long_summary, target, interval=method)
            if isinstance(made[None], str):
                out[(every, method)] = made[None]
                continue
            final = made[None]["final"]
            out[(every, method)] = {
                "error": (final["value"] - measured) / measured,
                "half": final["half_width_share"],
                "half_no_drift": made[0.0]["final"]["half_width_share"],
                "inside": final["low"] <= measured <= final["high"],
                "rho": made[None]["fitted_on"]["residual_lag1"],
            }
    return out


def _given(rows: list[dict], every: int, method: str) -> list[dict]:
    got = [r["intervals"][(every, method)] for r in rows]
    return [g for g in got if not isinstance(g, str)]


def _inside(rows: list[dict], every: int, method: str) -> int:
    return sum(g["inside"] for g in _given(rows, every, method))


def _mean_half(rows: list[dict], every: int, method: str, key: str = "half") -> float:
    given = _given(rows, every, method)
    return statistics.mean(g[key] for g in given) if given else float("nan")


def _key(rows: list[dict], method: str) -> tuple:
    """How a method ranks on these pilots: the most inside at both cadences together (a refusal holds none),
    then the least narrowing from every 10 to every 5 (the mean half-width at 5 over that at 10, up to 1: a
    finer cadence must not narrow it), then the narrowest at every 10."""
    inside = sum(_inside(rows, every, method) for every in CADENCES)
    ratio = _mean_half(rows, FINE_EVERY, method) / _mean_half(rows, STORED_EVERY, method)
    return (inside, min(ratio, 1.0), -_mean_half(rows, STORED_EVERY, method))


def _cell(rows: list[dict], every: int, method: str) -> str:
    given = len(_given(rows, every, method))
    outside, refused = given - _inside(rows, every, method), len(rows) - given
    return (
        f"{_inside(rows, every, method)}/{len(rows)}, {100 * _mean_half(rows, every, method):.2f}% "
        f"({100 * _mean_half(rows, every, method, 'half_no_drift'):.2f}%)"
        + (f", {outside} outside" if outside else "")
        + (f", {refused} refused" if refused else "")
    )


def interval_table(rows: list[dict]) -> list[str]:
    """Each interval method at every 10 and every 5 over the healthy pilots (inside, mean half-width of those
    given, without the drift in brackets, refused), and the six flat-LR pilots' mean half-width at each."""
    from pilotrun.report.projection.forecast import DEFAULT_INTERVAL, INTERVAL_METHODS

    flat = [r for r in rows if r["case"].kind in FLAT and not r["case"].mixture]
    lines = [
        "| interval method | every 10: inside, mean half-width (without the drift) | every 5: the same | "
        "flat-LR pilots' mean half-width, every 10 -> every 5 |",
        "|---|---|---|---|",
    ]
    for method in INTERVAL_METHODS:
        default = " **default**" if method == DEFAULT_INTERVAL else ""
        lines.append(
            f"| {method}{default} | {_cell(rows, STORED_EVERY, method)} | {_cell(rows, FINE_EVERY, method)} "
            f"| {100 * _mean_half(flat, STORED_EVERY, method):.2f}% -> "
            f"{100 * _mean_half(flat, FINE_EVERY, method):.2f}% |"
        )
    rhos = {every: [g["rho"] for g in _given(rows, every, DEFAULT_INTERVAL)] for every in CADENCES}
    lines += [
        "",
        "- the residuals' lag-1 autocorrelation (held to [0, 0.9]; the default method's fit): every 10 "
        f"{min(rhos[STORED_EVERY]):+.2f} to {max(rhos[STORED_EVERY]):+.2f}, every 5 "
        f"{min(rhos[FINE_EVERY]):+.2f} to {max(rhos[FINE_EVERY]):+.2f}.",
        "",
        *interval_held_out(rows),
    ]
    return lines


def interval_held_out(rows: list[dict]) -> list[str]:
    """The interval method chosen on one half of the healthy pilots (every other one in forecast_runs' order)
    by _key, graded on the other, both ways."""
    from pilotrun.report.projection.forecast import INTERVAL_METHODS

    halves = (rows[0::2], rows[1::2])
    lines = [
        "| chosen on | method chosen | graded on | inside, mean half-width: every 10 | every 5 |",
        "|---|---|---|---|---|",
    ]
    for chosen_on, graded_on in (halves, halves[::-1]):
        method = max(INTERVAL_METHODS, key=lambda m: _key(chosen_on, m))
        lines.append(
            f"| {', '.join(r['case'].name for r in chosen_on)} | {method} | "
            f"{', '.join(r['case'].name for r in graded_on)} | {_cell(graded_on, STORED_EVERY, method)} | "
            f"{_cell(graded_on, FINE_EVERY, method)} |"
        )
    return lines
