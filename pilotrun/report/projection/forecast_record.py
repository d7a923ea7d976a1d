"""The forecast between the records: built from a pilot's summary for the lock, held against a long run's
record.

- `lock_forecast(summary, target_steps)`: the lock's `forecast` section (forecast.py fits; this module says
  what it is fitted on and what it assumes): the pilot's validation losses, its schedule, and the long run's:
  the same schedule kind, warm-up and floor over a horizon of the target steps, evaluated at the recipe's
  cadence. A pilot that gives none gets {"unavailable": "no forecast: <why>"}, never a number.
- `not_applicable(forecast, lock_recipe, lock_data, run)`: what of the long run differs from what the forecast
  assumes (width, data, schedule family or horizon, recipe), each named; a change on resume is not such a
  difference: the run is still held to the forecast (a change that hurts shows in the band or the rise), and
  the change is said on its own (forecast_changes.py: watch's alert, the grade's `changes`).
- `at_step(forecast, step)`: the predicted value, the 90% interval and the watch's band at a step (linear
  between the curve's evaluation steps).
- `grade(forecast, points, ...)`: predicted against measured, for summarize and the benchmark.
"""

from __future__ import annotations

import math
from typing import Any

from pilotrun.config import current_key, current_recipe, flatten, recorded_value
from pilotrun.report.projection.forecast import (
    RISE_SHARE,
    SCHEDULE_FIELDS,
    NoForecast,
    Setting,
    TooNoisy,
    fit_points,
    forecast,
    refitted_at,
)
from pilotrun.report.projection.forecast_changes import IGNORED, as_dicts, describe_changes, forecast_changes
from pilotrun.report.record_check.mixture_account import format_source_passes, projected_passes_by_source
from pilotrun.run.recipe_lock import FORECAST_KEY, lock_forecast_of
from pilotrun.run.record import is_finite_number

__all__ = [
    "FORECAST_KEY",
    "NoForecast",
    "RISE_SHARE",
    "branch_input",
    "lock_forecast",
    "not_applicable",
    "risen",
    "grade",
    "format_grade",
    "format_forecast",
]
MAX_CURVE_POINTS = 400  # a longer run's evaluation steps are thinned evenly (the final one always kept)
# The farthest a forecast reaches: the 10-30x horizons; measured here at 10x (docs/FORECAST.md).
# Beyond it a floor-free power law keeps falling and the number would be the law's, not the pilot's.
MAX_HORIZON_FACTOR = 30
# How long the band must be left before watch alerts: this many evaluations in a row outside it.
CONSECUTIVE = 2
# The named warm-up: the band is held from this many times the pilot's updates on. Just past the pilot's reach
# the long run's LR is still high where the pilot's had decayed, and the fit says least about that stretch:
# measured on the benchmark's healthy runs, their loss sat up to 5% above the law until about twice the
# pilot's updates.
WATCH_FROM_PILOT_FACTOR = 2.0


def val_points(events: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [
        (int(e["step"]), float(e["loss"]))
        for e in events
        if e.get("event") == "val" and is_finite_number(e.get("loss")) and isinstance(e.get("step"), int)
    ]


def val_points_by_source(events: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Each mixture source's own validation loss (the val events' `loss_by_source`), by source; {} for a run
    of one folder (or a mixture of one source: its loss is the run's)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for e in events:
        by_source = e.get("loss_by_source")
        if e.get("event") != "val" or not isinstance(by_source, dict) or not isinstance(e.get("step"), int):
            continue
        for name, loss in by_source.items():
            if is_finite_number(loss):
                out.setdefault(str(name), []).append((int(e["step"]), float(loss)))
    return out if len(out) > 1 else {}


def _positive(every: Any) -> int | None:
    return every if isinstance(every, int) and every > 0 else None


def eval_steps(every: int | None, target_steps: int) -> list[int]:
    steps = list(range(every, target_steps + 1, every)) if every else []
    if len(steps) > MAX_CURVE_POINTS:
        stride = math.ceil(len(steps) / MAX_CURVE_POINTS)
        steps = steps[::stride]
    return [s for s in steps if s < target_steps] + [target_steps]


def lock_forecast(
    summary: Any, target_steps: int, weighting: str | None = None, interval: str | None = None
) -> dict[str, Any]:
    """The lock's `forecast` section for a long run of `target_steps` updates (module docstring), from a
    pilot's summary (report/record_check/summarize.py's Summary: its run.json, kept events and final
    counters). `weighting`: how the fit weighs the pilot's evaluations (forecast.FIT_WEIGHTINGS; the default's
    when None: the benchmark sets it to compare them whole, as graded and watched). `interval`: how the
    bootstrap resamples the residuals (forecast.INTERVAL_METHODS; the default's when None)."""
    run = summary.run
    recipe = run.get("recipe") or {}
    schedule = {k: ((recipe.get("optim") or {}).get("schedule") or {}).get(k) for k in SCHEDULE_FIELDS}
    tpu, train_tokens = (
        run.get("tokens_per_update"),
        ((run.get("data") or {}).get("train") or {}).get("tokens"),
    )
    pilot_steps = int(summary.final.step)
    target_schedule = {**schedule, "horizon": target_steps}
    tokens = target_steps * tpu if isinstance(tpu, int) else None
    assumes = {
        "width_data_recipe": "the lock's model, data (metadata_sha256) and recipe; only the length, the "
        "cadences, the machine and the seed may differ",
        "schedule": target_schedule,
        "target_steps": target_steps,
        "pilot_steps": pilot_steps,
        "horizon_factor": target_steps / pilot_steps if pilot_steps else None,
        "tokens": tokens,
        "extrapolated_tokens": (target_steps - pilot_steps) * tpu if isinstance(tpu, int) else None,
        "passes_over_train_split": tokens / train_tokens if tokens and train_tokens else None,
        # a mixture: each source over its own split at the weights (pooled, a small source's re-reads hide)
        "passes_by_source": projected_passes_by_source(run, tokens),
        "ignored_keys": list(IGNORED),
    }
    if target_steps <= pilot_steps:
        return {
            "unavailable": f"no forecast: --target-steps {target_steps} is not beyond the pilot's "
            f"{pilot_steps} updates (its own losses say it)",
            "assumes": assumes,
        }
    if target_steps > MAX_HORIZON_FACTOR * pilot_steps:
        return {
            "unavailable": f"no forecast: --target-steps {target_steps} is "
            f"{target_steps / pilot_steps:.0f}x the "
            f"pilot's {pilot_steps} updates, beyond the {MAX_HORIZON_FACTOR}x a forecast reaches "
            "(run a longer pilot)",
            "assumes": assumes,
        }
    pilot = Setting(schedule, max(pilot_steps, 1), tpu, train_tokens)
    try:
        made = forecast(
            val_points(summary.kept_events),
            pilot,
            Setting(target_schedule, target_steps, tpu, train_tokens),
            eval_steps(_positive(recorded_value(recipe, "train.eval.every")), target_steps),
            weighting=weighting,
            interval=interval,
        )
    except TooNoisy as why:
        # No number, but the rise check still holds: its refit takes the run's own evaluations too, which
        # pin down what the pilot's noisy few cannot. It refits from the pilot's points it carries.
        rise = _rise(summary, schedule, pilot_steps, tpu, train_tokens)
        kept_x, kept_y = fit_points(val_points(summary.kept_events), pilot)
        rise["points"] = [[int(s), float(v)] for s, v in zip(kept_x, kept_y, strict=True)]
        return {"unavailable": f"no forecast: {why}", "assumes": assumes, "rise": rise}
    except NoForecast as why:
        return {"unavailable": f"no forecast: {why}", "assumes": assumes}
    return {**made, "assumes": assumes, "rise": _rise(summary, schedule, pilot_steps, tpu, train_tokens)}


def _rise(summary: Any, schedule: dict[str, Any], pilot_steps: int, tpu: Any, train_tokens: Any) -> dict:
    """The lock's rise check: what risen() refits the law with (the pilot's schedule, reach and tokens)."""
    return {
        "share": RISE_SHARE,
        "from_step": pilot_steps,
        "pilot_schedule": schedule,
        "tokens_per_update": tpu,
        "train_tokens": train_tokens,
        # a mixture: each source's own evaluations past the warm-up, which its own course is refitted from
        # (the mean watch reads is under the weights in force, and falls when a hard source is dropped)
        "by_source": {
            name: [[s, v] for s, v in points if s > int(schedule.get("warmup_steps") or 0)]
            for name, points in val_points_by_source(summary.kept_events).items()
        },
    }


def branch_input(pilot: Any, branch: Any) -> tuple[list[tuple[int, float]], Setting]:
    """A cooldown branch's fit input (forecast()'s `branches`), from the pilot's summary and the branch's: the
    branch is the pilot's run (the same run_id) resumed in its own folder from one of the pilot's checkpoints
    (its last session's resumed_from) with another schedule; NoForecast where it is not one."""
    prun, brun = pilot.run, branch.run
    sessions = brun.get("sessions") or []
    at = sessions[-1].get("resumed_from") if sessions else None
    if brun.get("run_id") != prun.get("run_id") or not isinstance(at, int):
        raise NoForecast(
            f"the branch (run {brun.get('run_id')}) is not a resume of the pilot's run {prun.get('run_id')} "
            "from one of its checkpoints"
        )
    if at >= int(pilot.final.step) or int(branch.final.step) <= at:
        raise NoForecast(f"the branch from step {at} adds no update inside the pilot's {pilot.final.step}")
    schedules = [
        {k: ((r.get("recipe") or {}).get("optim") or {}).get("schedule", {}).get(k) for k in SCHEDULE_FIELDS}
        for r in (prun, brun)
    ]
    tpu, tokens = prun.get("tokens_per_update"), ((prun.get("data") or {}).get("train") or {}).get("tokens")
    setting = Setting(schedules[0], int(branch.final.step), tpu, tokens, then=(at, schedules[1]))
    return val_points(branch.kept_events), setting


# The verdict and the pilot's report state the forecast for a long run this many times the pilot (the same
# schedule kind over its own horizon): the verdict knows no target; `freeze --target-steps N` writes the one
# for N.
VERDICT_HORIZON_FACTOR = 10


def pilot_forecast(summary: Any) -> dict[str, Any]:
    """The forecast the verdict states as evidence (never a rule): for VERDICT_HORIZON_FACTOR x the pilot's
    updates."""
    steps = int(summary.final.step)
    if steps <= 0:
        return {"unavailable": "no forecast: the pilot applied no update"}
    return lock_forecast(summary, VERDICT_HORIZON_FACTOR * steps)


# ---------------------------------------------------------------------------------------------- against a run
def start_recipe(run: dict[str, Any]) -> dict[str, Any]:
    """The run's recipe as its first session had it (flattened, in today's key names): changes on resume
    undone."""
    flat = flatten(current_recipe(run.get("recipe") or {}))
    firsts: dict[str, Any] = {}
    for kind in ("allowed_changes", "free_changes"):
        for entry in run.get(kind) or []:
            key = current_key(str(entry.get("key"))) if isinstance(entry, dict) else None
            if key is not None and key not in firsts:
                firsts[key] = entry.get("old")
    # Only recipe keys: a change allowed beyond the recipe (a mixture's weights, the data's identity) has no
    # key in it, and undone into it would read as a key the lock's recipe lacks
    return {**flat, **{k: v for k, v in firsts.items() if k in flat}}


def _named(key: str) -> str:
    if key.startswith("model."):
        return f"width/model {key}"
    if key == "optim.schedule.kind":
        return f"schedule family {key}"
    return f"recipe {key}"


def not_applicable(
    fc: dict[str, Any], lock_recipe: dict[str, Any], lock_data_sha256: Any, run: dict[str, Any]
) -> list[str]:
    """What of `run` differs from what the forecast assumed, each named with both values; [] where it
    applies."""
    frozen, now = flatten(current_recipe(lock_recipe or {})), start_recipe(run)
    differs = [
        f"{_named(k)} (lock {frozen.get(k)!r}, run {now.get(k)!r})"
        for k in sorted(set(frozen) | set(now))
        if frozen.get(k) != now.get(k) and k not in IGNORED
    ]
    data = ((run.get("data") or {}).get("train") or {}).get("metadata_sha256")
    if lock_data_sha256 is not None and data != lock_data_sha256:
        differs.append(f"data metadata_sha256 (lock {str(lock_data_sha256)[:12]}, run {str(data)[:12]})")
    horizon, target = now.get("optim.schedule.horizon"), ((fc.get("assumes") or {}).get("target_steps"))
    if isinstance(target, int) and horizon != target:
        differs.append(f"schedule horizon optim.schedule.horizon (forecast for {target}, run {horizon!r})")
    return differs


def at_step(fc: dict[str, Any], step: int) -> dict[str, float] | None:
    """The curve at `step` (linear between its steps); None outside it."""
    curve, names = fc.get("curve") or [], fc.get("curve_columns") or []
    if not curve or step > curve[-1][0]:
        return None
    before = [row for row in curve if row[0] <= step]
    after = next(row for row in curve if row[0] >= step)
    if not before:
        return None  # before the curve's first evaluation step
    low = before[-1]
    share = 0.0 if after[0] == low[0] else (step - low[0]) / (after[0] - low[0])
    return {name: a + (b - a) * share for name, a, b in zip(names[1:], low[1:], after[1:], strict=True)}


def outside(fc: dict[str, Any], step: int, loss: float) -> str | None:
    """ "above" / "below" where the loss is outside the band at `step` past the warm-up (watch_from), else
    None."""
    row = at_step(fc, step)
    if row is None or step < watch_from(fc):
        return None
    return "above" if loss > row["band_high"] else "below" if loss < row["band_low"] else None


def watch_from(fc: dict[str, Any]) -> float:
    """The first step the band is held at: WATCH_FROM_PILOT_FACTOR x the pilot's updates (its reach)."""
    return WATCH_FROM_PILOT_FACTOR * ((fc.get("assumes") or {}).get("pilot_steps") or 0)


def risen(
    fc: dict[str, Any], own: list[tuple[int, float]], step: int, loss: float
) -> dict[str, float] | None:
    """{"predicted", "bound"} where the loss at `step`, past the pilot's reach, is more than the lock's rise
    share above the law refitted to the pilot's points and the run's own evaluations before it (`own`: the
    run's (step, loss) so far); None where it is not, or the lock has no rise check (a lock from before
    it)."""
    rise, assumes = fc.get("rise"), fc.get("assumes") or {}
    if not isinstance(rise, dict) or step <= int(rise.get("from_step") or 0):
        return None
    target = int(assumes.get("target_steps") or 0)
    if step > target:
        return None
    tpu, tokens = rise.get("tokens_per_update"), rise.get("train_tokens")
    pilot = Setting(rise["pilot_schedule"], int(rise["from_step"]), tpu, tokens)
    run = Setting(assumes.get("schedule") or {}, target, tpu, tokens)
    # the forecast's fitted points; a lock refused a forecast as too noisy carries them in its rise check
    fitted = (fc.get("fitted_on") or {}).get("points") or rise.get("points") or []
    points = [(int(s), float(v)) for s, v in fitted]
    predicted = refitted_at(fc.get("law") or "area", points, pilot, own, run, step)
    if predicted is None or loss <= predicted * (1 + float(rise["share"])):
        return None
    return {"predicted": predicted, "bound": predicted * (1 + float(rise["share"]))}


def source_risen(
    fc: dict[str, Any], own: dict[str, list[tuple[int, float]]], step: int, losses: dict[str, float]
) -> dict[str, Any] | None:
    """risen()'s check on each mixture source's own validation loss (`losses` at `step`; `own`: each source's
    evaluations before it) against the law refitted to the pilot's evaluations of that source and the run's:
    the source that rose most past the share ({"source", "loss", "predicted", "bound"}), or None (also for a
    lock written before the per-source check, or a run of one folder)."""
    rise = fc.get("rise")
    if not isinstance(rise, dict) or not isinstance(rise.get("by_source"), dict):
        return None
    worst = None
    for name, pilot_points in rise["by_source"].items():
        loss = losses.get(name)
        if not is_finite_number(loss) or len(pilot_points) < 2:
            continue
        got = risen({**fc, "fitted_on": {"points": pilot_points}}, own.get(name, []), step, float(loss))
        if got is None:
            continue
        if worst is None or loss / got["predicted"] > worst["loss"] / worst["predicted"]:
            worst = {"source": name, "loss": float(loss), **got}
    return worst


def left_band_at(
    fc: dict[str, Any],
    points: list[tuple[int, float]],
    by_source: dict[str, list[tuple[int, float]]] | None = None,
) -> int | None:
    """The first step of CONSECUTIVE evaluations in a row outside the band or risen above the run's own
    refitted curve (the mean's or a mixture source's own: `by_source`), or None."""
    by_source = by_source or {}
    run_of = 0
    for i, (step, loss) in enumerate(points):
        losses = {name: v for name, pts in by_source.items() for s, v in pts if s == step}
        before = {name: [(s, v) for s, v in pts if s < step] for name, pts in by_source.items()}
        out = (
            outside(fc, step, loss)
            or risen(fc, points[:i], step, loss)
            or source_risen(fc, before, step, losses)
        )
        run_of = run_of + 1 if out else 0
        if run_of >= CONSECUTIVE:
            return points[i - CONSECUTIVE + 1][0]
    return None


def grade(
    fc: dict[str, Any],
    points: list[tuple[int, float]],
    tokens_per_update: Any = None,
    by_source: dict[str, list[tuple[int, float]]] | None = None,
) -> dict[str, Any]:
    """Predicted against measured: the final value where the run reached the forecast's final step, the
    relative
    error, inside/outside the 90% interval, and where the band was first left (step and share of the
    updates)."""
    final = fc["final"]
    measured = next((loss for step, loss in reversed(points) if step == final["step"]), None)
    left = left_band_at(fc, points, by_source)
    out: dict[str, Any] = {
        "predicted": final["value"],
        "low": final["low"],
        "high": final["high"],
        "level": final["level"],
        "final_step": final["step"],
        "measured": measured,
        "left_band_at": left,
        "law": fc.get("law"),
        "left_share": left / final["step"] if left is not None else None,
        "last_step": points[-1][0] if points else None,
    }
    if measured is not None:
        out.update(
            error=(final["value"] - measured) / measured, inside=final["low"] <= measured <= final["high"]
        )
    return out


def format_grade(
    graded: dict[str, Any] | None, differs: list[str] | None = None, unavailable: str | None = None
) -> str | None:
    """summarize's line about the forecast."""
    if unavailable:
        return f"forecast: the lock has {unavailable}"
    if differs:
        return f"forecast: does not apply to this run: {'; '.join(differs)}"
    if graded is None:
        return None
    head = (
        f"forecast ({graded['law']}): final val loss at step {graded['final_step']} predicted "
        f"{graded['predicted']:.4f} ({graded['level']:.0%} interval {graded['low']:.4f}-{graded['high']:.4f})"
    )
    if graded["measured"] is None:
        head += f"; not reached yet (last evaluation at step {graded['last_step']})"
    else:
        head += (
            f", measured {graded['measured']:.4f}: error {100 * graded['error']:+.2f}% "
            f"({'inside' if graded['inside'] else 'OUTSIDE'} the interval)"
        )
    if graded["left_band_at"] is not None:
        head += (
            f"; left the band at step {graded['left_band_at']} ({graded['left_share']:.0%} of the forecast's "
            "updates)"
        )
    head += "" if graded["left_band_at"] is not None else "; never left the band"
    if graded.get("changes"):
        head += (
            f"; graded as of a changed recipe: {describe_changes(graded['changes'])} (on resume; the "
            f"forecast assumed the lock's recipe, so from update {graded['changes'][0]['from_update']} it is "
            "a reference, not a prediction)"
        )
    return head


def format_forecast(fc: dict[str, Any]) -> str:
    """The lock's forecast in one line, as freeze prints it and the report shows it."""
    if "unavailable" in fc:
        held = (
            f"; watch still holds the long run to its own course (a rise of more than "
            f"{float(fc['rise']['share']):.1%} above the law refitted to the pilot's and the run's "
            "evaluations)"
            if isinstance(fc.get("rise"), dict)
            else ""
        )
        return f"forecast: {fc['unavailable']}{held}"
    final, assumes = fc["final"], fc.get("assumes") or {}
    passes, by_source = assumes.get("passes_over_train_split"), assumes.get("passes_by_source")
    passes_text = (f", passes over each source's training split {format_source_passes(by_source)}"
                   if by_source else f", {passes:.3g} passes over the training split" if passes else "")
    return (
        f"forecast ({fc['law']}: {fc['formula']}): val loss {final['value']:.4f} at step {final['step']} "
        f"({final['level']:.0%} interval {final['low']:.4f}-{final['high']:.4f}, +-"
        f"{100 * final['half_width_share']:.2f}%), fitted on the pilot's {len(fc['fitted_on']['points'])} "
        f"evaluations to step {assumes.get('pilot_steps')} ({assumes.get('horizon_factor', 0):.3g}x beyond)"
        + passes_text
        + f"; assumes the {assumes.get('schedule', {}).get('kind')} schedule over {final['step']} updates "
        + "and "
        f"{assumes.get('width_data_recipe')}"
    )


def against(
    fc: dict[str, Any] | None,
    lock_recipe: Any,
    lock_data_sha256: Any,
    run: dict[str, Any],
    events: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """The forecast held against a run's record: {"unavailable"}, {"not_applicable": [...]} or grade()'s."""
    if not isinstance(fc, dict):
        return None
    if "unavailable" in fc:
        return {"unavailable": fc["unavailable"]}
    differs = not_applicable(fc, lock_recipe if isinstance(lock_recipe, dict) else {}, lock_data_sha256, run)
    if differs:
        return {"not_applicable": differs}
    graded = grade(fc, val_points(events), by_source=val_points_by_source(events))
    # graded as today, and read as of the recipe in force: the changes on resume that left its assumptions
    sessions = list(dict.fromkeys(str(e.get("session_id")) for e in events))
    graded["changes"] = as_dicts(forecast_changes(run, sessions))
    return graded


def against_own_lock(run: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """summarize's: the forecast of the lock the run was started from (None for a run not started frozen, or
    from
    a lock without one: a lock from before forecasts is read as before)."""
    frozen = run.get("frozen") if isinstance(run.get("frozen"), dict) else {}
    return against(
        lock_forecast_of(run), frozen.get("lock_recipe"), frozen.get("lock_data_metadata_sha256"), run, events
    )


def describe_against(result: dict[str, Any] | None) -> str | None:
    if result is None:
        return None
    if "unavailable" in result or "not_applicable" in result:
        return format_grade(None, result.get("not_applicable"), result.get("unavailable"))
    return format_grade(result)
