"""The forecast graded by real long runs: pilots of configs/smoke.yaml's model on the built-in corpus (100
updates, evaluated every 10), each forecasting its long run 10x longer (1,000 updates, the same schedule kind
over its own horizon, evaluated every 25), and the long runs trained for real (benchmarks/forecast_runs.py):
cosine, WSD and constant schedules x seeds 0-2, cosine at twice the LR, and a cosine run on a mixture of two
sources (11 healthy); long runs broken on purpose on a resume at 10% of the updates (the LR x2 and x10 through
--allow-change, fp16 made to skip, the mixture's second source dropped); two cooldown branches per pilot
(forecast_runs.train_branch).

Per case: the lock's forecast (forecast_record.lock_forecast, what `freeze --target-steps 1000` writes),
graded as summarize grades it (forecast_record.against) and watched as `pilotrun watch --against LOCK` watches
(Watcher, its `forecast` alert). Figures: coverage of the 90% interval, median |relative error| of the final
validation loss, mean half-width, the first step a run left the band (two evaluations in a row) and watch's
alerts; the largest rise above the run's own refitted course (what forecast.RISE_SHARE is chosen by); the
same fit under each candidate law (forecast.LAWS), alone and with the cooldown branches; the law chosen on
half of the healthy pilots, graded on the other half; what the default law makes of each pilot (alpha, the
residual sigma, its own hold-out miss, the interval's parts); the 90% interval's drift weight
(forecast.DRIFT_WEIGHTS) chosen on one half and graded on the other; each mixture source's own forecast;
the annealed points (cooldowns from each checkpoint of the pilot's second half: forecast_anneal.py): the
pilot's loss less the annealed one, the default half-width by term, the forecast with them; the cadence
check (forecast_cadence.py: each flat-LR pilot trained again evaluating every 5 and 20 updates, its forecast
at each cadence); the interval check (forecast_intervals.py: every healthy pilot trained again evaluating
every 5 updates, its 90% interval at every 5 and 10 under each of forecast.INTERVAL_METHODS, the method chosen
on one half and graded on the other); and each broken
run's final against its healthy twin (a run no worse than its twin is not broken at this size); the alerts
naming each breakage counted apart by what they read, the loss or the record (forecast_live).
Goals: >= 9 of 10 healthy inside, median error <= 1%, half-width <= 2%, every broken run flagged within its
first 20% of tokens, no alert on a healthy one.

The runs are trained into WORK and kept: a second invocation grades the same runs without training them again
(the section says how many it trained and how long that took).
`python -m benchmarks.run_all bench_forecast`
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.forecast_anneal import (
    gap_table,
    measure,
    option_held_out,
    option_table,
    terms_table,
    whole_table,
)
from benchmarks.forecast_cadence import cadence_table, flat_cases, generate_cadences
from benchmarks.forecast_cadence import measure as measure_cadence
from benchmarks.forecast_intervals import generate_fine, interval_table
from benchmarks.forecast_intervals import measure as measure_intervals
from benchmarks.forecast_live import breakage_alerts, by_evidence
from benchmarks.forecast_runs import (
    BRANCHES,
    BREAK_SHARE,
    LONG_FACTOR,
    PILOT_STEPS,
    Case,
    anneal_points,
    broken_cases,
    generate,
    generate_anneal,
    generate_branches,
    healthy_cases,
)
from benchmarks.forecast_tables import (
    default_weight,
    diagnosis,
    diagnosis_table,
    drift_weights,
    graded_and_watched,
    mixture_sources_note,
    setting_of,
    twins,
    weight_held_out,
    weight_table,
    weighting_tables,
    weightings,
    whole_by_weighting,
    whole_weighting_table,
)

WORK = Path(tempfile.gettempdir()) / "pilotrun-bench-forecast"
TARGET = PILOT_STEPS * LONG_FACTOR


def _lock(pilot: Path):
    from pilotrun.report.projection.forecast_record import lock_forecast
    from pilotrun.report.record_check.summarize import summarize_run

    summary = summarize_run(pilot)
    run = summary.run
    return summary, {
        "recipe": run["recipe"],
        "data": {"metadata_sha256": run["data"]["train"]["metadata_sha256"]},
        "forecast": lock_forecast(summary, TARGET),
    }


# The laws also fitted with the pilot's cooldown branches (forecast_runs.BRANCHES): their annealing term is
# what the branches' LR decay would pin.
WITH_BRANCHES = ("area", "annealing-nofloor", "annealing")


def _laws(summary, long_summary, branches: list[Path]) -> dict[str, dict]:
    """Each candidate law's final prediction against the long run's measured final loss, alone and (for
    WITH_BRANCHES) with the pilot's cooldown branches."""
    from pilotrun.report.projection.forecast import LAWS, NoForecast, forecast
    from pilotrun.report.projection.forecast_record import branch_input, val_points
    from pilotrun.report.record_check.summarize import summarize_run

    setting = setting_of
    measured = dict(val_points(long_summary.kept_events)).get(TARGET)
    fitted = tuple(branch_input(summary, summarize_run(b)) for b in branches)
    tries = [(law, law, ()) for law in LAWS]
    tries += [(f"{law} + {len(fitted)} cooldown branches", law, fitted) for law in WITH_BRANCHES if fitted]
    out = {}
    for name, law, with_branches in tries:
        try:
            final = forecast(
                val_points(summary.kept_events),
                setting(summary),
                setting(long_summary),
                [TARGET],
                law=law,
                branches=with_branches,
            )["final"]
        except NoForecast:
            continue
        out[name] = {
            "error": (final["value"] - measured) / measured,
            "inside": final["low"] <= measured <= final["high"],
            "half": final["half_width_share"],
        }
    return out


def grade_case(case: Case, pilot: Path, long: Path, branches: list[Path]) -> dict:
    from pilotrun.report.record_check.summarize import summarize_run

    summary, lock = _lock(pilot)
    long_summary = summarize_run(long)
    graded, watcher, alerts = graded_and_watched(lock, long, long_summary)
    others: dict[str, int] = {}
    # watch's other alerts on the same run, by the step each kind was first raised at
    for a in watcher.raised:
        if a.kind not in ("forecast", "session_end") and a.step is not None:
            others.setdefault(a.kind, a.step)
    overflows = sum(e.get("event") == "overflow" for e in long_summary.kept_events)
    return {
        "case": case,
        "graded": graded,
        "alert": alerts[0] if alerts else None,
        "others": others,
        "overflows": overflows,
        "laws": _laws(summary, long_summary, branches),
        "weights": drift_weights(summary, long_summary) if case.broken is None else {},
        "weightings": weightings(summary, long_summary) if case.broken is None else {},
        "whole": whole_by_weighting(summary, lock, long, long_summary),
        "diagnosis": diagnosis(summary, long_summary) if case.broken is None else {},
        "notes": [n for n in watcher.new_notes() if "forecast" in n],
        "rise": _largest_rise(lock, long_summary),
        "source_rises": _source_rises(lock, long_summary) if "rise" in lock["forecast"] else {},
        "lock": lock,
    }


def _row(r: dict) -> str:
    g, case = r["graded"] or {}, r["case"]
    alert = f"step {r['alert'].extra['first']} (raised at {r['alert'].step})" if r["alert"] else "none"
    others = ", ".join(f"{kind} at {step}" for kind, step in r["others"].items()) or "none"
    if case.broken == "fp16_skips":
        others += f"; {r['overflows']} overflow(s) skipped"
    if "final_step" not in g:  # refused: no number; a lock refused as too noisy still holds the rise check
        held = alert + (" (the rise check alone)" if "rise" in r["lock"]["forecast"] else "")
        return f"| {case.name} | {g.get('unavailable') or g} | | | | | {held} | {others} |"
    return (
        f"| {case.name} | {g['predicted']:.3f} [{g['low']:.3f}, {g['high']:.3f}] | {g['measured']:.3f} | "
        f"{100 * g['error']:+.2f}% | {'yes' if g['inside'] else 'no'} | "
        f"{100 * (g['high'] - g['low']) / 2 / g['predicted']:.2f}% | {alert} | {others} |"
    )


def _law_table(healthy: list[dict]) -> list[str]:
    from pilotrun.report.projection.forecast import LAWS

    lines = [
        "| law | pilots fitted | median abs error | inside 90% | mean half-width |",
        "|---|---|---|---|---|",
    ]
    names = {law: f"{law}: {formula}" for law, formula in LAWS.items()}
    names.update((name, name) for r in healthy for name in r["laws"] if name not in names)
    for law, label in names.items():
        got = [r["laws"][law] for r in healthy if law in r["laws"]]
        if got:
            lines.append(
                f"| {label} | {len(got)} | "
                f"{100 * statistics.median(abs(g['error']) for g in got):.2f}% | "
                f"{sum(g['inside'] for g in got)}/{len(got)} | "
                f"{100 * statistics.mean(g['half'] for g in got):.2f}% |"
            )
    return lines


def _choose(half: list[dict]) -> str:
    """The law of least median |error| on these pilots, a refused forecast counted as an infinite error; of
    equal ones, the one refused least."""
    laws = {name for r in half for name in r["laws"]}
    return min(sorted(laws), key=lambda law: (round(_median_error(half, law), 6), _refused(half, law)))


def _refused(rows: list[dict], law: str) -> int:
    return sum(law not in r["laws"] for r in rows)


def _median_error(rows: list[dict], law: str) -> float:
    return statistics.median(abs(r["laws"][law]["error"]) if law in r["laws"] else math.inf for r in rows)


def _held_out(healthy: list[dict]) -> list[str]:
    """The law chosen on one half of the healthy pilots (every other case in forecast_runs' order, so that
    each half holds every schedule kind) and graded on the other, both ways."""
    halves = (healthy[0::2], healthy[1::2])
    lines = [
        "| chosen on | law chosen | its median abs error there | graded on | median abs error | inside 90% "
        "| mean half-width | refused |",
        "|---|---|---|---|---|---|---|---|",
    ]
    from pilotrun.report.projection.forecast import DEFAULT_LAW

    for (chosen_on, graded_on), law, compared in [
        (pair, pick, i == 1)
        for pair in (halves, halves[::-1])
        for i, pick in enumerate(dict.fromkeys((_choose(pair[0]), DEFAULT_LAW)))
    ]:
        there = _median_error(chosen_on, law)
        got = [r["laws"][law] for r in graded_on if law in r["laws"]]
        names = ", ".join(r["case"].name for r in chosen_on)
        graded = ", ".join(r["case"].name for r in graded_on)
        lines.append(
            f"| {names} | {law}{' (the default, for comparison)' if compared else ''} | "
            f"{100 * there:.2f}% | {graded} | "
            + (
                f"{100 * statistics.median(abs(g['error']) for g in got):.2f}% | "
                f"{sum(g['inside'] for g in got)}/{len(got)} | "
                f"{100 * statistics.mean(g['half'] for g in got):.2f}% | "
                if got
                else "| | | "
            )
            + f"{len(graded_on) - len(got)} |"
        )
    return lines


def _span(pairs: dict) -> tuple[float, float]:
    """(seconds from the first run's first line to the last run's last line, the sum of every session's wall
    seconds): how long training the runs took, read from their own records (the same whether this invocation
    or
    an earlier one trained them)."""
    from pilotrun.run.record import read_metrics_strict

    first, last, walls = [], [], 0.0
    for folder in (f for pair in pairs.values() for f in pair):
        events = read_metrics_strict(folder)
        first.append(events[0]["time"])
        last.append(events[-1]["time"])
        walls += sum(
            (e.get("time_split") or {}).get("wall_seconds", 0.0)
            for e in events
            if e["event"] == "session_end"
        )
    return max(last) - min(first), walls


def _mixture_note(pairs: dict) -> str:
    """What the dropped source did to the losses watch sees, against the healthy mixture run at the same
    evaluations (from the break to 20% of the updates)."""
    from pilotrun.report.record_check.summarize import summarize_run

    def by_step(folder: Path) -> dict[int, dict]:
        return {
            e["step"]: e
            for e in summarize_run(folder).kept_events
            if e.get("event") == "val" and BREAK_SHARE * TARGET < e["step"] <= 0.2 * TARGET
        }

    names = ("mixture-cosine-s0", "mixture-cosine-s0-drop_code")
    healthy, dropped = (by_step(pairs[name][1]) for name in names)
    steps = sorted(set(healthy) & set(dropped))
    if not steps:
        return "The mixture runs have no evaluation to compare."

    def change(field) -> str:
        return ", ".join(f"{100 * (field(dropped[t]) / field(healthy[t]) - 1):+.1f}%" for t in steps)

    return (
        f"Against the healthy mixture run at steps {', '.join(map(str, steps))}: its val loss (the mean "
        f"under the weights in force, what watch reads) {change(lambda e: e['loss'])}; the dropped code "
        f"source's own {change(lambda e: e['loss_by_source']['code'])}; the built-in corpus's "
        f"{change(lambda e: e['loss_by_source']['builtin'])}."
    )


def _largest_rise(lock: dict, long_summary) -> tuple[float, int] | None:
    """(the largest share two evaluations in a row rose above the law refitted to the pilot's and the run's
    own evaluations before each, the first step of the two): what forecast.RISE_SHARE is chosen by."""
    from pilotrun.report.projection.forecast_record import val_points

    fc = lock["forecast"]
    if not fc.get("rise"):
        return None
    # a pilot refused a forecast as too noisy: its rise check carries the points it refits from
    fitted = (fc.get("fitted_on") or {}).get("points") or fc["rise"]["points"]
    return _rise_of(fc, fitted, val_points(long_summary.kept_events))


def _source_rises(lock: dict, long_summary) -> dict[str, tuple[float, int]]:
    """_largest_rise of each mixture source's own val loss against its own refitted course (the lock's
    rise.by_source: the pilot's evaluations of that source)."""
    from pilotrun.report.projection.forecast_record import val_points_by_source

    fc = lock["forecast"]
    by_source = (fc.get("rise") or {}).get("by_source") or {}
    own = val_points_by_source(long_summary.kept_events)
    return {name: _rise_of(fc, pts, own[name]) for name, pts in sorted(by_source.items()) if name in own}


def _rise_of(fc: dict, fitted: list, points: list[tuple[int, float]]) -> tuple[float, int]:
    from pilotrun.report.projection.forecast import DEFAULT_LAW, Setting, refitted_at

    rise = fc["rise"]
    tpu, tokens = rise["tokens_per_update"], rise["train_tokens"]
    pilot = Setting(rise["pilot_schedule"], rise["from_step"], tpu, tokens)
    run = Setting(fc["assumes"]["schedule"], TARGET, tpu, tokens)
    shares = [
        (loss / refitted_at(fc.get("law") or DEFAULT_LAW, fitted, pilot, points[:i], run, step) - 1, step)
        for i, (step, loss) in enumerate(points)
        if rise["from_step"] < step <= TARGET
    ]
    return max(((min(a[0], b[0]), a[1]) for a, b in zip(shares, shares[1:])), key=lambda pair: pair[0])


def _count(flagged: list[dict], among: list[dict]) -> str:
    names = [r["case"].name for r in among]
    return f"{sum(r in flagged for r in among)} of {len(among)}" + (f" ({', '.join(names)})" if names else "")


def _said(alerts: list) -> str:
    return "; ".join(f"{key} at {step}" + (f" ({times} in all)" if times > 1 else "")
                     for step, key, times in alerts) or "none"


def _within(alerts: list) -> bool:
    return bool(alerts) and alerts[0][0] <= 0.2 * TARGET


def _broken_table(broken: list[dict], changes: dict, not_worse: list[str]) -> list[str]:
    """Per broken run: the forecast's own alert, the alerts that name the breakage (a live watch's,
    forecast_live) split by what they read (the loss; the record), whether each flagged it within 20% of its
    updates, and its final against its healthy twin."""
    lines = [
        "Each broken run as a live watch would have followed it (benchmarks/forecast_live.py: the record "
        "replayed one evaluation at a time, rules judged at each (a live watch judges them as often as their "
        "cost allows); an alert names the breakage where its class (its key; its kind for a spike or a change"
        " on resume) is raised after the break and never after the break on the healthy twin's replay), the "
        "alerts that read the loss (the forecast's band, rise or a source's rise; a loss spike, the envelope)"
        " apart from those that read the record (the change on resume that left the forecast's assumptions, "
        "`forecast_change`; a rule such as skip_rate):",
        "",
        "| broken run | the forecast's alert (band or rise: first step) | by the loss: alerts naming the "
        "breakage (each first raised after the evaluation at) | by the record: alerts naming the breakage | "
        "within 20%: by the loss / by the record | final val loss against its healthy twin |",
        "|---|---|---|---|---|---|",
    ]
    for r in broken:
        name, split = r["case"].name, by_evidence(r["breakage"])
        band = f"step {r['alert'].extra['first']}" if r["alert"] else "none"
        change = ", ".join(f"{k} {100 * v:+.2f}%" for k, v in changes.get(name, {}).items()) or "no twin"
        verdict = "no worse than its twin" if name in not_worse else "worse"
        within = " / ".join("yes" if _within(split[kind]) else "no" for kind in ("loss", "record"))
        lines.append(
            f"| {name} | {band} | {_said(split['loss'])} | {_said(split['record'])} | {within} | {change} "
            f"({verdict}) |"
        )
    return lines


def _flagged_line(broken: list[dict], worse: list[dict], no_worse: list[dict], by_forecast: int) -> str:
    """The goal line for the broken runs: flagged within 20% by the loss and by the record, counted apart
    (each run with its first step), never merged into one count."""

    def flagged(kind: str) -> list[dict]:
        return [r for r in broken if _within(by_evidence(r["breakage"])[kind])]

    def named(rows: list[dict], kind: str) -> str:
        return ", ".join(f"{r['case'].name} at {by_evidence(r['breakage'])[kind][0][0]}" for r in rows)

    loss, record = flagged("loss"), flagged("record")
    return (
        "- broken runs flagged within their first 20% of updates (= tokens) by a watch alert that names the "
        "breakage (the table below), counted apart by what the alert reads (goal every one, as the goal is "
        f"written): (a) by the loss (the forecast's band, rise or a source's rise; a loss spike, the "
        f"envelope): {len(loss)} of {len(broken)} ({_met(len(loss) == len(broken))}: "
        f"{named(loss, 'loss') or 'none'}); of those that ended worse than their healthy twin "
        f"{_count(loss, worse)}, of those that ended no worse (not broken in loss at this size) "
        f"{_count(loss, no_worse)}; by the forecast's own alert alone {by_forecast} of {len(broken)}. (b) by "
        f"the record (the change on resume that left the forecast's assumptions, a rule such as skip_rate): "
        f"{len(record)} of {len(broken)} ({_met(len(record) == len(broken))}: "
        f"{named(record, 'record') or 'none'})"
    )


def _met(yes: bool) -> str:
    return "met" if yes else "**missed**"


def _branch_words() -> str:
    return ", ".join(f"{k} updates from step {at} down to the LR floor" for at, k in BRANCHES)


def _branch_wall(branches: dict[str, list[Path]]) -> float:
    """The branches' own sessions' wall seconds (each folder also holds the pilot's history it branched
    from)."""
    import json

    from pilotrun.run.record import read_metrics_strict

    total = 0.0
    for folder in (f for paths in branches.values() for f in paths):
        own = json.loads((folder / "run.json").read_text())["sessions"][-1]["session_id"]
        total += sum(
            (e.get("time_split") or {}).get("wall_seconds", 0.0)
            for e in read_metrics_strict(folder)
            if e["event"] == "session_end" and e.get("session_id") == own
        )
    return total


def _anneal_lines(pairs: dict, anneal: dict[str, list[Path]]) -> list[str]:
    """benchmarks/forecast_anneal.py's tables: the annealed points against the pilot's own, the default's
    half-width by term, and the forecast with the annealed points, over every case and held out."""
    rows = [measure(case, *pairs[case.name], anneal[case.name]) for case in healthy_cases()]
    cost = sum(k for _, k in anneal_points()) + PILOT_STEPS // 2
    replays = [WORK / "runs" / f"{case.name}-pilot-replay" for case in healthy_cases()]
    wall = _branch_wall({**anneal, "replays": [f for f in replays if f.is_dir()]})
    return [
        "Annealed points (forecast_anneal.py; Hägele et al. 2024, arXiv 2405.18392): each healthy pilot "
        f"replayed from step {PILOT_STEPS // 2} with a checkpoint every 10 updates (bit for bit its own "
        "updates), then cooled down to the LR floor from each checkpoint "
        f"({', '.join(f'{k} updates from {at}' for at, k in anneal_points())}; {cost} updates with the "
        f"replay, {cost / PILOT_STEPS:.2f}x the pilot's own; those of the {len(rows)} pilots took "
        f"{wall / 60:.1f} min of sessions' wall time). The pilot's own val loss less the annealed one "
        "at the same step (negative: annealing bought nothing), and the default law's residuals:",
        "",
        *gap_table(rows),
        "",
        "The default forecast's 90% half-width at the long run's final step by term (the bootstrap's two "
        "parts split by their variances; the drift, forecast.WIDEN's share of the pilot's own hold-out miss, "
        "added either side; recomputed at the final step alone, as the law table is: its draws are not the "
        "lock's, which draws at every step of the curve, so a half-width here is within about 0.5 points of "
        "the first table's):",
        "",
        *terms_table(rows),
        "",
        "The final forecast with the annealed points, over every healthy case: the default law fitted to "
        "the pilot's evaluations and the annealed points (their own LR areas), or the annealed curve (a "
        "power law in updates fitted to the pilot's evaluations to step "
        f"{PILOT_STEPS // 2} and the annealed points; a long run that ends at a higher LR than the floor "
        "adds the measured gap, its spread either side):",
        "",
        *option_table(rows),
        "",
        "The option chosen on half of the healthy cases (the most inside, then the narrowest) and graded on "
        "the other half, both ways:",
        "",
        *option_held_out(rows),
        "",
        "The whole lock with the annealed points (the curve, final and parameters fitted with all 7; the "
        "rise check as the lock has it), graded and watched as above, beside the lock as freeze writes it:",
        "",
        *whole_table(rows),
    ]


def run() -> str:
    started = time.time()
    cases = healthy_cases() + broken_cases()
    before = sum(1 for _ in (WORK / "runs").glob("*/metrics.jsonl")) if (WORK / "runs").is_dir() else 0
    pairs = generate(WORK, cases)
    branches = generate_branches(WORK, cases)
    anneal = generate_anneal(WORK, healthy_cases())
    cadences = generate_cadences(WORK, healthy_cases())
    fine = generate_fine(WORK, healthy_cases())
    trained = sum(1 for _ in (WORK / "runs").glob("*/metrics.jsonl")) - before
    train_seconds = time.time() - started
    _, walls = _span(pairs)
    rows = [grade_case(case, *pairs[case.name], branches[case.name]) for case in cases]
    every_healthy = [r for r in rows if r["case"].broken is None]
    healthy = [r for r in every_healthy if "final_step" in (r["graded"] or {})]
    unfit = len(every_healthy) - len(healthy)  # healthy pilots refused a forecast: not inside, no error
    broken = [r for r in rows if r["case"].broken is not None]
    errors = [abs(r["graded"]["error"]) for r in healthy]
    strict = statistics.median(errors + [math.inf] * unfit) if errors else math.inf
    halves = [(r["graded"]["high"] - r["graded"]["low"]) / 2 / r["graded"]["predicted"] for r in healthy]
    inside = sum(r["graded"]["inside"] for r in healthy)
    false_alerts = sum(r["alert"] is not None for r in every_healthy)
    flagged = [r for r in broken if r["alert"] is not None and r["alert"].extra["first"] <= 0.2 * TARGET]
    refused = [r for r in rows if "unavailable" in (r["graded"] or {})]
    healthy_cases_ = [r["case"] for r in rows if r["case"].broken is None]
    flat = [r for r in rows if r["case"] in flat_cases(healthy_cases_)]
    for r in flat:
        r["cadence"] = measure_cadence(cadences[r["case"].name], pairs[r["case"].name][1], TARGET)
    for r in every_healthy:
        r["intervals"] = measure_intervals(fine[r["case"].name], pairs[r["case"].name][1], TARGET)
    twin_line, not_worse, changes = twins(pairs, [r["case"] for r in broken], healthy_cases_)
    locks = {r["case"].name: r["lock"] for r in rows}
    for r in broken:
        r["breakage"] = breakage_alerts(r["case"], healthy_cases_, pairs, locks, TARGET)
    worse = [r for r in broken if r["case"].name not in not_worse]
    no_worse = [r for r in broken if r["case"].name in not_worse]
    lines = [
        "## Forecast: a pilot's final validation loss against its 10x long run (bench_forecast)",
        "",
        f"{len(cases)} pilots of {PILOT_STEPS} updates and their long runs of {TARGET} (configs/smoke.yaml's "
        "model, "
        f"the built-in corpus, the mixture cases on it and the standard library's code, one thread each, two "
        f"at a time); {trained} run(s) trained by this invocation in {train_seconds:.0f} s, the others read "
        f"from {WORK} where earlier invocations trained them (the load beside those is not recorded): "
        f"{walls / 60:.1f} min of sessions' wall time in all (two ran at a time). Each pilot's cooldown "
        f"branches ({_branch_words()}) cost {sum(k for _, k in BRANCHES)} updates, "
        f"{sum(k for _, k in BRANCHES) / PILOT_STEPS:.2f}x the pilot's own; all "
        f"{sum(map(len, branches.values()))} took {_branch_wall(branches) / 60:.1f} min of sessions' wall "
        "time.",
        "",
        f"- coverage of the 90% interval: {inside} of {len(every_healthy)} healthy long runs inside"
        + (f", {unfit} refused a forecast (counted as not inside;" if unfit else " (")
        + f" goal >= 9 of 10: {_met(inside >= 0.9 * len(every_healthy))})",
        f"- median |relative error| of the final val loss: {100 * strict:.2f}%"
        + (
            f", a refused pilot counted as an infinite error ({100 * statistics.median(errors):.2f}% over "
            f"the {len(healthy)} given a forecast;"
            if unfit
            else " ("
        )
        + f" goal <= 1%: {_met(strict <= 0.01)})"
        if errors
        else "- no healthy run graded",
        f"- mean half-width of the interval: {100 * statistics.mean(halves):.2f}% (goal <= 2%: "
        f"{_met(statistics.mean(halves) <= 0.02)})"
        if halves
        else "",
        f"- watch's forecast alert on a healthy run: {false_alerts} of {len(every_healthy)} (goal 0: "
        f"{_met(false_alerts == 0)})",
        _flagged_line(broken, worse, no_worse, len(flagged)),
        f"- pilots refused (no forecast): {len(refused)}",
        "",
        "| case | predicted [90%] | measured | error | inside | half-width | left the band (watch) | watch's "
        "other "
        "alerts (first step) |",
        "|---|---|---|---|---|---|---|---|",
        *map(_row, rows),
        "",
        *_broken_table(broken, changes, not_worse),
        "",
        "The rise check (forecast.RISE_SHARE, from the pilot's last update on): the largest share each long "
        "run rose above the law refitted to the pilot's and its own evaluations before each, two "
        "evaluations in a row (the first of the two): "
        + "; ".join(
            f"{r['case'].name} {100 * r['rise'][0]:+.2f}% at {r['rise'][1]}" for r in rows if r["rise"]
        )
        + ". The same on each mixture source's own val loss (its own course: the lock's rise.by_source): "
        + "; ".join(
            f"{r['case'].name} {name} {100 * share:+.2f}% at {step}"
            for r in rows
            for name, (share, step) in r["source_rises"].items()
        )
        + ".",
        "",
        "Each candidate law fitted to the same healthy pilots (the measurement the default law is chosen "
        "by):",
        "",
        *_law_table(every_healthy),
        "",
        "The law chosen on half of those pilots (least median |error|, a refusal counted as infinite; of "
        "equal ones, the one refused least) and "
        "graded on the other half, both ways:",
        "",
        *_held_out(every_healthy),
        "",
        "How the fit weighs the pilot's evaluations (forecast.FIT_WEIGHTINGS: `log-updates` each by the span "
        "of log-updates it stands for, `log-updates-from-2x-warmup` the same from twice the warm-up on (at "
        "every 10 updates of these pilots the same points: a tie, of equal ones the first listed is chosen; "
        "the cadence check below tells them apart), `equal` each alike), over every healthy case, then "
        "chosen on half of them and graded on the other half, both ways:",
        "",
        *weighting_tables([r for r in rows if r["case"].broken is None]),
        "",
        "Each fit weighting's whole lock (forecast_record.lock_forecast with it: the interval and watch's "
        "band too), graded and watched as above over every case:",
        "",
        *whole_weighting_table(rows),
        "",
        "What the default law makes of each healthy pilot (forecast.HOLDOUT_SHARE's hold-out, the drift at "
        f"the default weight {default_weight():g}):",
        "",
        *diagnosis_table([r for r in rows if r["case"].broken is None]),
        "",
        "The 90% interval's weight on the drift the pilot measures on itself (forecast.DRIFT_WEIGHTS), over "
        "every healthy case (a pilot refused at a weight counts as not inside):",
        "",
        *weight_table([r for r in rows if r["case"].broken is None]),
        "",
        "The drift weight chosen on half of the healthy cases (the narrowest holding every one of the half "
        "inside) and graded on the other half, both ways:",
        "",
        *weight_held_out([r for r in rows if r["case"].broken is None]),
        "",
        *_anneal_lines(pairs, anneal),
        "",
        "The cadence check (benchmarks/forecast_cadence.py): each flat-LR pilot trained again evaluating "
        "every 5 and every 20 updates (the same seed, data, recipe and updates), its final forecast (the "
        "centre, its error against the long run, the 90% half-width) under the default fit weighting and "
        "under `log-updates` (the default before it, which fits from the first evaluation past the warm-up):",
        "",
        *cadence_table(flat),
        "",
        "The interval check (benchmarks/forecast_intervals.py): every healthy pilot at every 10 updates and "
        "trained again evaluating every 5, its 90% interval under each way the bootstrap's refits resample "
        "the fit's residuals (forecast.INTERVAL_METHODS: `residual-bootstrap` each drawn apart, the default "
        "before; `ar1-inflated` scaled by sqrt((1 + rho) / (1 - rho)), rho their lag-1 autocorrelation; "
        "`block-bootstrap` in runs of consecutive residuals n / n_eff long): how many long runs inside, the "
        "mean half-width of those given a forecast (without the drift term in brackets), a refusal counted "
        "as not inside; then the method chosen on one half (the most inside at both cadences, then the least "
        "narrowing from every 10 to every 5, then the narrowest) and graded on the other, both ways:",
        "",
        *interval_table(every_healthy),
        "",
        f"Command: `python -m benchmarks.run_all bench_forecast --update` (it trains what {WORK} lacks with "
        "benchmarks/forecast_runs.py, then grades; `python benchmarks/forecast_runs.py DIR` trains alone).",
        "",
        f"Broken on purpose on a resume at {int(0.1 * TARGET)} updates: `-lr_xK` the LR times K "
        "(`--allow-change "
        "optim.muon.lr --allow-change optim.adamw.lr`); `fp16-...-skips` an fp16 recipe whose loss scale "
        "then doubles "
        "after every good update (`--allow-change train.loss_scale_growth_interval`, set to 1), so that "
        "updates "
        "overflow and are skipped often (see its overflow count: skipped updates still read their batches, "
        "so the run reads more tokens per applied update); `mixture-...-drop_code` a mixture of the "
        "built-in corpus and "
        "the standard library's code (forecast_runs.prepare_mixture, 0.5 each) resumed with the code's "
        "weight at 0.001, no row of a batch (`--allow-change data.mixture.weights`). "
        + _mixture_note(pairs),
        "",
        mixture_sources_note(pairs),
        "",
        twin_line,
        "",
    ]
    return "\n".join(line for line in lines if line is not None) + "\n"


if __name__ == "__main__":
    print(run())
