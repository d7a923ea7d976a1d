"""What the pilot's own measurements predict for a long run, and the pilot's figures a watcher holds it to.

`pilotrun freeze --target-steps N [--mtbf HOURS] [--device-hour-cost X]` writes two sections into the lock:

`projection`: a long run of N updates of the frozen recipe on the pilot's hardware, each figure with the
measurement it comes from (`from`):
- training: N x tokens_per_update / the median training-only tokens/s of the pilot's steady windows (each
  session's first window is warm-up and every profiled window is slower, both left out), with a band from the
  10th and 90th percentile windows;
- checkpoint and evaluation: the pilot's median seconds per save / per evaluation times how many the recipe's
  cadences give over N updates (a checkpoint also at the last update, as the checkpointer saves); a save costs
  what it blocked the loop (`blocking_seconds`): a background save's write beside training is not lost time,
  but a failure loses the one in flight, so it is added to each failure's redone work;
- start-up and bookkeeping: the pilot's median start-up per session (ledger.py), and its report + other
  seconds per update attempted;
- failures, with --mtbf: the expected number of failures over the failure-free time, each costing on average
  half a checkpoint interval of work redone plus a start-up (first order: failures are rare within one
  interval). The checkpoint interval that minimises the expected loss is Young's, sqrt(2 x C x MTBF) for a
  (blocking) checkpoint cost C (J. W. Young, "A first order approximation to the optimum checkpoint interval",
  1974); Daly's higher-order estimate sqrt(2 C M) - C (J. T. Daly, "A higher order estimate of the optimum
  checkpoint interval for restart dumps", 2006) is given beside it. Dead time between sessions (how soon
  someone or something restarts a failed run) is not measured by a pilot and not projected;
- total wall time, device-hours (x world_size) and, with --device-hour-cost, the cost; the projected goodput
  (training / total) and wall-clock tokens/s;
- every part's `band` [low, high] and `band_from`: the spread the pilot measured of it (start-up across
  sessions, each save's and evaluation's seconds, window-to-window tokens/s at the pilot's CPU share), and the
  total's band as the sum of the parts' lows .. highs (band.py states the rules).

`watch`: the pilot's throughput band, loss envelope, skip and clip bounds and window interval (alerts.py).
"""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING, Any

from pilotrun.config import recorded_value
from pilotrun.report.projection.band import (
    cpu_share_band,
    host_spread,
    measured_spread,
    percentile,
    steady_windows,
    total_band,
    window_cpu_share,
)
from pilotrun.report.projection.ledger import time_ledger
from pilotrun.report.record_check.time_split import window_train_tokens
from pilotrun.report.verdict.downstream import pilot_figures
from pilotrun.run.record import is_finite_number
from pilotrun.training.spikes.bound import step_spread

if TYPE_CHECKING:
    from pilotrun.report.record_check.summarize import Summary

# A long-run window slower than the pilot's slowest steady window by more than this share is below its band.
THROUGHPUT_MARGIN = 0.2
# The loss envelope: the pilot's loss at that step plus this many of its window-to-window noise (robust sigma)
# and this share of the loss itself, whichever is larger.
LOSS_ENVELOPE_SIGMAS = 6.0
LOSS_ENVELOPE_SHARE = 0.05


def window_tokens_per_s(event: dict[str, Any]) -> float | None:
    window = event["window"]
    tokens = window_train_tokens(window)
    return tokens / window["train_seconds"] if tokens is not None and window.get("train_seconds") else None


def window_tokens_per_device_second(event: dict[str, Any], world_size: int) -> float | None:
    """Training-only tokens per device second (CUDA): the window's tokens over its device seconds (CUDA timing
    events around each training update, rank 0's) times the devices. Host stalls (a slow data loader, a busy
    CPU) do not enter it, and a long run on more devices is held to the pilot's per-device speed. None where
    the window has no device time (a CPU run)."""
    window = event["window"]
    tokens, device = window_train_tokens(window), window.get("device_seconds")
    if tokens is None or not is_finite_number(device) or device <= 0 or world_size < 1:
        return None
    return tokens / (device * world_size)


def session_world_sizes(events: list[dict[str, Any]]) -> dict[Any, int]:
    """session_id -> world_size, from the session_start events (1 where a start does not say)."""
    sizes = {}
    for event in events:
        if event.get("event") == "session_start":
            size = event.get("world_size")
            sizes[event.get("session_id")] = size if isinstance(size, int) and size >= 1 else 1
    return sizes


def _band(rates: list[float], source: str) -> dict[str, Any]:
    return {"median": statistics.median(rates) if rates else None, "min": min(rates) if rates else None,
            "margin": THROUGHPUT_MARGIN, "low": min(rates) * (1 - THROUGHPUT_MARGIN) if rates else None,
            "windows": len(rates), "from": source}


def loss_noise(losses: list[float]) -> float:
    """The loss's window-to-window noise (spike_bound.step_spread, as stability.loss_noise) from 3 windows on,
    0.0 before: the envelope then rests on its share of the loss alone."""
    return step_spread(losses)


def _intervals(events: list[dict[str, Any]]) -> list[float]:
    """Seconds between consecutive train lines of one session (the run's own window interval)."""
    gaps, previous = [], {}
    for event in events:
        if event.get("event") == "train" and is_finite_number(event.get("time")):
            sid = event.get("session_id")
            if sid in previous:
                gaps.append(float(event["time"]) - previous[sid])
            previous[sid] = float(event["time"])
    return gaps


def watch_figures(summary: Summary, thresholds: dict[str, Any]) -> dict[str, Any]:
    """The pilot's figures `pilotrun watch --against LOCK` holds a long run to."""
    steady = steady_windows(summary.kept_events)
    rates = [r for r in map(window_tokens_per_s, steady) if r is not None]
    sizes = session_world_sizes(summary.kept_events)
    device_rates = [r for r in (window_tokens_per_device_second(e, sizes.get(e.get("session_id"), 1))
                                for e in steady) if r is not None]
    points = [[e["step"], float(e["loss"])] for e in summary.kept_events if e.get("event") == "train"
              and is_finite_number(e.get("loss"))]
    o = summary.overall
    attempted, skipped = o.get("updates_attempted") or 0, o.get("updates_skipped") or 0
    gaps = _intervals(summary.kept_events)
    shares = [s for s in map(window_cpu_share, steady) if s is not None]
    return {
        "throughput": {
            **_band(
                rates,
                "training-only tokens/s of the pilot's steady windows (each session's first "
                "and every profiled window left out); low = the slowest less the margin",
            ),
            "cpu_share": statistics.median(shares) if shares else None,
        },
        "device_throughput": _band(
            device_rates,
            "training-only tokens per device second (CUDA timing events) of "
            "the same steady windows, per device; low = the slowest less the "
            "margin; no windows on a CPU pilot, which has no device time",
        ),
        "loss_envelope": {
            "points": points,
            "noise": loss_noise([p[1] for p in points]),
            "sigmas": LOSS_ENVELOPE_SIGMAS,
            "share": LOSS_ENVELOPE_SHARE,
            "from": "the pilot's kept train windows (step, loss); the bound at a step is the pilot's "
            "loss there (its last past its end) plus the larger of sigmas x noise and share x "
            "loss",
        },
        "skip_rate": {
            "pilot": skipped / attempted if attempted else None,
            "bound": thresholds.get("max_skip_rate"),
        },
        "clip_rate": {"bound": thresholds.get("max_clip_rate")},
        "window_interval_seconds": statistics.median(gaps) if gaps else None,
        # the pilot's in-loop tasks and their figures: the long run's watch compares its own on the same files
        "downstream": pilot_figures(summary),
    }


def _seconds_of(events: list[dict[str, Any]], kind: str, field: str = "seconds") -> list[float]:
    return [float(e[field]) for e in events if e.get("event") == kind and is_finite_number(e.get(field))]


def _median_of(events: list[dict[str, Any]], kind: str, field: str = "seconds") -> float | None:
    seconds = _seconds_of(events, kind, field)
    return statistics.median(seconds) if seconds else None


def blocking_seconds(events: list[dict[str, Any]]) -> list[float]:
    """Each save's seconds it blocked the loop; a record from before `blocking_seconds` blocked for
    `seconds`."""
    return [
        float(e.get("blocking_seconds", e.get("seconds")))
        for e in events
        if e.get("event") == "checkpoint" and is_finite_number(e.get("blocking_seconds", e.get("seconds")))
    ]


def checkpoint_costs(events: list[dict[str, Any]]) -> tuple[float, float]:
    """(the median seconds a save blocked the loop, the median seconds a background save's write ran beside
    training; 0 without background saves)."""
    blocking = blocking_seconds(events)
    beside = _median_of(
        [e for e in events if e.get("background") is True], "checkpoint", "background_seconds"
    )
    return (statistics.median(blocking) if blocking else 0.0), beside or 0.0


def _count(every: Any, steps: int, at_end: bool) -> int:
    if not isinstance(every, int) or every <= 0:
        return 1 if at_end else 0
    return steps // every + (1 if at_end and steps % every else 0)


def project(summary: Summary, target_steps: int, mtbf_hours: float | None = None,
            device_hour_cost: float | None = None) -> dict[str, Any]:
    """The lock's `projection` for a long run of `target_steps` updates (module docstring)."""
    tpu = summary.run.get("tokens_per_update") or 0
    rates = [r for r in map(window_tokens_per_s, steady_windows(summary.kept_events)) if r is not None]
    if not rates or not tpu:
        return {
            "target_steps": target_steps,
            "unavailable": "the pilot has no steady train window to project from",
        }
    out: dict[str, Any] = {"target_steps": target_steps, "tokens": target_steps * tpu}
    out.update(_training_parts(summary, rates, target_steps, tpu))
    out.update(_cadence_parts(summary, target_steps))
    out.update(_session_parts(summary, target_steps))
    failure_free = (out["startup"]["seconds"] + out["training"]["seconds"] + out["checkpoint"]["seconds"]
                    + out["evaluation"]["seconds"] + out["overhead"]["seconds"])
    expected_lost = 0.0
    if mtbf_hours is not None:
        out.update(_failure_parts(out, summary, mtbf_hours, failure_free))
        expected_lost = out["failures"]["seconds"]
    out.update(_total_parts(out, summary, failure_free + expected_lost, mtbf_hours, device_hour_cost))
    return out


def _training_parts(summary: Summary, rates: list[float], target_steps: int, tpu: int) -> dict[str, Any]:
    """The pilot's steady training-only tokens/s and the training time they give the long run's tokens."""
    median, p10, p90 = statistics.median(rates), percentile(rates, 0.1), percentile(rates, 0.9)
    tokens = target_steps * tpu
    return {
        "train_tokens_per_s": {
            "median": median,
            "p10": p10,
            "p90": p90,
            "windows": len(rates),
            "from": "training-only tokens/s of the pilot's steady windows",
        },
        "training": {
            "seconds": tokens / median,
            "band": [tokens / p90, tokens / p10],
            "from": f"{target_steps} x {tpu} tokens / the median (band: p90, p10) tokens/s",
            "band_from": f"the tokens at the p90 and p10 of the pilot's {len(rates)} steady windows' "
            "tokens/s, at the pilot's CPU share (cpu_share)",
            "cpu_share": cpu_share_band(summary.kept_events),
        },
    }


def _cadence_parts(summary: Summary, target_steps: int) -> dict[str, Any]:
    """The checkpoints and evaluations the recipe's cadences give over the long run, at the pilot's costs."""
    recipe = summary.run.get("recipe")
    checkpoint_every = recorded_value(recipe, "train.checkpoint.every")  # of any recipe format
    eval_every = recorded_value(recipe, "train.eval.every")
    every = summary.kept_events + summary.rolled_back_events
    (ckpt_cost, ckpt_beside), eval_cost = checkpoint_costs(every), _median_of(every, "val") or 0.0
    checkpoints = _count(checkpoint_every, target_steps, at_end=True)
    evals = _count(eval_every, target_steps, at_end=False)
    ckpt_each, ckpt_rule = measured_spread(blocking_seconds(every))
    eval_each, eval_rule = measured_spread(_seconds_of(every, "val"))
    return {
        "checkpoint": {
            "seconds": checkpoints * ckpt_cost,
            "count": checkpoints,
            "each": ckpt_cost,
            "background_each": ckpt_beside,
            "from": f"median blocking seconds of the pilot's checkpoint events (what the loop waited for; "
            f"a background save's write beside training, background_each, is not lost) x the "
            f"count at train.checkpoint.every={checkpoint_every} (and the last update)",
            "band": [checkpoints * ckpt_each[0], checkpoints * ckpt_each[1]],
            "each_band": ckpt_each,
            "band_from": f"the count x each save's blocking seconds: {ckpt_rule}",
        },
        "evaluation": {
            "seconds": evals * eval_cost,
            "count": evals,
            "each": eval_cost,
            "from": f"median seconds of the pilot's val events x the count at train.eval.every={eval_every}",
            "band": [evals * eval_each[0], evals * eval_each[1]],
            "each_band": eval_each,
            "band_from": f"the count x each evaluation's seconds: {eval_rule}",
        },
    }


def _session_parts(summary: Summary, target_steps: int) -> dict[str, Any]:
    """Each session's start-up and the bookkeeping (report + other seconds) per update: the time ledger's."""
    ledger = time_ledger(summary.sessions, summary.kept_events, summary.rolled_back_events, summary.run)
    startups = [s.parts["startup"] for s in ledger.sessions]
    startup = statistics.median(startups) if startups else 0.0
    startup_band, startup_rule = measured_spread(startups)
    attempted = sum(s.updates_attempted for s in summary.sessions)
    overhead_rate = ((ledger.parts["report"] + ledger.parts["other"]) / attempted) if attempted else 0.0
    overhead = overhead_rate * target_steps
    host_low, host_high, host_windows = host_spread(summary.kept_events)
    return {
        "startup": {
            "seconds": startup,
            "from": "median start-up of the pilot's sessions (time ledger)",
            "measured": startups,
            "band": startup_band,
            "band_from": f"each pilot session's start-up (measured): {startup_rule}",
        },
        "overhead": {
            "seconds": overhead,
            "per_update": overhead_rate,
            "from": "the pilot's report + other seconds per update attempted (time ledger)",
            "band": [overhead * host_low, overhead * host_high],
            "band_from": "the figure x the p10 / median .. p90 / median of the host seconds per update "
                         "(wall less "
            f"training) of the pilot's {host_windows} steady windows",
        },
    }


def _failure_parts(out: dict[str, Any], summary: Summary, mtbf_hours: float,
                   failure_free: float) -> dict[str, Any]:
    """What failures at this MTBF are expected to cost, and the checkpoint interval that minimises it."""
    target_steps = out["target_steps"]
    seconds_per_update = failure_free / target_steps
    startup, ckpt_cost, ckpt_beside = (out["startup"]["seconds"], out["checkpoint"]["each"],
                                       out["checkpoint"]["background_each"])
    mtbf = mtbf_hours * 3600.0
    cadence = recorded_value(summary.run.get("recipe"), "train.checkpoint.every")
    interval = cadence if isinstance(cadence, int) and cadence > 0 else None  # None: only at the end
    interval_seconds = (interval or target_steps) * seconds_per_update
    failures = failure_free / mtbf
    # A failure also loses the save in flight: the newest committed state is older by its write.
    per_failure = interval_seconds / 2 + ckpt_beside + startup
    expected_lost = failures * per_failure
    young = math.sqrt(2 * ckpt_cost * mtbf)
    return {
        "failures": {
            "mtbf_hours": mtbf_hours,
            "expected": failures,
            "redone_seconds": failures * (interval_seconds / 2 + ckpt_beside),
            "restart_seconds": failures * startup,
            "seconds": expected_lost,
            "from": "failure-free time / MTBF failures, each redoing half a checkpoint interval "
            f"({interval or target_steps} updates x {seconds_per_update:.4g} s), the background write in "
            f"flight ({ckpt_beside:.4g} s) and one start-up; dead time before a restart is not projected",
            "band": [0.0, expected_lost],
            "band_from": "none happen .. the expected cost",
        },
        "checkpoint_interval": {
            "young_seconds": young,
            "young_updates": young / seconds_per_update,
            "daly_seconds": max(0.0, young - ckpt_cost),
            "recipe_updates": interval or None,
            "from": "Young (1974): sqrt(2 x checkpoint cost x MTBF), with the pilot's median blocking "
                    "checkpoint "
            f"seconds {ckpt_cost:.4g} (what a save costs the loop) and MTBF {mtbf_hours} h; Daly (2006): the "
            "same less the cost",
        },
    }


def _total_parts(out: dict[str, Any], summary: Summary, total: float, mtbf_hours: float | None,
                 device_hour_cost: float | None) -> dict[str, Any]:
    """The total wall time (the parts' sum) and its band, device-hours, cost, goodput and hardware."""
    world = _world_size(summary.run, summary)
    totals: dict[str, Any] = {}
    totals["total_wall"] = {
        "seconds": total,
        "from": "start-up + training + checkpoints + evaluations + overhead"
        + (" + expected failures" if mtbf_hours is not None else ""),
        **total_band(
            {
                k: out[k]
                for k in ("training", "checkpoint", "evaluation", "startup", "overhead", "failures")
                if k in out
            }
        ),
    }
    totals["device_hours"] = {"value": total / 3600.0 * world, "world_size": world,
                              "from": "total wall hours x the pilot's world_size"}
    if device_hour_cost is not None:
        totals["cost"] = {
            "value": totals["device_hours"]["value"] * device_hour_cost,
            "per_device_hour": device_hour_cost,
            "from": "device-hours x the price given",
        }
    train, tokens = out["training"]["seconds"], out["tokens"]
    totals["goodput"] = {"value": train / total if total > 0 else None, "from": "training / total wall"}
    totals["wall_tokens_per_s"] = {"value": tokens / total if total > 0 else None,
                                   "from": "tokens / total wall"}
    hardware = (_last_session(summary.run, summary) or {}).get("hardware") or {}
    totals["hardware"] = {k: hardware.get(k)
                          for k in ("device", "device_name", "world_size", "torch_threads")}
    totals["pilot_final_step"] = summary.overall.get("updates_applied")
    return totals


def _last_session(run: dict[str, Any], summary: Summary) -> dict[str, Any] | None:
    sessions = {str(s.get("session_id")): s for s in run.get("sessions") or [] if isinstance(s, dict)}
    return sessions.get(summary.lineage[-1]) if summary.lineage else None


def _world_size(run: dict[str, Any], summary: Summary) -> int:
    world = ((_last_session(run, summary) or {}).get("hardware") or {}).get("world_size")
    return world if isinstance(world, int) and world > 0 else 1
