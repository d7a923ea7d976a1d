"""What the record says a session's start costs, read before any set-up (torch-free): the checks that refuse a
`--stop-by` too close to keep or a `--hang-timeout` below what this run has already taken measure against it.

- set-up: per earlier session, the seconds from its command's start to its first train window's start
  (`session_start.setup_seconds`, the command's start to the event, plus the event to the window's start:
  imports, the process group, the data, the model, a checkpoint's restore). A session recorded before
  `setup_seconds` existed counts from its `session_start` line: less than it took, never more.
- an update: the training-only seconds per update of each `train` window (run/record.py).
- a save: the blocking seconds of the run's last `checkpoint` event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pilotrun.run.record import RecordRead, read_record_once, seconds_per_update_of
from pilotrun.run.values import is_finite_number


def first_window_start(event: dict[str, Any]) -> float | None:
    """When a `train` event's window began: its line's time less the window's wall seconds."""
    window = event.get("window")
    if not (isinstance(window, dict) and is_finite_number(event.get("time"))
            and is_finite_number(window.get("wall_seconds"))):
        return None
    return float(event["time"]) - float(window["wall_seconds"])


def setup_seconds_of(events: list[dict[str, Any]]) -> list[float]:
    """Each session's set-up seconds, in record order, for the sessions that reached a train window."""
    began: dict[Any, float] = {}
    found: list[float] = []
    for event in events:
        sid, kind = event.get("session_id"), event.get("event")
        if kind == "session_start" and is_finite_number(event.get("time")):
            before = event.get("setup_seconds")
            before = float(before) if is_finite_number(before) and before > 0 else 0.0
            began[sid] = float(event["time"]) - before
        elif kind == "train" and sid in began:
            start = first_window_start(event)
            if start is not None:
                found.append(max(0.0, start - began.pop(sid)))
    return found


@dataclass(frozen=True)
class StartCosts:
    """What the record says, read once: the seconds per update of each train window, the set-up of each
    session that trained, and the last save's seconds (None: it never saved)."""

    seconds_per_update: list[float]
    setup_seconds: list[float]
    last_save: float | None
    # The read they come from: the session's start takes it over while the file is unchanged (ReadHandover).
    read: RecordRead | None = field(default=None, compare=False, repr=False)


def read_start_costs(run_dir: str | Path) -> StartCosts:
    """The run's start costs from one read of metrics.jsonl (all empty for a run with no record yet)."""
    read = read_record_once(run_dir)
    events = read.events
    return StartCosts(seconds_per_update_of(events), setup_seconds_of(events), last_save_of(events), read)


class ReadHandover:
    """The record of `run_dir`, read at most once by the command's start-up checks (`start_costs`, on first
    use) and handed to the session's start (`take`), so that a long run's metrics.jsonl is read once per
    command, and its events are held no longer than the session's start uses them."""

    def __init__(self, run_dir: str | Path) -> None:
        self._run_dir = run_dir
        self._costs: StartCosts | None = None

    def start_costs(self) -> StartCosts:
        """The run's start costs, read on the first call (a command whose checks need none reads nothing)."""
        if self._costs is None:
            self._costs = read_start_costs(self._run_dir)
        return self._costs

    def take(self) -> RecordRead:
        """The checks' read where metrics.jsonl is unchanged since it, else one read now; held no longer."""
        read = self._costs.read if self._costs is not None else None
        self._costs = None
        return read if read is not None and read.current(self._run_dir) else read_record_once(self._run_dir)


def last_save_of(events: list[dict[str, Any]]) -> float | None:
    """The blocking seconds of the run's last recorded save among `events` (None: it never saved)."""
    saves = [e.get("seconds") for e in events if e.get("event") == "checkpoint"]
    return next((float(s) for s in reversed(saves) if isinstance(s, int | float) and s >= 0), None)
