"""bench_forecast's cadence check: the same flat-LR pilots (WSD and constant: the seed, data, recipe and
updates of forecast_runs' healthy cases) trained again evaluating every 5 and every 20 updates instead of
every 10, each forecast under the default fit weighting and under "log-updates" (the default before it). An
evaluation does not change training: each retrained pilot's train losses are checked bit for bit against the
stored pilot's, and its evaluations at the steps both made. docs/FORECAST.md says what it found. Split from
bench_forecast.py by size."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.forecast_runs import PILOT_STEPS, RECIPE, Case, _data_of, _pilot_dir, _sets, _train, prepare

CADENCES = (5, 10, 20)
STORED_EVERY = 10  # forecast_runs.PILOT_EVAL_EVERY: the benchmark's own pilots
FLAT = ("wsd", "constant")


def flat_cases(cases: list[Case]) -> list[Case]:
    return [c for c in cases if c.kind in FLAT and c.broken is None and not c.mixture]


def _cadence_dir(work: Path, case: Case, every: int) -> Path:
    return _pilot_dir(work, case) if every == STORED_EVERY else work / "runs" / f"{case.name}-pilot-e{every}"


def train_at(work: Path, data: Path, case: Case, every: int) -> Path:
    """The case's pilot evaluating every `every` updates (the stored pilot itself at STORED_EVERY)."""
    run_dir = _cadence_dir(work, case, every)
    if not (run_dir / "metrics.jsonl").is_file():
        args = ["--config", str(RECIPE), "--data", str(_data_of(work, data, case)), "--run-dir", str(run_dir)]
        _train([*args, *_sets(case, PILOT_STEPS, every)], work / f"{case.name}-pilot-e{every}.log")
    return run_dir


def generate_cadences(work: Path, cases: list[Case], workers: int = 2) -> dict[str, dict[int, Path]]:
    """Each flat-LR case's pilot at every cadence of CADENCES, two at a time."""
    data = prepare(work)
    jobs = [(c, every) for c in flat_cases(cases) for every in CADENCES]
    with ThreadPoolExecutor(workers) as pool:
        dirs = list(pool.map(lambda job: train_at(work, data, *job), jobs))
    out: dict[str, dict[int, Path]] = {}
    for (case, every), run_dir in zip(jobs, dirs, strict=True):
        out.setdefault(case.name, {})[every] = run_dir
    return out


def _train_losses(summary) -> list:
    return [(e["step"], e.get("loss")) for e in summary.kept_events if e.get("event") == "train"]


def measure(pilots: dict[int, Path], long: Path, target: int) -> dict:
    """Per cadence and weighting (the default, "log-updates") the final forecast against the long run's
    measured final: {"value", "error", "half", "half_no_drift", "inside"} or the refusal's reason; and
    whether every retrained pilot's train losses and shared evaluations equal the stored pilot's bit for
    bit."""
    from benchmarks.forecast_tables import with_and_without_drift
    from pilotrun.report.projection.forecast import DEFAULT_WEIGHTING
    from pilotrun.report.projection.forecast_record import val_points
    from pilotrun.report.record_check.summarize import summarize_run

    long_summary = summarize_run(long)
    measured = dict(val_points(long_summary.kept_events))[target]
    summaries = {every: summarize_run(path) for every, path in pilots.items()}
    stored = summaries[STORED_EVERY]
    stored_val = dict(val_points(stored.kept_events))
    same = all(
        _train_losses(s) == _train_losses(stored)
        and all(stored_val[k] == v for k, v in val_points(s.kept_events) if k in stored_val)
        for s in summaries.values()
    )
    by: dict = {}
    for every, summary in summaries.items():
        for weighting in (DEFAULT_WEIGHTING, "log-updates"):
            made = with_and_without_drift(summary, long_summary, target, weighting=weighting)
            final = made[None] if isinstance(made[None], str) else made[None]["final"]
            by[(every, weighting)] = (
                final
                if isinstance(final, str)
                else {
                    "value": final["value"],
                    "error": (final["value"] - measured) / measured,
                    "half": final["half_width_share"],
                    "half_no_drift": made[0.0]["final"]["half_width_share"],
                    "inside": final["low"] <= measured <= final["high"],
                }
            )
    return {"same": same, "by": by}


def _cell(got) -> str:
    if isinstance(got, str):
        return "refused" + (" (too few evaluations)" if "evaluation(s)" in got else "")
    return f"{got['value']:.4f} ({100 * got['error']:+.2f}%, +-{100 * got['half']:.2f}%)"


def _move(rows: list[dict], weighting: str, every: int) -> list[float]:
    """Each pilot's centre at `every` against its own at STORED_EVERY (a share), where both were given."""
    out = []
    for r in rows:
        got, base = r["cadence"]["by"][(every, weighting)], r["cadence"]["by"][(STORED_EVERY, weighting)]
        if not isinstance(got, str) and not isinstance(base, str):
            out.append(got["value"] / base["value"] - 1)
    return out


def cadence_table(rows: list[dict]) -> list[str]:
    """Each flat-LR pilot's final forecast at each cadence, under the default weighting and "log-updates",
    with the centre's move against every 10 and what it does to the half-width."""
    from pilotrun.report.projection.forecast import DEFAULT_WEIGHTING

    head = " | ".join(f"every {every}" for every in CADENCES)
    lines = [
        f"| pilot | fit weighting | {head} | centre at 5 against 10 |",
        "|---|---|" + "---|" * len(CADENCES) + "---|",
    ]
    for r in rows:
        for weighting in (DEFAULT_WEIGHTING, "log-updates"):
            by = r["cadence"]["by"]
            cells = " | ".join(_cell(by[(every, weighting)]) for every in CADENCES)
            move = _move([r], weighting, 5)
            lines.append(
                f"| {r['case'].name} | {weighting} | {cells} | "
                + (f"{100 * move[0]:+.2f}% |" if move else "- |")
            )
    lines.append("")
    for weighting in (DEFAULT_WEIGHTING, "log-updates"):
        moves = _move(rows, weighting, 5)
        halves = {
            every: [r["cadence"]["by"][(every, weighting)] for r in rows] for every in (5, STORED_EVERY)
        }
        given = {every: [g for g in got if not isinstance(g, str)] for every, got in halves.items()}
        inside = {every: sum(g["inside"] for g in got) for every, got in given.items()}

        def mean(values: list[float]) -> float:
            return 100 * sum(values) / len(values) if values else float("nan")

        lines.append(
            f"- `{weighting}`: the centre at every 5 against every 10 "
            + (f"{100 * min(moves):+.2f}% to {100 * max(moves):+.2f}%" if moves else "not compared")
            + f"; mean half-width every 10 {mean([g['half'] for g in given[STORED_EVERY]]):.2f}% "
            f"({mean([g['half_no_drift'] for g in given[STORED_EVERY]]):.2f}% without the drift), every 5 "
            f"{mean([g['half'] for g in given[5]]):.2f}% "
            f"({mean([g['half_no_drift'] for g in given[5]]):.2f}%); inside: every 10 "
            f"{inside[STORED_EVERY]}/{len(rows)}, every 5 {inside[5]}/{len(rows)}."
        )
    same = all(r["cadence"]["same"] for r in rows)
    lines.append(
        "- the retrained pilots' train losses, and their evaluations at the steps the stored pilots also "
        f"evaluated, {'equal theirs bit for bit' if same else 'DIFFER from theirs'} (an evaluation does not "
        "change training)."
    )
    return lines
