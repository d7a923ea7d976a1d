"""bench_forecast's measurement of annealed points: what a flat-LR pilot's residual sigma is made of, and
whether short cooldowns from its checkpoints (forecast_runs.anneal_points) narrow the interval.

The hypothesis measured (Hägele et al. 2024, arXiv 2405.18392): a model not annealed sits on its LR's noise
floor, so its validation losses scatter, while the losses of the same checkpoints annealed lie on a smooth
curve; a long run that ends annealed (WSD, cosine) would then be forecast from the annealed points, one that
ends at its peak LR (constant) from the annealed curve plus the gap between the pilot's own losses and their
annealed ones. Measured here, per healthy pilot: that gap at each checkpoint; the default forecast's
half-width split into its terms; the final forecast with the annealed points under each option, graded by the
long run, over every case and chosen on one half, graded on the other. Split from bench_forecast.py by size.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import numpy as np

from benchmarks.forecast_runs import ANNEAL_LENGTH, LONG_FACTOR, PILOT_STEPS, anneal_points

TARGET = PILOT_STEPS * LONG_FACTOR
# the normal's 95th percentile: a 90% interval's half, of a spread measured as a standard deviation
Z90 = 1.645


def anneal_end(pilot, branch) -> tuple[int, float, object] | None:
    """(the branch's last step, its validation loss there, its Setting for the areas) from the pilot's summary
    and the branch's (a cooldown resumed from one of the pilot's or its replay's checkpoints); None where the
    branch did not evaluate at its end."""
    from benchmarks.forecast_tables import setting_of
    from pilotrun.report.projection.forecast import SCHEDULE_FIELDS, Setting
    from pilotrun.report.projection.forecast_record import val_points

    at = int(branch.run["sessions"][-1]["resumed_from"])
    end = int(branch.final.step)
    loss = dict(val_points(branch.kept_events)).get(end)
    if loss is None:
        return None
    pilot_setting = setting_of(pilot)
    cooldown = {k: branch.run["recipe"]["optim"]["schedule"].get(k) for k in SCHEDULE_FIELDS}
    setting = Setting(pilot_setting.schedule, end, pilot_setting.tokens_per_update,
                      pilot_setting.train_tokens, then=(at, cooldown))
    return end, loss, setting


def gaps(summary, ends: dict[tuple[int, int], tuple]) -> list[tuple[int, float]]:
    """(step, the pilot's own val loss there less the annealed one) at each ANNEAL_LENGTH cooldown's end that
    the pilot also evaluated."""
    from pilotrun.report.projection.forecast_record import val_points

    own = dict(val_points(summary.kept_events))
    return sorted(
        (end, own[end] - loss)
        for (_, length), (end, loss, _) in ends.items()
        if length == ANNEAL_LENGTH and end in own
    )


# Which annealed points each option adds to the pilot's own (anneal_points' (checkpoint, length) pairs).
SUBSETS = {
    "+ 2 annealed (from 50, 100)": ((50, 10), (100, 10)),
    "+ 6 annealed (from 50-100, every 10)": tuple((a, 10) for a in range(50, 101, 10)),
    "+ 7 annealed (and 25 from 100)": tuple(anneal_points()),
}
ANNEALED_CURVE = "annealed curve (+ gap where the long run ends un-annealed)"


def _graded(value: float, low: float, high: float, measured: float) -> dict:
    return {"error": (value - measured) / measured, "inside": low <= measured <= high,
            "half": (high - low) / 2 / value}


def options(summary, long_summary, ends: dict[tuple[int, int], tuple]) -> dict[str, dict | None]:
    """The final forecast under each option, graded by the long run's measured final loss: the default
    (the pilot's evaluations alone), the default law fitted with each SUBSETS' annealed points too, and the
    annealed curve; None where refused."""
    from benchmarks.forecast_tables import setting_of
    from pilotrun.report.projection.forecast import NoForecast, forecast
    from pilotrun.report.projection.forecast_record import val_points

    measured = dict(val_points(long_summary.kept_events))[TARGET]
    points, pilot, target = val_points(summary.kept_events), setting_of(summary), setting_of(long_summary)
    out: dict[str, dict | None] = {}
    for name, keys in {"the pilot alone (default)": (), **SUBSETS}.items():
        branches = tuple(([ends[k][:2]], ends[k][2]) for k in keys if k in ends)
        try:
            final = forecast(points, pilot, target, [TARGET], branches=branches)["final"]
            out[name] = _graded(final["value"], final["low"], final["high"], measured)
        except NoForecast:
            out[name] = None
    curve = annealed_curve(summary, long_summary, ends)
    out[ANNEALED_CURVE] = None if curve is None else _graded(*curve, measured)
    return out


def annealed_curve(summary, long_summary, ends: dict) -> tuple[float, float, float] | None:
    """(value, low, high) at the long run's final step: the schedule-blind power law in updates fitted to the
    pilot's evaluations up to its first checkpoint cooled down (before it an annealing changes little: the
    loss is far above the LR's noise) and the annealed points, its bootstrap widened by the drift it shows
    on itself as the default's is; a long run whose LR ends above the annealed points' floor adds the gap
    (its mean, and its spread either side as a 90% half)."""
    from benchmarks.forecast_tables import setting_of
    from pilotrun.report.projection.forecast import (
        LEVEL,
        WIDEN,
        bootstrap,
        fit_law,
        holdout_drift,
        law_values,
        multipliers,
    )
    from pilotrun.report.projection.forecast_record import val_points

    first = min(at for at, _ in ends) if ends else 0
    warmup = int(setting_of(summary).schedule.get("warmup_steps") or 0)
    kept = [(s, v) for s, v in val_points(summary.kept_events) if warmup < s <= first]
    kept += [(end, loss) for end, loss, _ in ends.values()]
    if len(kept) < 6:
        return None
    kept.sort()
    x, y = np.array([s for s, _ in kept], dtype=float), np.array([v for _, v in kept])
    zero = np.zeros_like(x)
    fit = fit_law("steps", x, y, x, zero, "log-updates")
    if fit is None:
        return None
    at = (np.array([float(TARGET)]), np.array([float(TARGET)]), np.array([0.0]))
    value = float(law_values("steps", fit.alpha, fit.coef, *at)[0])
    preds = bootstrap(fit, x, (x, zero), at, np.random.default_rng(0))[:, 0]
    spread = preds - np.median(preds)
    drift = WIDEN[LEVEL] * holdout_drift(fit, x, y, x, zero) * math.log(TARGET / x[-1])
    low, high = value + np.quantile(spread, 0.05) - drift, value + np.quantile(spread, 0.95) + drift
    long_schedule = setting_of(long_summary).schedule
    floor = float(long_schedule.get("min_lr_ratio") or 0.0)
    if multipliers(long_schedule, TARGET)[-1] > floor + 1e-9:
        measured_gaps = [g for _, g in gaps(summary, ends)]
        mean = statistics.mean(measured_gaps)
        half = Z90 * statistics.stdev(measured_gaps) if len(measured_gaps) > 1 else 0.0
        value, low, high = value + mean, low + mean - half, high + mean + half
    return value, float(low), float(high)


def terms(summary, long_summary) -> dict[str, float]:
    """The default forecast's 90% half-width at the long run's final step (nats) and its parts: the
    bootstrap whole, its refits alone (alpha and A re-estimated from resampled residuals), one resampled
    residual alone, and the drift added either side."""
    from benchmarks.forecast_tables import setting_of
    from pilotrun.report.projection.forecast import (
        DEFAULT_LAW,
        DEFAULT_WEIGHTING,
        LEVEL,
        WIDEN,
        bootstrap,
        fit_law,
        fit_points,
        holdout_drift,
        law_values,
    )
    from pilotrun.report.projection.forecast_record import val_points

    pilot, target = setting_of(summary), setting_of(long_summary)
    x, y = fit_points(val_points(summary.kept_events), pilot, DEFAULT_WEIGHTING)
    _, s1, s2 = pilot.features(x)
    fit = fit_law(DEFAULT_LAW, x, y, s1, s2, DEFAULT_WEIGHTING)
    if fit is None:
        return {}
    at = target.features(np.array([TARGET]))
    rng = np.random.default_rng(0)
    whole = bootstrap(fit, x, (s1, s2), at, rng)[:, 0]
    fitted = law_values(fit.law, fit.alpha, fit.coef, x, s1, s2)
    scaled = (fit.residuals - fit.residuals.mean()) * math.sqrt(len(x) / (len(x) - 2))
    refits = [
        fit_law(fit.law, x, fitted + rng.choice(scaled, len(x)), s1, s2, fit.weighting) for _ in range(200)
    ]
    alone = [law_values(fit.law, r.alpha, r.coef, *at)[0] for r in refits if r is not None]

    def half(values) -> float:
        return float(np.quantile(values, 0.95) - np.quantile(values, 0.05)) / 2

    value = float(law_values(fit.law, fit.alpha, fit.coef, *at)[0])
    drift = WIDEN[LEVEL] * holdout_drift(fit, x, y, s1, s2) * math.log(TARGET / x[-1])
    return {"value": value, "bootstrap": half(whole), "refits": half(alone),
            "residual": half(rng.choice(scaled, 20000)), "drift": drift,
            "sigma": float(np.std(fit.residuals)),
            "autocorrelation": float(np.corrcoef(fit.residuals[:-1], fit.residuals[1:])[0, 1])}


def whole_locks(summary, long: Path, long_summary, ends: dict) -> dict[str, dict]:
    """The lock as freeze writes it, and the same lock with every annealed point fitted too (its curve, final
    and parameters from forecast() with them; its assumptions, the pilot's own fitted points and the rise
    check as the lock has them), each graded as summarize grades it and watched as watch watches it:
    {"default" | "annealed": {"graded": against()'s result, "first": the forecast alert's first step}}."""
    from benchmarks.forecast_runs import PILOT_EVAL_EVERY
    from benchmarks.forecast_tables import graded_and_watched, setting_of
    from pilotrun.report.projection.forecast import NoForecast, forecast
    from pilotrun.report.projection.forecast_record import eval_steps, lock_forecast, val_points

    run = summary.run
    base = {"recipe": run["recipe"], "data": {"metadata_sha256": run["data"]["train"]["metadata_sha256"]},
            "forecast": lock_forecast(summary, TARGET)}
    fc = base["forecast"]
    try:
        made = forecast(val_points(summary.kept_events), setting_of(summary), setting_of(long_summary),
                        eval_steps(PILOT_EVAL_EVERY, TARGET),
                        branches=tuple(([end[:2]], end[2]) for end in ends.values()))
        own = (fc.get("fitted_on") or {}).get("points") or (fc.get("rise") or {}).get("points") or []
        annealed = {**{k: v for k, v in fc.items() if k != "unavailable"}, **made,
                    "fitted_on": {**made["fitted_on"], "points": own}}
    except NoForecast as why:
        annealed = {**fc, "unavailable": f"no forecast: {why}"}
    out = {}
    for name, forecast_section in (("default", fc), ("annealed", annealed)):
        graded, _, alerts = graded_and_watched({**base, "forecast": forecast_section}, long, long_summary)
        out[name] = {"graded": graded or {}, "first": alerts[0].extra["first"] if alerts else None}
    return out


def whole_table(rows: list[dict]) -> list[str]:
    lines = [
        "| lock | healthy inside | median abs error (given) | mean half-width | alerts on a healthy run | "
        "refused |",
        "|---|---|---|---|---|---|",
    ]
    for name, words in (("default", "as freeze writes it"), ("annealed", "with the 7 annealed points")):
        graded = [r["whole"][name]["graded"] for r in rows]
        given = [g for g in graded if "final_step" in g and g.get("measured") is not None]
        halves = [(g["high"] - g["low"]) / 2 / g["predicted"] for g in given]
        lines.append(
            f"| {words} | {sum(bool(g['inside']) for g in given)}/{len(rows)} | "
            + (f"{100 * statistics.median(abs(g['error']) for g in given):.2f}% | "
               f"{100 * statistics.mean(halves):.2f}% | " if given else " | | ")
            + f"{sum(r['whole'][name]['first'] is not None for r in rows)}/{len(rows)} | "
            f"{len(rows) - len(given)} |"
        )
    return lines


def measure(case, pilot: Path, long: Path, branches: list[Path]) -> dict:
    """One healthy case's figures: its annealed points, the gaps, the options and the terms."""
    from pilotrun.report.record_check.summarize import summarize_run

    summary, long_summary = summarize_run(pilot), summarize_run(long)
    ends = {}
    for folder, key in zip(branches, anneal_points(), strict=True):
        end = anneal_end(summary, summarize_run(folder))
        if end is not None:
            ends[key] = end
    return {"case": case, "gaps": gaps(summary, ends), "options": options(summary, long_summary, ends),
            "terms": terms(summary, long_summary), "whole": whole_locks(summary, long, long_summary, ends)}


def _pct(value: float) -> str:
    return f"{100 * value:+.2f}%"


def gap_table(rows: list[dict]) -> list[str]:
    """Per case: the pilot's own loss less its annealed one at each checkpoint, and what the default law's
    residuals are made of (their sigma and lag-1 autocorrelation: a shape the law misses, or scatter)."""
    lines = [
        "| case | pilot's own less annealed (nats) at each cooldown's end | mean | sd | residual sigma | "
        "residuals' lag-1 autocorrelation |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        g, t = [v for _, v in r["gaps"]], r["terms"]
        lines.append(
            f"| {r['case'].name} | {', '.join(f'{s}: {v:+.3f}' for s, v in r['gaps'])} | "
            + (f"{statistics.mean(g):+.4f} | {statistics.stdev(g):.4f} | " if len(g) > 1 else " | | ")
            + (f"{t['sigma']:.4f} | {t['autocorrelation']:+.2f} |" if t else " | |")
        )
    return lines


def terms_table(rows: list[dict]) -> list[str]:
    """Per case: the default's 90% half-width and each term's share (the bootstrap's two parts split by their
    variances, the drift added linearly)."""
    lines = [
        "| case | half-width | bootstrap (nats) | its refits alone / one residual alone | drift added | "
        "shares: refits / residual / drift | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, default = r["terms"], r["options"]["the pilot alone (default)"]
        if not t:
            continue
        total = t["bootstrap"] + t["drift"]
        var = t["refits"] ** 2 + t["residual"] ** 2
        boot = t["bootstrap"]
        shares = (boot * t["refits"] ** 2 / var, boot * t["residual"] ** 2 / var, t["drift"])
        lines.append(
            f"| {r['case'].name} | {100 * total / t['value']:.2f}% ({total:.3f} nats) | {boot:.3f} | "
            f"{t['refits']:.3f} / {t['residual']:.3f} | {t['drift']:.3f} | "
            + " / ".join(f"{s / total:.0%}" for s in shares)
            + f" | {_pct(default['error']) if default else 'refused'} |"
        )
    return lines


def _figures(rows: list[dict], name: str) -> tuple[int, list[dict]]:
    """(how many of `rows` the option holds inside, its given forecasts)."""
    given = [r["options"][name] for r in rows if r["options"].get(name)]
    return sum(g["inside"] for g in given), given


def option_table(rows: list[dict]) -> list[str]:
    flat = [r for r in rows if r["case"].kind in ("wsd", "constant")]
    lines = [
        "| option | given a forecast | median abs error | inside 90% | mean half-width | the same over the "
        "WSD and constant pilots: inside, mean half-width |",
        "|---|---|---|---|---|---|",
    ]
    for name in rows[0]["options"]:
        inside, given = _figures(rows, name)
        flat_inside, flat_given = _figures(flat, name)
        if not given:
            continue
        lines.append(
            f"| {name} | {len(given)}/{len(rows)} | "
            f"{100 * statistics.median(abs(g['error']) for g in given):.2f}% | {inside}/{len(rows)} | "
            f"{100 * statistics.mean(g['half'] for g in given):.2f}% | {flat_inside}/{len(flat)}, "
            + (f"{100 * statistics.mean(g['half'] for g in flat_given):.2f}% |" if flat_given else " |")
        )
    return lines


def _choose(rows: list[dict]) -> str:
    """The option holding the most of `rows` inside (a refusal is not inside), of those the narrowest."""
    def key(name: str) -> tuple[int, float]:
        inside, given = _figures(rows, name)
        return -inside, statistics.mean(g["half"] for g in given) if given else math.inf

    return min(rows[0]["options"], key=key)


def option_held_out(rows: list[dict]) -> list[str]:
    """The option chosen on one half of the healthy cases (every other one, as bench_forecast's other held-out
    tables) and graded on the other, both ways."""
    halves = (rows[0::2], rows[1::2])
    lines = [
        "| chosen on | option chosen | inside there | graded on | inside | median abs error | mean "
        "half-width | refused |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for chosen_on, graded_on in (halves, halves[::-1]):
        name = _choose(chosen_on)
        inside, given = _figures(graded_on, name)
        lines.append(
            f"| {', '.join(r['case'].name for r in chosen_on)} | {name} | "
            f"{_figures(chosen_on, name)[0]}/{len(chosen_on)} | "
            f"{', '.join(r['case'].name for r in graded_on)} | {inside}/{len(graded_on)} | "
            + (f"{100 * statistics.median(abs(g['error']) for g in given):.2f}% | "
               f"{100 * statistics.mean(g['half'] for g in given):.2f}% | " if given else " | | ")
            + f"{len(graded_on) - len(given)} |"
        )
    return lines
