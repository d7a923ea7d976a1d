"""bench_forecast's measurements of the fit and the interval, and of the broken runs against their twins:
how the fit weighs the pilot's evaluations (forecast.FIT_WEIGHTINGS) and the 90% interval's drift weight
(forecast.DRIFT_WEIGHTS), each over every healthy case and chosen on one half, graded on the other; what the
default law makes of each pilot (docs/FORECAST.md's "why WSD and constant pilots miss"); each mixture source's
own forecast; each broken run's final against its healthy twin. Split from bench_forecast.py by size."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from benchmarks.forecast_live import twin_of
from benchmarks.forecast_runs import LONG_FACTOR, PILOT_STEPS, Case

TARGET = PILOT_STEPS * LONG_FACTOR


def setting_of(summary):
    from pilotrun.report.projection.forecast import Setting

    r = summary.run
    return Setting(
        r["recipe"]["optim"]["schedule"],
        r["recipe"]["train"]["max_steps"],
        r["tokens_per_update"],
        r["data"]["train"]["tokens"],
    )


def with_and_without_drift(summary, long_summary, target: int, **options) -> dict:
    """The pilot's forecast at `target` (forecast() with `options`) at the default drift weight (key None) and
    at none (key 0.0): each the forecast, or its refusal's reason."""
    from pilotrun.report.projection.forecast import NoForecast, forecast
    from pilotrun.report.projection.forecast_record import val_points

    made: dict = {}
    for drift in (None, 0.0):
        try:
            made[drift] = forecast(
                val_points(summary.kept_events),
                setting_of(summary),
                setting_of(long_summary),
                [target],
                drift_weight=drift,
                **options,
            )
        except NoForecast as why:
            made[drift] = str(why)
    return made


def _final_under(summary, long_summary, option: str, values) -> dict:
    """The default law's final prediction with forecast's `option` at each of `values`, against the long run's
    measured final loss: its signed error, inside or not, half-width share; None where refused."""
    from pilotrun.report.projection.forecast import NoForecast, forecast
    from pilotrun.report.projection.forecast_record import val_points

    measured = dict(val_points(long_summary.kept_events)).get(TARGET)
    out: dict = {}
    for value in values:
        try:
            final = forecast(
                val_points(summary.kept_events),
                setting_of(summary),
                setting_of(long_summary),
                [TARGET],
                **{option: value},
            )["final"]
        except NoForecast:
            out[value] = None
            continue
        out[value] = {
            "error": (final["value"] - measured) / measured,
            "inside": final["low"] <= measured <= final["high"],
            "half": final["half_width_share"],
        }
    return out


def weightings(summary, long_summary) -> dict[str, dict | None]:
    """The final prediction under each of forecast.FIT_WEIGHTINGS (how the fit weighs the pilot's
    evaluations)."""
    from pilotrun.report.projection.forecast import FIT_WEIGHTINGS

    return _final_under(summary, long_summary, "weighting", FIT_WEIGHTINGS)


def _signed(result: dict | None) -> str:
    return f"{100 * result['error']:+.2f}%" if result else "refused"


def weighting_tables(healthy: list[dict]) -> list[str]:
    """Each fit weighting over every healthy case, then chosen on one half (least median |error|, a refusal
    an infinite error) and graded on the other, both ways."""
    from pilotrun.report.projection.forecast import DEFAULT_WEIGHTING, FIT_WEIGHTINGS

    def median_error(rows, name):
        return statistics.median(
            abs(r["weightings"][name]["error"]) if r["weightings"].get(name) else math.inf for r in rows
        )

    def figures(rows, name):
        got = [r["weightings"][name] for r in rows if r["weightings"].get(name)]
        return (
            f"{100 * median_error(rows, name):.2f}% | {sum(g['inside'] for g in got)}/{len(rows)} | "
            + (f"{100 * statistics.mean(g['half'] for g in got):.2f}% | " if got else " | ")
            + f"{len(rows) - len(got)} |"
        )

    lines = [
        "| fit weighting | median abs error | inside | mean half-width | refused |",
        "|---|---|---|---|---|",
    ]
    for name in FIT_WEIGHTINGS:
        default = " **default**" if name == DEFAULT_WEIGHTING else ""
        lines.append(f"| {name}{default} | {figures(healthy, name)}")
    for name in FIT_WEIGHTINGS:
        lines += [
            "",
            f"Each case's error under `{name}`: "
            + ", ".join(f"{r['case'].name} {_signed(r['weightings'].get(name))}" for r in healthy)
            + ".",
        ]
    lines += [
        "",
        "| chosen on | weighting chosen | its median abs error there | graded on | median abs error | "
        "inside | mean half-width | refused |",
        "|---|---|---|---|---|---|---|---|",
    ]
    halves = (healthy[0::2], healthy[1::2])
    for chosen_on, graded_on in (halves, halves[::-1]):
        name = min(FIT_WEIGHTINGS, key=lambda w: median_error(chosen_on, w))
        others = [w for w in FIT_WEIGHTINGS if w != name]
        for shown in [name, *others]:
            lines.append(
                f"| {', '.join(r['case'].name for r in chosen_on)} | {shown}"
                f"{'' if shown == name else ' (not chosen, for comparison)'} | "
                f"{100 * median_error(chosen_on, shown):.2f}% | "
                f"{', '.join(r['case'].name for r in graded_on)} | {figures(graded_on, shown)}"
            )
    return lines


def graded_and_watched(lock: dict, long: Path, long_summary):
    """A lock's forecast graded against the long run as summarize grades it, and the run watched as
    `pilotrun watch --against LOCK` watches it: (against()'s result, the Watcher after its final check, the
    forecast alerts it raised)."""
    from pilotrun.report.projection.forecast_record import against
    from pilotrun.report.watch.alerts import Watcher

    graded = against(
        lock["forecast"],
        lock["recipe"],
        lock["data"]["metadata_sha256"],
        long_summary.run,
        long_summary.kept_events,
    )
    watcher = Watcher(long, lock=lock, holder=lambda path: None)
    watcher.check(final=True)
    return graded, watcher, [a for a in watcher.raised if a.kind == "forecast"]


def whole_by_weighting(summary, lock: dict, long: Path, long_summary) -> dict[str, dict]:
    """The whole lock under each of forecast.FIT_WEIGHTINGS (forecast_record.lock_forecast with that
    weighting), graded and watched (graded_and_watched): per weighting {"graded": against()'s result, "first":
    the first step of watch's forecast alert or None}."""
    from pilotrun.report.projection.forecast import FIT_WEIGHTINGS
    from pilotrun.report.projection.forecast_record import lock_forecast

    out = {}
    for weighting in FIT_WEIGHTINGS:
        weighed = {**lock, "forecast": lock_forecast(summary, TARGET, weighting=weighting)}
        graded, _, alerts = graded_and_watched(weighed, long, long_summary)
        out[weighting] = {"graded": graded or {}, "first": alerts[0].extra["first"] if alerts else None}
    return out


def whole_weighting_table(rows: list[dict]) -> list[str]:
    """Each fit weighting's whole lock over every case: the healthy runs inside (a refusal: not), the median
    |error| (a refusal: infinite), the mean half-width, watch's alerts on healthy runs, the broken runs
    flagged within their first 20% of updates (and where), the pilots refused."""
    from pilotrun.report.projection.forecast import DEFAULT_WEIGHTING, FIT_WEIGHTINGS

    healthy = [r for r in rows if r["case"].broken is None]
    broken = [r for r in rows if r["case"].broken is not None]
    lines = [
        "| fit weighting | healthy inside | median abs error | mean half-width | alerts on a healthy run | "
        "broken flagged within 20% (first step) | refused |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in FIT_WEIGHTINGS:
        graded = [r["whole"][name]["graded"] for r in healthy]
        given = [g for g in graded if "final_step" in g]
        errors = [abs(g["error"]) for g in given] + [math.inf] * (len(graded) - len(given))
        flagged = [
            f"{r['case'].name} {r['whole'][name]['first']}"
            for r in broken
            if r["whole"][name]["first"] is not None and r["whole"][name]["first"] <= 0.2 * TARGET
        ]
        refused = sum("unavailable" in r["whole"][name]["graded"] for r in rows)
        lines.append(
            f"| {name}{' **default**' if name == DEFAULT_WEIGHTING else ''} | "
            f"{sum(g['inside'] for g in given)}/{len(healthy)} | {100 * statistics.median(errors):.2f}% | "
            + (
                f"{100 * statistics.mean((g['high'] - g['low']) / 2 / g['predicted'] for g in given):.2f}% | "
                if given
                else " | "
            )
            + f"{sum(r['whole'][name]['first'] is not None for r in healthy)}/{len(healthy)} | "
            f"{len(flagged)}/{len(broken)} ({', '.join(flagged) or 'none'}) | {refused} |"
        )
    return lines


def drift_weights(summary, long_summary) -> dict[float, dict | None]:
    """The final prediction at each of forecast.DRIFT_WEIGHTS (the 90% interval's weight on the drift the
    pilot measures on itself)."""
    from pilotrun.report.projection.forecast import DRIFT_WEIGHTS

    return _final_under(summary, long_summary, "drift_weight", DRIFT_WEIGHTS)


def diagnosis(summary, long_summary) -> dict:
    """What the default law makes of the pilot: its alpha, the residual sigma of the fit, the pilot's own
    hold-out miss at its last evaluation (fitted on its first forecast.HOLDOUT_SHARE, signed: + the law above
    the loss), the drift's widening of the 90% interval at TARGET against the bootstrap's, and the pilot's
    val loss at its end (the same seed's pilots on other schedules compare there)."""
    import numpy as np

    from pilotrun.report.projection import forecast as fc
    from pilotrun.report.projection.forecast_record import val_points

    pilot, long = setting_of(summary), setting_of(long_summary)
    x, y = fc.fit_points(val_points(summary.kept_events), pilot, fc.DEFAULT_WEIGHTING)
    _, s1, s2 = pilot.features(x)
    fit = fc.fit_law(fc.DEFAULT_LAW, x, y, s1, s2, fc.DEFAULT_WEIGHTING)
    n = max(math.ceil(fc.HOLDOUT_SHARE * len(x)), 4)
    part = fc.fit_law(fc.DEFAULT_LAW, x[:n], y[:n], s1[:n], s2[:n], fc.DEFAULT_WEIGHTING)
    miss = fc.law_values(fc.DEFAULT_LAW, part.alpha, part.coef, x[-1:], s1[-1:], s2[-1:])[0] - y[-1]
    feats = long.features(np.array([TARGET]))
    boot = fc.bootstrap(fit, x, (s1, s2), feats, np.random.default_rng(0))[:, 0]
    drift = fc.holdout_drift(fit, x, y, s1, s2) * math.log(TARGET / x[-1]) * fc.WIDEN[fc.LEVEL]
    return {
        "alpha": fit.alpha,
        "sigma": float(np.std(fit.residuals)),
        "miss": float(miss),
        "boot": float(np.quantile(boot, 0.95) - np.quantile(boot, 0.05)) / 2,
        "drift": float(drift),
        "end": float(y[-1]),
    }


def diagnosis_table(healthy: list[dict]) -> list[str]:
    lines = [
        "| case | alpha | residual sigma | pilot's own hold-out miss at its end | interval: bootstrap half / "
        "drift added (nats) | pilot's val loss at its end | long run's error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in healthy:
        d, g = r["diagnosis"], r["graded"] or {}
        error = f"{100 * g['error']:+.2f}%" if "error" in g else "refused"
        lines.append(
            f"| {r['case'].name} | {d['alpha']:.4f} | {d['sigma']:.4f} | {d['miss']:+.3f} | "
            f"{d['boot']:.3f} / {d['drift']:.3f} | {d['end']:.3f} | {error} |"
        )
    return lines


def _weight_inside(rows: list[dict], weight: float) -> int:
    """How many of these healthy runs the interval at this drift weight holds inside (a refusal: not)."""
    return sum(bool((r["weights"].get(weight) or {}).get("inside")) for r in rows)


def _choose_weight(rows: list[dict]) -> float:
    """The narrowest drift weight whose 90% interval holds every one of these healthy runs inside (a refused
    forecast holds none); where none does, the one holding most."""
    from pilotrun.report.projection.forecast import DRIFT_WEIGHTS

    return max(DRIFT_WEIGHTS, key=lambda w: (_weight_inside(rows, w), -w))


def weight_held_out(healthy: list[dict]) -> list[str]:
    """The 90% interval's drift weight chosen on one half of the healthy cases (every other one in
    forecast_runs' order, a pilot refused at some weight included) and graded on the other, both ways."""
    halves = (healthy[0::2], healthy[1::2])
    lines = [
        "| chosen on | drift weight chosen | inside there | graded on | inside | mean half-width | refused |",
        "|---|---|---|---|---|---|---|",
    ]
    for chosen_on, graded_on in (halves, halves[::-1]):
        weight = _choose_weight(chosen_on)
        given = [r["weights"][weight] for r in graded_on if r["weights"].get(weight)]
        lines.append(
            f"| {', '.join(r['case'].name for r in chosen_on)} | {weight:g} | "
            f"{_weight_inside(chosen_on, weight)}/{len(chosen_on)} | "
            f"{', '.join(r['case'].name for r in graded_on)} | {_weight_inside(graded_on, weight)}/"
            f"{len(graded_on)} | "
            + (f"{100 * statistics.mean(g['half'] for g in given):.2f}% | " if given else " | ")
            + f"{len(graded_on) - len(given)} |"
        )
    return lines


def weight_table(healthy: list[dict]) -> list[str]:
    """Each drift weight over every healthy case: inside, mean half-width of those given, refused."""
    from pilotrun.report.projection.forecast import DRIFT_WEIGHTS, LEVEL, WIDEN

    lines = ["| drift weight | inside | mean half-width | refused |", "|---|---|---|---|"]
    for weight in DRIFT_WEIGHTS:
        given = [r["weights"][weight] for r in healthy if r["weights"].get(weight)]
        default = " **default**" if weight == WIDEN[LEVEL] else ""
        lines.append(
            f"| {weight:g}{default} | {_weight_inside(healthy, weight)}/{len(healthy)} | "
            + (f"{100 * statistics.mean(g['half'] for g in given):.2f}% | " if given else " | ")
            + f"{len(healthy) - len(given)} |"
        )
    return lines


def _final(folder: Path) -> tuple[float | None, dict[str, float]]:
    """(the run's final val loss at TARGET, each mixture source's own there)."""
    from pilotrun.report.record_check.summarize import summarize_run

    last = [e for e in summarize_run(folder).kept_events if e.get("event") == "val" and e["step"] == TARGET]
    return (last[-1]["loss"], last[-1].get("loss_by_source") or {}) if last else (None, {})


def _seed_spread(pairs: dict, healthy: list[Case]) -> float:
    """The median over schedule kinds of (the largest - the smallest final val loss of the kind's seeds) /
    their mean: how far healthy runs of one recipe end apart."""
    kinds: dict[tuple, list[float]] = {}
    for case in healthy:
        loss = _final(pairs[case.name][1])[0]
        if loss is not None and not case.mixture:
            kinds.setdefault((case.kind, case.lr), []).append(loss)
    spreads = [(max(v) - min(v)) / statistics.mean(v) for v in kinds.values() if len(v) > 1]
    return statistics.median(spreads) if spreads else math.nan


def twins(pairs: dict, broken: list[Case], healthy: list[Case]) -> tuple[str, list[str], dict]:
    """Each broken run's final val loss (and, for a mixture, each source's own) against its healthy twin (the
    same kind, seed, LR and data, trained straight through), and which ended no worse than the twin by more
    than the seeds' spread: not broken at this size, whatever the watch says. Also each one's changes, by
    case name ({"val loss": share, "<source>'s own": share})."""
    spread = _seed_spread(pairs, healthy)
    parts, not_worse, changes = [], [], {}
    for case in broken:
        twin = twin_of(case, healthy)
        if twin is None:
            continue
        (loss, sources), (twin_loss, twin_sources) = _final(pairs[case.name][1]), _final(pairs[twin.name][1])
        if loss is None or twin_loss is None:
            continue
        change = {"val loss": loss / twin_loss - 1}
        change.update((f"{name}'s own", sources[name] / twin_sources[name] - 1) for name in sorted(sources)
                      if name in twin_sources)
        changes[case.name] = change
        parts.append(f"{case.name} against {twin.name}: " + ", ".join(
            f"{name} {100 * v:+.2f}%" for name, v in change.items()))
        if max(change.values()) <= spread:
            not_worse.append(case.name)
    head = (
        f"Each broken run's final at step {TARGET} against its healthy twin (the healthy runs of one recipe "
        f"end {100 * spread:.2f}% apart across seeds, the median over schedule kinds): " + "; ".join(parts)
        + ". No worse than the twin by more than that (not broken at this size): "
        + (", ".join(not_worse) or "none") + "."
    )
    return head, not_worse, changes


def mixture_sources_note(pairs: dict) -> str:
    """What a forecast of each mixture source's own val loss (the default law on the pilot's evaluations of
    that source) says against the healthy mixture long run's: what forecasting a mixture source by source
    would take."""
    from pilotrun.report.projection.forecast import NoForecast, forecast
    from pilotrun.report.projection.forecast_record import val_points_by_source
    from pilotrun.report.record_check.summarize import summarize_run

    pilot, long = (summarize_run(folder) for folder in pairs["mixture-cosine-s0"])
    measured = {
        name: dict(points).get(TARGET) for name, points in val_points_by_source(long.kept_events).items()
    }
    parts = []
    for name, points in sorted(val_points_by_source(pilot.kept_events).items()):
        try:
            final = forecast(points, setting_of(pilot), setting_of(long), [TARGET])["final"]
        except NoForecast as why:
            parts.append(f"{name}: no forecast: {why}")
            continue
        parts.append(
            f"{name}: {final['value']:.3f} [{final['low']:.3f}, {final['high']:.3f}] against "
            f"{measured.get(name):.3f} measured ({100 * (final['value'] / measured[name] - 1):+.2f}%)"
        )
    return (
        "Each mixture source's own val loss forecast from the mixture pilot's evaluations of it (the default "
        "law; a mixture's forecast by source would be these under the weights): " + "; ".join(parts) + "."
    )


def default_weight() -> float:
    from pilotrun.report.projection.forecast import LEVEL, WIDEN

    return WIDEN[LEVEL]

