"""The projection's band: the spread the pilot itself measured, part by part, and which assumption a long run
moved when its time falls outside.

Each part of the lock's projection (long_run.py) carries `band` [low, high] seconds over the projected run and
`band_from`, the measurements and rule it comes from:
- training: the long run's tokens at the pilot's p90 and p10 steady-window tokens/s, at the CPU share the
  pilot ran at (`training.cpu_share`: the median, p10 and p90 of its steady windows' process CPU seconds per
  training second; a run's share from `low` = p10 x (1 - CPU_SHARE_MARGIN) to `high` = p90 x (1 +
  CPU_SHARE_MARGIN) is "the same share": the band assumes it);
- start-up, checkpoint saves and evaluations, durations the pilot measured a few times each (each session's
  start-up, each save's blocking seconds, each evaluation's seconds), by one rule: their min..max, widened to
  at least median / SPREAD_FLOOR .. median x SPREAD_FLOOR where fewer than MIN_SPREAD_SAMPLES were measured
  (one or two sessions do not measure how a start-up varies with the machine's load: a pilot's single start-up
  and its long run's on the same machine can lie far apart); saves and evaluations times their projected
  count;
- overhead (report and bookkeeping per update): the figure scaled by the window-to-window spread of the host
  seconds per update (each steady window's wall less training seconds, per update attempted): its p10 / median
  .. p90 / median, never narrower than the figure itself;
- failures (with --mtbf): 0 (none happen) .. the expected cost. The total's band is the sum of the parts' lows
  .. the sum of their highs (`total_wall.band`).

Against a long run (summarize, watch), the band is taken at the updates kept so far: every part scaled by the
share of the target done, but start-up, which a session pays once. When the elapsed time leaves it, each part
outside its own band (by more than PART_TOLERANCE of its high) is named, the largest excess first, with the
assumption that moved: the start-up, the throughput and whether the run's CPU share left the pilot's (a busier
machine, or a quieter one), the seconds per save or per evaluation, the bookkeeping, time with no session
running. A lock without these fields is compared by the training part's band alone (ledger.py).
"""

from __future__ import annotations

import statistics
from typing import Any

from pilotrun.report.record_check.time_split import window_profiled
from pilotrun.run.record import is_finite_number

# A duration measured fewer times than this has its band widened to at least median / floor .. median x floor.
MIN_SPREAD_SAMPLES = 3
SPREAD_FLOOR = 2.5
# A run's CPU share within the pilot's p10 x (1 - margin) .. p90 x (1 + margin) is the share the band assumes.
CPU_SHARE_MARGIN = 0.2
# A part within this share of its band's high is inside it: a part projected as one figure (overhead, a
# duration measured the same every time) is never met to the last digit by the record's clock.
PART_TOLERANCE = 0.01

# The projection's parts beside the ledger's: (name, projection keys, ledger parts, scales with the updates).
# Start-up is once per session in both (the projection's is one session's); dead time is never projected.
PART_PAIRS = (
    ("training", ("training",), ("productive", "redone"), True),
    ("checkpoint", ("checkpoint",), ("checkpoint",), True),
    ("evaluation", ("evaluation",), ("eval",), True),
    ("startup", ("startup",), ("startup",), False),
    ("overhead", ("overhead",), ("report", "other", "profile", "replay"), True),
    ("failures", ("failures",), (), True),
    ("dead time", (), ("dead",), True),
)


def steady_windows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The train events whose window is steady: not a session's first window, not profiled, with training
    time."""
    seen: set[Any] = set()
    steady = []
    for event in events:
        if event.get("event") != "train" or not isinstance(event.get("window"), dict):
            continue
        first = event.get("session_id") not in seen
        seen.add(event.get("session_id"))
        window = event["window"]
        if first or window_profiled(window) or not (is_finite_number(window.get("train_seconds"))
                                                    and window["train_seconds"] > 0):
            continue
        steady.append(event)
    return steady


def window_cpu_share(event: dict[str, Any]) -> float | None:
    """The process's CPU seconds per training second in a window (on a CPU, its share of the machine's CPU it
    got), or None where the window has no cpu_seconds."""
    window = event.get("window")
    if not isinstance(window, dict):
        return None
    cpu, train = window.get("cpu_seconds"), window.get("train_seconds")
    if not (is_finite_number(cpu) and is_finite_number(train)) or cpu <= 0 or train <= 0:
        return None
    return float(cpu) / float(train)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low, high = int(position), min(int(position) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def measured_spread(values: list[float]) -> tuple[list[float], str]:
    """[low, high] of a duration the pilot measured `values` of, and the rule that gave it (module
    docstring)."""
    if not values:
        return [0.0, 0.0], "none measured"
    low, high, n = min(values), max(values), len(values)
    if n >= MIN_SPREAD_SAMPLES:
        return [low, high], f"min..max of the {n} measured"
    middle = statistics.median(values)
    return ([min(low, middle / SPREAD_FLOOR), max(high, middle * SPREAD_FLOOR)],
            f"min..max of the {n} measured, widened to at least median / {SPREAD_FLOOR:g} .. median x "
            f"{SPREAD_FLOOR:g} (fewer than {MIN_SPREAD_SAMPLES} measured)")


def cpu_share_band(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The CPU share the pilot's steady windows ran at (the training band's assumption), or None without
    one."""
    shares = [s for s in map(window_cpu_share, steady_windows(events)) if s is not None]
    if not shares:
        return None
    p10, p90 = percentile(shares, 0.1), percentile(shares, 0.9)
    return {
        "median": statistics.median(shares),
        "p10": p10,
        "p90": p90,
        "low": p10 * (1 - CPU_SHARE_MARGIN),
        "high": p90 * (1 + CPU_SHARE_MARGIN),
        "windows": len(shares),
        "from": "process CPU seconds per training second of the pilot's steady windows; a run from low = p10 "
                "x "
        f"{1 - CPU_SHARE_MARGIN:g} to high = p90 x {1 + CPU_SHARE_MARGIN:g} runs at the pilot's share",
    }


def host_spread(events: list[dict[str, Any]]) -> tuple[float, float, int]:
    """(p10 / median, p90 / median, windows) of the steady windows' host seconds per update attempted (the
    loop's work beside training: most of the overhead), clamped to include 1; (1, 1, 0) without such
    windows."""
    rates = []
    for event in steady_windows(events):
        window = event["window"]
        wall, attempted = window.get("wall_seconds"), window.get("updates_attempted")
        if is_finite_number(wall) and isinstance(attempted, int) and attempted > 0:
            rates.append(max(0.0, float(wall) - float(window["train_seconds"])) / attempted)
    middle = statistics.median(rates) if rates else 0.0
    if middle <= 0:
        return 1.0, 1.0, len(rates)
    return min(1.0, percentile(rates, 0.1) / middle), max(1.0, percentile(rates, 0.9) / middle), len(rates)


def total_band(parts: dict[str, Any]) -> dict[str, Any]:
    """`total_wall`'s band from the parts' bands (each part's `band`; a part without one at its seconds)."""
    lows, highs, named = 0.0, 0.0, []
    for key, part in parts.items():
        band = _band_of(part)
        if band is None:
            continue
        lows, highs = lows + band[0], highs + band[1]
        named.append(key)
    return {"band": [lows, highs], "band_from": "the sum of the parts' lows .. the sum of their highs ("
            + ", ".join(named) + ")"}


def _band_of(part: Any) -> list[float] | None:
    if not isinstance(part, dict):
        return None
    band = part.get("band")
    if isinstance(band, list) and len(band) == 2 and all(map(is_finite_number, band)):
        return [float(band[0]), float(band[1])]
    return [float(part["seconds"])] * 2 if is_finite_number(part.get("seconds")) else None


# ---------------------------------------------------------------------------------------------- vs a long run
def observed(events: list[dict[str, Any]] | None, sessions: int, overall: dict[str, Any]) -> dict[str, Any]:
    """The long run's own figures the explanation names: its steady windows' median CPU share, how many saves
    and evaluations it made, its sessions and its training-only tokens/s."""
    events = events or []
    shares = [s for s in map(window_cpu_share, steady_windows(events)) if s is not None]
    return {"cpu_share": statistics.median(shares) if shares else None,
            "checkpoints": sum(e.get("event") == "checkpoint" for e in events),
            "evaluations": sum(e.get("event") == "val" for e in events), "sessions": sessions,
            "train_tokens_per_s": overall.get("train_tokens_per_s")}


def elapsed_band(projection: dict[str, Any], parts: dict[str, float], elapsed: float, share: float | None,
                 run: dict[str, Any]) -> dict[str, Any] | None:
    """The total's band at the updates kept so far, whether `elapsed` lies in it, every part beside its own
    band and, for a miss, why: the parts outside their bands, largest excess first, each with what moved. None
    for a lock without the parts' bands (ledger.py then compares by the training part's band)."""
    if share is None or _band_of_total(projection) is None:
        return None
    rows = []
    for name, projected_keys, ledger_keys, scales in PART_PAIRS:
        factor = share if scales else 1.0
        part = projection.get(projected_keys[0]) if projected_keys else None
        band = _band_of(part) if projected_keys else [0.0, 0.0]
        if band is None:
            continue
        projected = float(part.get("seconds") or 0.0) if isinstance(part, dict) else 0.0
        low, high = band[0] * factor, band[1] * factor
        actual = sum(parts.get(k, 0.0) for k in ledger_keys)
        slack = PART_TOLERANCE * high
        outside = actual - high if actual > high + slack else actual - low if actual < low - slack else 0.0
        row = {"part": name, "actual": actual, "projected": projected * factor, "low": low, "high": high,
               "difference": actual - projected * factor, "outside": outside}
        if name == "training":
            row["redone"] = parts.get("redone", 0.0)
        if outside:
            row["moved"] = _moved(name, row, part, projection, run)
        if projected or actual or high:
            rows.append(row)
    rows.sort(key=lambda p: (-abs(p["outside"]), -abs(p["difference"])))
    low, high = sum(p["low"] for p in rows), sum(p["high"] for p in rows)
    inside = low <= elapsed <= high
    why = None
    if not inside:
        side = "above" if elapsed > high else "below"
        moved = [p["moved"] for p in rows if p["outside"]]
        why = f"elapsed {elapsed:.4g} s is {side} the band {low:.4g}-{high:.4g} s: " + (
            "; ".join(moved)
            if moved
            else (
                "no part is outside its own band; the largest differences: "
                + largest_differences(rows)
            )
        )
    return {
        "low": low,
        "high": high,
        "inside": inside,
        "parts": rows,
        "why": why,
        "run": run,
        "from": "the sum of the parts' bands at the updates kept so far (each part's band scaled by the "
                "share of "
        "the target done, start-up once): the spread the pilot measured (lock's band_from)",
    }


def _band_of_total(projection: dict[str, Any]) -> list[float] | None:
    total = projection.get("total_wall")
    return _band_of(total) if isinstance(total, dict) and "band" in total else None


def _g(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _moved(name: str, row: dict[str, Any], part: Any, projection: dict[str, Any], run: dict[str, Any]) -> str:
    """What a part outside its band says: its seconds against its band, and the assumption that moved."""
    said = f"{_g(row['actual'])} s against {_g(row['low'])}-{_g(row['high'])} s projected"
    part = part if isinstance(part, dict) else {}
    if name == "training":
        redone = (
            f", {_g(row['redone'])} s of it redone (rolled back, trained again)" if row.get("redone") else ""
        )
        return f"training {said}{redone}" + _throughput_moved(projection, run)
    if name in ("checkpoint", "evaluation"):
        count = run["checkpoints" if name == "checkpoint" else "evaluations"]
        each = part.get("each_band")
        what = "checkpoints" if name == "checkpoint" else "evaluations"
        if count and isinstance(each, list) and len(each) == 2:
            noun = "saves" if name == "checkpoint" else "evaluations"
            return (f"{what} {said} ({count} {noun}, {_g(row['actual'] / count)} s each against the pilot's "
                    f"{_g(each[0])}-{_g(each[1])} s)")
        return f"{what} {said}"
    if name == "startup":
        sessions = run.get("sessions") or 1
        return f"start-up {said}" + (f" (over {sessions} sessions; the projection's is one session's)"
                                     if sessions > 1 else "")
    if name == "dead time":
        return f"dead time {_g(row['actual'])} s with no session running, none projected"
    return f"{name} {said}"


def _throughput_moved(projection: dict[str, Any], run: dict[str, Any]) -> str:
    """The training part's assumptions: the pilot's p10..p90 tokens/s, at the pilot's CPU share."""
    said = []
    rates, rate = projection.get("train_tokens_per_s") or {}, run.get("train_tokens_per_s")
    if is_finite_number(rate) and is_finite_number(rates.get("p10")) and is_finite_number(rates.get("p90")):
        said.append(
            f"training-only {_g(rate)} tok/s against the pilot's {_g(rates['p10'])}-{_g(rates['p90'])} "
            "(p10-p90)"
        )
    pilot, share = (projection.get("training") or {}).get("cpu_share"), run.get("cpu_share")
    if isinstance(pilot, dict) and is_finite_number(share) and all(
            is_finite_number(pilot.get(k)) for k in ("median", "low", "high")):
        against = f"throughput at CPU share {share:.2f} against the pilot's {pilot['median']:.2f}"
        if share < pilot["low"]:
            said.append(f"{against}: the machine was busier")
        elif share > pilot["high"]:
            said.append(f"{against}: the machine was quieter than the pilot's")
        else:
            said.append(
                f"{against} (within {pilot['low']:.2f}-{pilot['high']:.2f}: the process got the share the "
                "pilot had)"
            )
    return f" ({'; '.join(said)})" if said else ""


def largest_differences(parts: list[dict[str, Any]], count: int = 3) -> str:
    """The first `count` parts (sorted by the caller, largest difference first) as `part actual against
    projected (difference)`: how a band's `why` names what moved."""
    return "; ".join(f"{p['part']} {p['actual']:.4g} s against {p['projected']:.4g} s projected "
                     f"({p['difference']:+.4g} s)" for p in parts[:count])
