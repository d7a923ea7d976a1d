"""`pilotrun freeze`: judge a pilot and write its candidate's lock (the format lives in
pilotrun/run/recipe_lock.py).

After a GO (or with `--despite-no-go`, recorded in the lock) the lock holds:
- the effective recipe (run.json's, the one in force at the pilot's end) and the changes made on resume;
- the data identity (metadata_sha256), tokens per update;
- the code identity (git commit, dirty flag, diff hash) and software of the pilot's last kept session;
- the verdict: decision, statement, every rule with its figure, threshold and evidence, the thresholds;
- with `--target-steps N`: `projection`, what the pilot's measurements predict for a long run of N updates
  (training, checkpoint, evaluation, start-up, expected failures at `--mtbf`, Young's checkpoint interval,
  total wall time, device-hours and cost at `--device-hour-cost`), each part with the band the pilot's
  measured spread gives it and the total's band (pilotrun/report/projection/band.py), and `watch`, the pilot's
  figures `pilotrun watch --against LOCK` holds the long run to (pilotrun/report/projection/long_run.py), and
  `forecast`, the validation loss the long run will reach: a schedule-aware law fitted to the pilot's
  validation losses, its curve at the long run's evaluation steps, the final value with its 90% interval and
  what it assumes, or "no forecast: <why>" (pilotrun/report/projection/forecast_record.py);
- `tuning`, where `pilotrun tune` ran on the pilot before it was frozen: what its learning-rate and batch
  checks found (report/verdict/tuning.py);
- `sha256` over everything else, so the lock identifies itself.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

from pilotrun.common.files import canonical_sha256, refuse_link
from pilotrun.config import RECIPE_FORMAT, RECIPE_FORMAT_KEY, current_recipe
from pilotrun.report.projection.forecast_record import FORECAST_KEY, format_forecast, lock_forecast
from pilotrun.report.projection.long_run import project, watch_figures
from pilotrun.report.verdict.tuning import read_tune_result
from pilotrun.report.verdict.verdict import judge
from pilotrun.run.changes import recipe_changes_in_history
from pilotrun.run.recipe_lock import (
    LOCK_FORMAT,
    PROJECTION_KEY,
    WATCH_KEY,
    FreezeError,
    nonfinite_field,
    write_lock,
)
from pilotrun.run.record import json_safe


def check_projection_options(target_steps: int | None, mtbf_hours: float | None,
                             device_hour_cost: float | None) -> None:
    """Bad projection options are bad input, refused before anything is judged."""
    if target_steps is not None and target_steps < 1:
        raise FreezeError(f"--target-steps {target_steps}: must be a positive number of updates")
    for flag, value in (("--mtbf", mtbf_hours), ("--device-hour-cost", device_hour_cost)):
        if value is not None and (not math.isfinite(value) or value <= 0):
            raise FreezeError(f"{flag} {value}: must be a positive finite number")
    if target_steps is None and (mtbf_hours is not None or device_hour_cost is not None):
        raise FreezeError(
            "--mtbf and --device-hour-cost need --target-steps (they price a projected long run)"
        )


def build_lock(
    verdict: Any,
    despite_no_go: bool,
    target_steps: int | None = None,
    mtbf_hours: float | None = None,
    device_hour_cost: float | None = None,
) -> dict[str, Any]:
    """The lock of a judged pilot (a `pilotrun.report.verdict.verdict.Verdict`), its `sha256` included; with
    `target_steps`, its projection and the figures watch needs."""
    summary = verdict.summary
    run = summary.run
    sessions = {str(s.get("session_id")): s for s in run.get("sessions") or [] if isinstance(s, dict)}
    last = sessions.get(summary.lineage[-1], {}) if summary.lineage else {}
    recipe = current_recipe(run.get("recipe"))  # in today's names, whatever format the pilot recorded
    data = run.get("data") or {}
    hardware = last.get("hardware") or {}
    lock: dict[str, Any] = {
        "format": LOCK_FORMAT,
        "pilot": {
            "run_id": run.get("run_id"),
            "run_dir": str(Path(summary.run_dir).resolve()),
            "final_step": summary.overall.get("updates_applied"),
            "tokens_seen": summary.overall.get("tokens_seen"),
        },
        "decision": verdict.decision,
        "despite_no_go": bool(despite_no_go and verdict.decision != "GO"),
        "recipe": recipe,
        RECIPE_FORMAT_KEY: RECIPE_FORMAT,
        "recipe_sha256": canonical_sha256(recipe),
        "recipe_changes": [dataclasses.asdict(c) for c in recipe_changes_in_history(run, summary.lineage)],
        "tokens_per_update": run.get("tokens_per_update"),
        "data": {
            "metadata_sha256": (data.get("train") or {}).get("metadata_sha256"),
            "source": data.get("source"),
            "tokenizer": data.get("tokenizer"),
            "train_tokens": (data.get("train") or {}).get("tokens"),
            # A mixture's sources (each metadata_sha256), weights and schedule seed: a folder's lock has
            # none.
            **({key: data[key] for key in ("sources", "mixture")} if data.get("mixture") else {}),
        },
        "code": last.get("git"),
        "software": last.get("software"),
        "hardware": {k: hardware.get(k) for k in ("device", "device_name", "world_size")},
        "verdict": {
            "decision": verdict.decision,
            "statement": verdict.statement,
            "rules": [dataclasses.asdict(r) for r in verdict.rules],
            "thresholds": dataclasses.asdict(verdict.thresholds),
        },
    }
    # The watcher's figures are the pilot's own, whether or not a long run's length is projected.
    lock[WATCH_KEY] = watch_figures(summary, lock["verdict"]["thresholds"])
    tuning = tuning_of(summary.run_dir, summary.run.get("run_id"))
    if tuning is not None:
        lock[TUNING_KEY] = tuning
    if target_steps is not None:
        options = (
            f"--target-steps {target_steps}"
            + (f" --mtbf {mtbf_hours}" if mtbf_hours is not None else "")
            + (f" --device-hour-cost {device_hour_cost}" if device_hour_cost is not None else "")
        )
        try:
            lock[PROJECTION_KEY] = project(summary, target_steps, mtbf_hours, device_hour_cost)
        except (OverflowError, ZeroDivisionError):
            raise FreezeError(f"{options}: the projection is out of a float's range (a figure overflows); "
                              "give a smaller --target-steps or a larger --mtbf") from None
        lock[FORECAST_KEY] = lock_forecast(summary, target_steps)
        where = nonfinite_field(lock[PROJECTION_KEY], PROJECTION_KEY)
        if where is not None:
            raise FreezeError(f"{options}: the projection's {where} is not a finite number (out of a float's "
                              "range); give values nearer a real long run (fewer updates, a longer MTBF)")
    where = nonfinite_field(lock)
    if where is not None:  # the pilot's figures enter only where finite: one that did not is a bug
        raise FreezeError(
            f"{summary.run_dir}: the lock's {where} is NaN or infinite, which a lock (strict JSON) cannot "
            "hold (a figure pilotrun should have kept finite: a bug); nothing written"
        )
    lock["sha256"] = canonical_sha256(lock)
    return lock


def freeze_run(run_dir: str | Path, out: str | Path, despite_no_go: bool = False,
               thresholds: Any = None, target_steps: int | None = None, mtbf_hours: float | None = None,
               device_hour_cost: float | None = None) -> tuple[int, dict[str, Any], Any]:
    """Judge the pilot and write its lock: (0, lock, verdict) written; (1, lock, verdict) NO-GO without
    `despite_no_go`, nothing written. An existing --out is refused before anything is judged."""
    out = Path(out)
    check_projection_options(target_steps, mtbf_hours, device_hour_cost)
    refuse_link(out)  # a dangling link would otherwise pass the exists() check below
    if out.exists():
        raise FreezeError(f"--out {out}: already exists; a lock is never overwritten (choose another path)")
    if not out.parent.is_dir():
        raise FreezeError(f"--out {out}: folder {out.parent} does not exist")
    verdict = judge(run_dir, thresholds)
    if verdict.provisional:
        running = verdict.summary.overall["running"]
        raise FreezeError(
            f"{run_dir}: the run is still going (pid {running.get('pid')} on host {running.get('host')}); "
            "a lock freezes a finished pilot: wait for it to end"
        )
    if verdict.summary.run.get("recipe") is None:
        raise FreezeError(f"{run_dir}: run.json has no recipe to freeze")
    lock = build_lock(verdict, despite_no_go, target_steps, mtbf_hours, device_hour_cost)
    if verdict.decision != "GO" and not despite_no_go:
        return 1, lock, verdict
    for line in write_lock(out, lock):
        print(f"pilotrun: {line}", file=sys.stderr)
    return 0, lock, verdict


def format_projection(projection: dict[str, Any]) -> list[str]:
    """The projection as printed by `pilotrun freeze`, one figure a line with where it comes from."""
    if "unavailable" in projection:
        return [f"projection: {projection['unavailable']}"]
    lines = [f"projection for {projection['target_steps']} updates ({projection['tokens']} tokens):"]
    for key in ("training", "checkpoint", "evaluation", "startup", "overhead", "failures", "total_wall"):
        if key in projection:
            part = projection[key]
            band = part.get("band")
            spread = (
                f"; band {band[0]:.4g}-{band[1]:.4g} s" if isinstance(band, list) and len(band) == 2 else ""
            )
            lines.append(
                f"  {key}: {part['seconds'] / 3600:.4g} h ({part['seconds']:.1f} s{spread}) from "
                f"{part['from']}" + (f"; band: {part['band_from']}" if part.get("band_from") else "")
            )
    if "checkpoint_interval" in projection:
        c = projection["checkpoint_interval"]
        lines.append(f"  checkpoint interval minimising expected loss: {c['young_seconds']:.1f} s = "
                     f"{c['young_updates']:.0f} updates ({c['from']}); the recipe checkpoints "
                     + (f"every {c['recipe_updates']} updates" if c["recipe_updates"] else "only at the end"))
    lines.append(
        f"  device-hours: {projection['device_hours']['value']:.4g} ({projection['device_hours']['from']})"
    )
    if "cost" in projection:
        lines.append(f"  cost: {projection['cost']['value']:.2f} ({projection['cost']['from']})")
    lines.append(f"  goodput: {projection['goodput']['value']:.3f} ({projection['goodput']['from']})")
    return lines


TUNING_KEY = "tuning"


def tuning_of(run_dir: str | Path, run_id: Any) -> dict[str, Any] | None:
    """What `pilotrun tune` found on this pilot (RUN/tune/tune.json of the same run_id), as the lock keeps it:
    each check's finding and figures, without the branches (their folders hold them); None where no check
    ran."""
    result = read_tune_result(run_dir)
    if result is None or result.get("run_id") != run_id:
        return None
    keys = {"lr": ("best_factor", "within_one_step", "direction", "gain", "sensitivity", "from_steps",
                   "line"),
            "batch": ("critical", "band", "direction", "from_steps", "line")}
    kept: dict[str, Any] = {"updates": result.get("updates"), "yardstick": result.get("yardstick")}
    for check, names in keys.items():
        if isinstance(result.get(check), dict):
            kept[check] = {name: result[check].get(name) for name in names}
    return json_safe(kept)  # a loss that did not stay finite is kept by its name ("Infinity")


def forecast_lines(lock: dict[str, Any]) -> list[str]:
    """The lock's forecast as `pilotrun freeze` prints it below the projection (none without
    --target-steps)."""
    return [format_forecast(lock[FORECAST_KEY])] if isinstance(lock.get(FORECAST_KEY), dict) else []
