"""The time ledger of a session: every second belongs to exactly one phase (train, eval, checkpoint, profile,
report, other), and the phases add up to its wall clock. Read from a session_end's `time_split`, or derived
from the events a killed session did write; and which of a window's tokens go with the training phase's
seconds.

Every throughput figure and rule reads these, so the training-only rate never mixes in the profiler's updates.
"""

from __future__ import annotations

from typing import Any

from pilotrun.run.record import PHASES, is_finite_number

# The phases of a session_end `time_split` (the record's PHASES, as `<phase>_seconds`).
SPLIT_PHASES = tuple(f"{phase}_seconds" for phase in PHASES)
# Older records lack these two; their time was counted in other_seconds.
LATER_PHASES = ("profile_seconds", "report_seconds")
SPLIT_KEYS = (*SPLIT_PHASES, "wall_seconds")


def read_time_split(split: Any) -> dict[str, float] | None:
    """A session_end's time split as floats, the phases an older record lacks as 0; None when it does not hold
    a finite number for each phase it must carry."""
    if not isinstance(split, dict):
        return None
    required = [k for k in SPLIT_KEYS if k not in LATER_PHASES]
    if not all(is_finite_number(split.get(k)) for k in required):
        return None
    if not all(is_finite_number(split[k]) for k in LATER_PHASES if k in split):
        return None
    return {k: float(split.get(k, 0.0)) for k in SPLIT_KEYS}


def time_split_problem(split: Any) -> str | None:
    """Why a session_end's time split is not an account of its wall clock, or None. Every second of a session
    belongs to exactly one phase, so the phases add up to the wall clock (to float rounding: a millisecond, or
    a millionth of a long session)."""
    times = read_time_split(split)
    if times is None:
        if isinstance(split, dict) and any(k in split for k in SPLIT_KEYS):
            return f"time_split {split} lacks a finite number for one of {', '.join(SPLIT_KEYS)}"
        return None  # no split at all: the session's time is derived from its events
    negative = [k for k in SPLIT_KEYS if times[k] < 0]
    if negative:
        return f"time_split has negative seconds in {', '.join(negative)}"
    total, wall = sum(times[k] for k in SPLIT_PHASES), times["wall_seconds"]
    if abs(total - wall) > max(1e-3, 1e-6 * wall):
        return (
            f"time_split phases add up to {total!r} s "
            f"({' + '.join(f'{k} {times[k]!r}' for k in SPLIT_PHASES)}) "
            f"but wall_seconds is {wall!r}"
        )
    return None


def window_profiled(window: dict[str, Any]) -> bool:
    """Whether a train window ran some of its update attempts under torch.profiler (older records: never)."""
    attempts = window.get("profiled_attempts")
    return is_finite_number(attempts) and attempts > 0


def window_train_tokens(window: dict[str, Any]) -> float | None:
    """The window's tokens processed in the training phase: those of profiled attempts excluded, as their
    seconds are the profile phase's, not `train_seconds`."""
    tokens = window.get("tokens")
    if not is_finite_number(tokens):
        return None
    profiled = window.get("profiled_tokens")
    return float(tokens) - (float(profiled) if is_finite_number(profiled) else 0.0)


def derived_time_split(
    train: float, eval_: float, checkpoint: float, profile: float, wall: float
) -> dict[str, float]:
    """The split of a session killed before its session_end, from the events it did write (its wall clock ends
    at its last line); the report phase is not in the events, so it stays inside other."""
    times = {"train_seconds": train, "eval_seconds": eval_, "checkpoint_seconds": checkpoint,
             "profile_seconds": profile, "report_seconds": 0.0, "wall_seconds": wall}
    times["other_seconds"] = max(0.0, wall - sum(times[k] for k in SPLIT_PHASES if k != "other_seconds"))
    return times
