"""The time ledger of a whole run (goodput): where every second from the first session's start to the last
event went, over all sessions, and how that compares with what the frozen candidate's lock projected.

Each session spans from its clock's start to its last line. Its clock's start is the trainer's own
(`session_end.time - time_split.wall_seconds`, the TimeAccount started before anything else of the session); a
session killed before its session_end has no such figure, so its start is the earliest it recorded (run.json's
`started_at`, else its session_start line), and it ends at its last line: whatever it did after that line is
lost with it and shows as dead time. Within a span the session's time split (time_split.py) already puts every
second in one phase; the ledger splits two of those further:
- train: `productive` (the training seconds of the kept history's train windows) and `redone` (the rest: the
  windows a resume rolled back, and training after a session's last window that an interruption cut off);
- other: `startup` (from the session's clock start to the start of its first train window: loading, building,
  restoring a checkpoint; on CUDA the first update's compile stays in its window's training seconds, the
  record has no finer clock) and `other` (bookkeeping between phases). A session with no update is all
  start-up. `replay` is carved out of other too: the seconds the `spike` events say their replays took and the
  `rollback` events their restores (both run in the "other" phase). Between sessions, `dead` is the time from
  one session's last line to the next one's start (a crash noticed late, a queue, the process's own start
  before its clock). So the parts telescope to the elapsed time exactly (float rounding of unix seconds
  aside); only clocks that disagree (an NTP step) could make a dead part negative, and that is noted. Goodput
  = productive / elapsed.

Checkpoint time is split in two: what the loop waited for (the `checkpoint` part, lost time like any other
part) and what background saves wrote beside training (`checkpoint_split.background_seconds`, from their
`checkpoint` events). The second overlaps the training seconds, so it is not a part and never lowers goodput.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from pilotrun.report.projection.band import PART_PAIRS, elapsed_band, largest_differences, observed
from pilotrun.report.record_check.spike_history import replay_seconds
from pilotrun.report.record_check.time_split import read_time_split
from pilotrun.run.record import is_finite_number
from pilotrun.run.start_costs import first_window_start

# The ledger's parts, in the order they are printed and drawn.
PARTS = (
    "productive",
    "redone",
    "checkpoint",
    "eval",
    "startup",
    "profile",
    "replay",
    "report",
    "other",
    "dead",
)
PART_MEANINGS = {
    "productive": "training seconds of the updates that were kept",
    "redone": "training seconds of updates rolled back by an interruption or a spike's rollback (trained "
              "again)",
    "replay": "replaying spiking updates to name their cause, and restoring a checkpoint for a spike's "
              "rollback",
    "checkpoint": "the loop waiting for checkpoints (a synchronous save's whole write; a background save's "
                  "copy to "
    "host memory, and any wait for its write)",
    "eval": "evaluation",
    "startup": "a session's clock start to its first train window (loading, building, restoring)",
    "profile": "update attempts under the profiler",
    "report": "writing the record and the progress display",
    "other": "bookkeeping between phases",
    "dead": "no session running: one session's last line to the next one's start",
}


@dataclass
class SessionLedger:
    session_id: str
    start: float  # unix seconds: the session's clock start
    last_event: float  # unix seconds: its last line
    dead_before: float  # seconds since the previous session's last line (0 for the first)
    source: str  # "session_end" (its own time split) or "events" (killed: derived)
    parts: dict[str, float]  # every part of PARTS but dead


@dataclass
class Ledger:
    elapsed_seconds: float
    parts: dict[str, float]
    goodput: float | None
    sessions: list[SessionLedger]
    notes: list[str] = field(default_factory=list)
    # {blocking_seconds: the checkpoint part, background_seconds: written beside training (not a part)}
    checkpoint_split: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _parse_iso(value: Any) -> float | None:
    try:
        return datetime.datetime.fromisoformat(str(value)).timestamp()
    except (TypeError, ValueError):
        return None


def _session_events(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = {}
    for event in sorted(events, key=lambda e: e.get("_line", 0)):
        grouped.setdefault(str(event.get("session_id")), []).append(event)
    return grouped


def _train_seconds(events: list[dict[str, Any]]) -> float:
    return sum(float(e["window"]["train_seconds"]) for e in events if e.get("event") == "train"
               and isinstance(e.get("window"), dict) and is_finite_number(e["window"].get("train_seconds")))


def _first_window_start(events: list[dict[str, Any]]) -> float | None:
    """When the session's first train window began: its line's time less the window's wall seconds (the same
    reading as the start checks' set-up, run/start_costs.py)."""
    starts = (first_window_start(e) for e in events if e.get("event") == "train")
    return next((start for start in starts if start is not None), None)


def time_ledger(
    sessions: list[Any],
    kept_events: list[dict[str, Any]],
    rolled_back_events: list[dict[str, Any]],
    run: dict[str, Any],
) -> Ledger:
    """The run's ledger from summarize's pieces (its SessionSummary list and the kept / rolled-back
    events)."""
    kept = _session_events(kept_events)
    every = _session_events(kept_events + rolled_back_events)
    started_at = {str(s.get("session_id")): _parse_iso(s.get("started_at")) for s in run.get("sessions") or []
                  if isinstance(s, dict)}
    notes: list[str] = []
    ledgers: list[SessionLedger] = []
    previous_last: float | None = None
    for s in sessions:
        events = every.get(s.session_id, [])
        times = [float(e["time"]) for e in events if is_finite_number(e.get("time"))]
        if not times:
            continue
        last = times[-1]
        end = events[-1] if events[-1].get("event") == "session_end" else None
        split = read_time_split(end.get("time_split")) if end is not None else None
        if split is not None:
            start, source = last - split["wall_seconds"], "session_end"
        else:
            recorded = started_at.get(s.session_id)
            start = recorded if recorded is not None and recorded <= times[0] else times[0]
            source = "events"
        span = last - start
        named = {"checkpoint": s.checkpoint_seconds, "eval": s.eval_seconds, "profile": s.profile_seconds,
                 "report": s.report_seconds}
        train = s.train_seconds
        productive = min(train, _train_seconds(kept.get(s.session_id, [])))
        other = span - train - sum(named.values())
        first_window = _first_window_start(events)
        startup = other if first_window is None else min(max(0.0, first_window - start), max(0.0, other))
        # recorded by spike and rollback events
        replay = min(replay_seconds(events), max(0.0, other - startup))
        parts = {"productive": productive, "redone": train - productive, **named, "startup": startup,
                 "replay": replay, "other": other - startup - replay}
        dead = 0.0 if previous_last is None else start - previous_last
        if dead < 0:
            notes.append(
                f"session {s.session_id}: starts {-dead:.3f} s before the previous session's last line "
                "(clocks that disagree); its dead part is negative so that the parts still add up"
            )
        ledgers.append(
            SessionLedger(s.session_id, start, last, dead, source, {k: parts[k] for k in PARTS[:-1]})
        )
        previous_last = last
    totals = dict.fromkeys(PARTS, 0.0)
    for entry in ledgers:
        for key, value in entry.parts.items():
            totals[key] += value
        totals["dead"] += entry.dead_before
    elapsed = ledgers[-1].last_event - ledgers[0].start if ledgers else 0.0
    goodput = totals["productive"] / elapsed if elapsed > 0 else None
    beside = sum(float(e["background_seconds"]) for e in kept_events + rolled_back_events
                 if e.get("event") == "checkpoint" and e.get("background") is True
                 and is_finite_number(e.get("background_seconds")))
    split = {"blocking_seconds": totals["checkpoint"], "background_seconds": beside}
    return Ledger(elapsed, totals, goodput, ledgers, notes, split)


def ledger_problem(ledger: Ledger) -> str | None:
    """Why the parts do not add up to the elapsed time (to float rounding of unix seconds), or None."""
    total = sum(ledger.parts.values())
    if abs(total - ledger.elapsed_seconds) > max(1e-5, 1e-9 * abs(ledger.elapsed_seconds)):
        return (
            f"time ledger: parts add up to {total!r} s but the elapsed time is {ledger.elapsed_seconds!r} s"
        )
    return None


def format_ledger(ledger: dict[str, Any]) -> str:
    """One line for `summarize`, from the ledger's JSON form (Summary.overall["time_ledger"])."""
    if not ledger["sessions"]:
        return "time ledger: no session with events"
    shares = ", ".join(f"{k} {v:.1f} s" for k, v in ledger["parts"].items())
    good = "n/a" if ledger["goodput"] is None else f"{100 * ledger['goodput']:.1f}%"
    split = ledger.get("checkpoint_split") or {}
    beside = (f"; checkpoints also wrote {split['background_seconds']:.1f} s beside training (not lost)"
              if split.get("background_seconds") else "")
    return (
        f"time ledger: elapsed {ledger['elapsed_seconds']:.1f} s (first session's start to the last event, "
        f"{len(ledger['sessions'])} session(s)): {shares}; goodput {good} (productive / elapsed){beside}"
    )


# ---------------------------------------------------------------------------------------------- vs the lock
def against_projection(projection: dict[str, Any] | None, ledger: Ledger, overall: dict[str, Any],
                       events: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """What happened beside what the lock projected, each as {actual, projected, ratio}: elapsed (the
    projection scaled to the updates kept so far), goodput and training-only tokens/s; and whether the elapsed
    time lies in the projected band, and if not, why: each part outside its own band with the assumption that
    moved, largest first (band.py; `events`, the run's, give its CPU share and its counts of saves and
    evaluations), or for a lock without the parts' bands, the ledger's parts beside the projection's, the
    largest difference first. None without a projection."""
    if not isinstance(projection, dict):
        return None
    target = projection.get("target_steps")
    steps = overall.get("updates_applied") or 0
    total = (projection.get("total_wall") or {}).get("seconds")
    share = steps / target if isinstance(target, int) and target > 0 else None
    scaled = total * share if is_finite_number(total) and share is not None else None
    pairs = {
        "elapsed_seconds": (ledger.elapsed_seconds, scaled),
        "goodput": (ledger.goodput, (projection.get("goodput") or {}).get("value")),
        "train_tokens_per_s": (overall.get("train_tokens_per_s"),
                               (projection.get("train_tokens_per_s") or {}).get("median")),
    }
    compared: dict[str, Any] = {}
    for key, (actual, projected) in pairs.items():
        ratio = (
            actual / projected
            if is_finite_number(actual) and is_finite_number(projected) and projected
            else None
        )
        compared[key] = {"actual": actual, "projected": projected,
                         "ratio": ratio if ratio is None or math.isfinite(ratio) else None}
    compared["basis"] = (
        f"projection for {target} updates; elapsed compared at the {steps} update(s) kept so far "
        "(the projected total scaled by updates)"
    )
    run = observed(events, len(ledger.sessions), overall)
    compared["band"] = (elapsed_band(projection, ledger.parts, ledger.elapsed_seconds, share, run)
                        or _elapsed_band(projection, ledger, share))
    return compared


def _elapsed_band(projection: dict[str, Any], ledger: Ledger, share: float | None) -> dict[str, Any] | None:
    """[low, high] of the elapsed time projected at the updates kept so far (the training part's own band,
    from the pilot's p90 and p10 window speeds, with the rest as projected), whether the elapsed time lies in
    it, and the parts that explain a miss, largest difference first: for a lock without the parts' bands."""
    training = projection.get("training") or {}
    band, total = training.get("band"), (projection.get("total_wall") or {}).get("seconds")
    if share is None or not (isinstance(band, list) and len(band) == 2 and all(map(is_finite_number, band))
                             and is_finite_number(total) and is_finite_number(training.get("seconds"))):
        return None
    rest = total - training["seconds"]
    low, high = (rest + band[0]) * share, (rest + band[1]) * share
    parts = []
    for name, projected_keys, ledger_keys, scales in PART_PAIRS:
        projected = sum(float((projection.get(k) or {}).get("seconds") or 0.0) for k in projected_keys)
        projected *= share if scales else 1.0
        actual = sum(ledger.parts.get(k, 0.0) for k in ledger_keys)
        if projected or actual:
            parts.append(
                {"part": name, "actual": actual, "projected": projected, "difference": actual - projected}
            )
    parts.sort(key=lambda p: -abs(p["difference"]))
    inside = low <= ledger.elapsed_seconds <= high
    why = None
    if not inside:
        side = "above" if ledger.elapsed_seconds > high else "below"
        why = (
            f"elapsed {ledger.elapsed_seconds:.4g} s is {side} the band {low:.4g}-{high:.4g} s: "
            + largest_differences(parts)
        )
    return {
        "low": low,
        "high": high,
        "inside": inside,
        "parts": parts,
        "why": why,
        "from": "the projected total at the updates kept so far, its training part taken at the pilot's p90 "
        "and p10 training-only tokens/s",
    }


def format_against(compared: dict[str, Any] | None) -> str | None:
    if compared is None:
        return None
    parts = []
    for key in ("elapsed_seconds", "goodput", "train_tokens_per_s"):
        c = compared[key]
        ratio = "n/a" if c["ratio"] is None else f"{c['ratio']:.2f}"
        parts.append(f"{key} {_num(c['actual'])} / projected {_num(c['projected'])} = {ratio}")
    band = compared.get("band")
    if band is not None:
        parts.append(f"in the projected band {band['low']:.4g}-{band['high']:.4g} s" if band["inside"]
                     else f"outside the projected band: {band['why']}")
    return f"against the lock's projection ({compared['basis']}): " + "; ".join(parts)


def _num(value: Any) -> str:
    return "n/a" if not is_finite_number(value) else f"{value:.4g}"
