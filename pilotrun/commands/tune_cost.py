"""What the pilot's checks (commands/tune.py) cost in seconds, read from the pilot's own record before any
branch runs: its wall seconds, its seconds per update, and every fixed cost a branch pays again beside its
updates, each as the pilot paid it.

- each branch is a session of its own: it pays the pilot's session start-up (clock start to first window),
  one evaluation at its last update and one checkpoint save there (the pilot's seconds per evaluation and per
  save: its time_split's eval and checkpoint seconds over its `val` and `checkpoint` events), and a session's
  bookkeeping (the rest of the pilot's session outside its updates, evaluations, saves and start-up);
- each process the branches run in pays a launch: the interpreter, the imports (torch, the trainer) and the
  command's set-up before the session's clock starts, which the pilot paid too and its record holds
  (`session_start.setup_seconds`, the command's start to that line). Only a record without it has the launch
  measured here instead, by one more interpreter launch that imports the trainer.

The budget compares the projected seconds with the pilot's own wall seconds counted the same way: each
session from its command's start (its launch included) to its end. On a tiny CPU pilot the launch and the
per-session costs, not the updates, are most of what the checks cost. Left out, each well under a second on
the CPU: assembling the branch folders (hard links), the plots and tune.json, the moments between two
branches in their shared process, and the bare interpreter's start before the command's clock.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pilotrun.run.record import read_metrics_tolerant, seconds_per_update_of

# what a branch's `pilotrun train` imports before its session clock starts: the trainer and torch under it
LAUNCH_PROBE = "import pilotrun.training.trainer"


@dataclass
class PilotTimings:
    seconds_per_update: float | None  # the pilot's median training seconds per update
    startup_seconds: float | None  # the pilot's median session start-up (loading, building, restoring)
    pilot_seconds: float | None  # the pilot's own wall seconds, all its sessions, launches included
    launch_seconds: float | None  # an interpreter's launch and the trainer's import, per branch process
    eval_seconds: float | None = None  # the pilot's seconds per evaluation (each branch evaluates once)
    save_seconds: float | None = None  # the pilot's seconds per checkpoint save (each branch saves once)
    bookkeeping_seconds: float | None = None  # a pilot session's seconds outside the parts above
    launch_from_record: bool = False  # the launch is the pilot's own (its record), not measured here

    @property
    def branch_fixed_seconds(self) -> float:
        """What each branch pays beside its updates: start-up, one evaluation, one save, bookkeeping."""
        parts = (self.startup_seconds, self.eval_seconds, self.save_seconds, self.bookkeeping_seconds)
        return sum(p or 0.0 for p in parts)

    def projected_seconds(self, updates: int, branches: int, processes: int) -> float | None:
        """The checks' projected wall seconds, the branches run in `processes` processes; None where the
        record has no seconds per update."""
        if not self.seconds_per_update:
            return None
        return (updates * self.seconds_per_update + branches * self.branch_fixed_seconds
                + processes * (self.launch_seconds or 0.0))

    def fits(self, updates: int, branches: int, processes: int, budget: float) -> bool:
        """Whether the projected seconds are within `budget` times the pilot's (true where either is
        unknown: the budget then holds in updates only)."""
        projected = self.projected_seconds(updates, branches, processes)
        return projected is None or not self.pilot_seconds or projected <= budget * self.pilot_seconds


@dataclass
class _Session:
    """One pilot session as its record tells it (times on the record's clock, seconds since the epoch)."""

    times: list[float] = field(default_factory=list)
    command_start: float | None = None  # session_start's time less its setup_seconds
    first_window: float | None = None  # the start of its first train window
    end: dict[str, Any] | None = None  # its session_end's time_split, with the line's time
    evaluations: int = 0
    saves: int = 0

    @property
    def clock_start(self) -> float | None:
        return None if self.end is None else self.end["time"] - self.end["wall_seconds"]


def _sessions_of(events: list[dict[str, Any]]) -> dict[str, _Session]:
    sessions: dict[str, _Session] = {}
    for event in events:
        when, kind = event.get("time"), event.get("event")
        if not isinstance(when, float):
            continue
        session = sessions.setdefault(str(event.get("session_id")), _Session())
        session.times.append(when)
        setup = event.get("setup_seconds")
        if kind == "session_start" and isinstance(setup, float | int) and setup >= 0:
            session.command_start = when - setup
        elif kind == "train" and session.first_window is None:
            window = (event.get("window") or {}).get("wall_seconds")
            session.first_window = when - (window if isinstance(window, float) else 0.0)
        elif kind == "session_end":
            split = event.get("time_split") or {}
            if isinstance(split.get("wall_seconds"), float) and split["wall_seconds"] > 0:
                session.end = {**split, "time": when}
        session.evaluations += kind == "val"
        session.saves += kind == "checkpoint"
    return sessions


def _median_startup(sessions: dict[str, _Session]) -> float | None:
    """The median seconds from a session's clock start to its first train window: loading, building,
    restoring, which each branch, a session of its own, pays again."""
    startups = [_startup(s) for s in sessions.values()]
    known = [s for s in startups if s is not None]
    return statistics.median(known) if known else None


def _startup(session: _Session) -> float | None:
    clock = session.clock_start
    return None if clock is None or session.first_window is None else max(0.0, session.first_window - clock)


def pilot_wall_seconds(sessions: dict[str, _Session]) -> float | None:
    """The pilot's own wall seconds from its record's sessions: each from its command's start (its launch and
    set-up before the session's clock, where the record says them) to its session_end's clock, and a session
    that ended without one (killed) to its last event (a lower bound). None: no session of the record says
    its wall seconds, and the budget holds in updates only."""
    sessions = sessions.values()
    if not any(s.end is not None for s in sessions):
        return None
    total = 0.0
    for session in sessions:
        if session.end is not None:
            clock = session.clock_start
            before = clock - session.command_start if session.command_start is not None else 0.0
            total += session.end["wall_seconds"] + max(0.0, before)
        else:
            began = session.command_start if session.command_start is not None else min(session.times)
            total += max(session.times) - min(began, *session.times)
    return total


def _median_launch(sessions: dict[str, _Session]) -> float | None:
    """The median seconds from a session's command start to its clock start: the imports and set-up a branch
    process pays again before its first branch's clock (None: the record has no `setup_seconds`)."""
    before = [s.clock_start - s.command_start for s in sessions.values()
              if s.command_start is not None and s.clock_start is not None]
    return max(0.0, statistics.median(before)) if before else None


def _phase_seconds(sessions: dict[str, _Session]) -> tuple[float | None, float | None, float | None]:
    """(seconds per evaluation, per checkpoint save, a session's bookkeeping) from the ended sessions whose
    time_split has its phases; None where the record has none."""
    split = [s for s in sessions.values()
             if s.end is not None and isinstance(s.end.get("train_seconds"), float)]
    if not split:
        return None, None, None
    evaluations, saves = sum(s.evaluations for s in split), sum(s.saves for s in split)
    each_eval = sum(s.end.get("eval_seconds") or 0.0 for s in split) / evaluations if evaluations else None
    each_save = sum(s.end.get("checkpoint_seconds") or 0.0 for s in split) / saves if saves else None
    rest = [s.end["wall_seconds"] - sum(s.end.get(k) or 0.0 for k in (
        "train_seconds", "eval_seconds", "checkpoint_seconds", "profile_seconds")) - (_startup(s) or 0.0)
        for s in split]
    return each_eval, each_save, max(0.0, statistics.median(rest))


def measure_launch_seconds() -> float:
    """Seconds for this interpreter to start and import the trainer in a process of its own: what each
    branch's process pays before its session clock starts, measured once, only where the pilot's record does
    not say its own (a torchrun launcher's own start is not in it)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", LAUNCH_PROBE], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=False)
    return time.perf_counter() - started


def read_pilot_timings(run_dir: Path, launch_seconds: float | None = None) -> PilotTimings:
    """The pilot's timings from one read of its record (pilot_timings)."""
    return pilot_timings(read_metrics_tolerant(run_dir).events, launch_seconds)


def pilot_timings(events: list[dict[str, Any]], launch_seconds: float | None = None) -> PilotTimings:
    """The pilot's timings from its record's events; `launch_seconds` None: the pilot's own launch from its
    record (its commands' start to their sessions' clocks), or, where the record lacks it, measured now
    (measure_launch_seconds)."""
    sessions, rates = _sessions_of(events), seconds_per_update_of(events)
    recorded = _median_launch(sessions) if launch_seconds is None else None
    launch = launch_seconds if launch_seconds is not None else recorded
    each_eval, each_save, bookkeeping = _phase_seconds(sessions)
    return PilotTimings(
        seconds_per_update=statistics.median(rates) if rates else None,
        startup_seconds=_median_startup(sessions),
        pilot_seconds=pilot_wall_seconds(sessions),
        launch_seconds=launch if launch is not None else measure_launch_seconds(),
        eval_seconds=each_eval,
        save_seconds=each_save,
        bookkeeping_seconds=bookkeeping,
        launch_from_record=recorded is not None,
    )
