"""What the pilot's checks (commands/tune.py) cost in seconds, read before any branch runs: the pilot's own
wall seconds and seconds per update from its record, the start-up each branch pays again, and the launch of
the process each branch runs in, measured once on this machine.

The budget compares the branches' projected seconds with the pilot's own wall seconds as its record counts
them (each session's clock, which starts after its interpreter has launched): on a tiny CPU pilot the
branches' launches and start-ups, not their updates, are most of what the checks cost.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pilotrun.run.record import read_metrics_tolerant, recorded_seconds_per_update

# what a branch's `pilotrun train` imports before its session clock starts: the trainer and torch under it
LAUNCH_PROBE = "import pilotrun.training.trainer"


@dataclass
class PilotTimings:
    seconds_per_update: float | None  # the pilot's median training seconds per update
    startup_seconds: float | None  # the pilot's median session start-up (loading, building, restoring)
    pilot_seconds: float | None  # the pilot's own wall seconds, all its sessions together
    launch_seconds: float | None  # an interpreter's launch and the trainer's import, per branch process

    def projected_seconds(self, updates: int, branches: int, processes: int) -> float | None:
        """The checks' projected wall seconds, the branches run in `processes` processes; None where the
        record has no seconds per update."""
        if not self.seconds_per_update:
            return None
        return (updates * self.seconds_per_update + branches * (self.startup_seconds or 0.0)
                + processes * (self.launch_seconds or 0.0))

    def fits(self, updates: int, branches: int, processes: int, budget: float) -> bool:
        """Whether the projected seconds are within `budget` times the pilot's (true where either is
        unknown: the budget then holds in updates only)."""
        projected = self.projected_seconds(updates, branches, processes)
        return projected is None or not self.pilot_seconds or projected <= budget * self.pilot_seconds


def pilot_startup_seconds(run_dir: Path) -> float | None:
    """The median seconds from a pilot session's clock start (its session_end's time less its recorded wall
    seconds) to its first train window: loading, building, restoring, which each branch, a session of its
    own, pays again (the interpreter's own launch comes before that clock and is not in it)."""
    first_window: dict[str, float] = {}
    startups = []
    for event in read_metrics_tolerant(run_dir).events:
        sid, when = str(event.get("session_id")), event.get("time")
        if not isinstance(when, float):
            continue
        if event.get("event") == "train" and sid not in first_window:
            window = (event.get("window") or {}).get("wall_seconds")
            first_window[sid] = when - (window if isinstance(window, float) else 0.0)
        ended = event.get("event") == "session_end"
        wall = (event.get("time_split") or {}).get("wall_seconds") if ended else None
        if isinstance(wall, float) and sid in first_window:
            startups.append(max(0.0, first_window[sid] - (when - wall)))
    return statistics.median(startups) if startups else None


def pilot_wall_seconds(run_dir: Path) -> float | None:
    """The pilot's own wall seconds from its record: each session's clock at its session_end, and a session
    that ended without one (killed) from its first event to its last (a lower bound). None: no session of the
    record says its wall seconds, and the budget holds in updates only."""
    times: dict[str, list[float]] = {}
    walls: dict[str, float] = {}
    for event in read_metrics_tolerant(run_dir).events:
        sid, when = str(event.get("session_id")), event.get("time")
        if isinstance(when, float):
            times.setdefault(sid, []).append(when)
        ended = event.get("event") == "session_end"
        wall = (event.get("time_split") or {}).get("wall_seconds") if ended else None
        if isinstance(wall, float) and wall > 0:
            walls[sid] = wall
    if not walls:
        return None
    return sum(walls.get(sid, max(seen) - min(seen)) for sid, seen in times.items())


def measure_launch_seconds() -> float:
    """Seconds for this interpreter to start and import the trainer in a process of its own: what each
    branch's process pays before its session clock starts, measured once (a torchrun launcher's own start is
    not in it)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", LAUNCH_PROBE], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=False)
    return time.perf_counter() - started


def read_pilot_timings(run_dir: Path, launch_seconds: float | None = None) -> PilotTimings:
    """The pilot's timings from its record; `launch_seconds` None: measured now (measure_launch_seconds)."""
    rates = recorded_seconds_per_update(run_dir)
    return PilotTimings(
        seconds_per_update=statistics.median(rates) if rates else None,
        startup_seconds=pilot_startup_seconds(run_dir),
        pilot_seconds=pilot_wall_seconds(run_dir),
        launch_seconds=launch_seconds if launch_seconds is not None else measure_launch_seconds(),
    )
