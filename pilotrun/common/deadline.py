"""`pilotrun train --stop-by`: the wall-clock deadline a session must end (with a committed checkpoint)
before.

A job that reaches the end of its allocation is killed mid-update and loses the work since its last
checkpoint. `--stop-by` names the deadline as a time (ISO 8601, `2026-12-04T06:00`, local time unless it names
its zone, or `@EPOCH` seconds), a duration from the command's start (`90m`, `2h30m`, `45s`, `1d`), or `none`;
without it, SLURM_JOB_END_TIME (the allocation's end, epoch seconds, which SLURM sets in the job's
environment) is the deadline when set, as Megatron's CI derives `--exit-duration-in-mins` from it.

The deadline is fixed when the command starts, before any set-up: a budget counted from after set-up lands the
final save after the allocation died. The loop's deadline callback (training/callbacks/deadline_stop.py) then
stops in time by a margin it measures in the session. A deadline that cannot be understood, or is already
past, is bad input (exit 2) before anything is written; `check_room` refuses, before anything is written
too, a start whose deadline is closer than the run's record says the session needs to keep it (its set-up,
one update and a save), with its own exit code, `TOO_LATE_EXIT_CODE` (79): the same command would be
refused again in this allocation, and a scheduler should not retry it there.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping

from pilotrun.common.errors import PilotrunError
from pilotrun.common.stop_signals import TOO_LATE_EXIT_CODE

SLURM_END_VARIABLE = "SLURM_JOB_END_TIME"
DURATION_PATTERN = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
UNIT_SECONDS = (86400, 3600, 60, 1)


def parse_duration(text: str) -> float | None:
    """`2h30m` -> 9000.0; None when `text` is not a duration."""
    match = DURATION_PATTERN.match(text)
    if not text or match is None:
        return None
    return float(sum(int(part or 0) * unit for part, unit in zip(match.groups(), UNIT_SECONDS, strict=True)))


def parse_time(text: str) -> float | None:
    """`@1733300000` or an ISO 8601 date and time -> epoch seconds; None when `text` is neither."""
    if text.startswith("@"):
        try:
            return float(int(text[1:]))
        except ValueError:
            return None
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.astimezone()  # a time without its zone is the machine's local time
    return moment.timestamp()


def resolve_stop_by(text: str | None, now: float, environ: Mapping[str, str]) -> float | None:
    """The deadline in epoch seconds (None: no deadline), from `--stop-by` or SLURM_JOB_END_TIME; ValueError
    names what could not be understood, or a deadline already past."""
    where = "--stop-by"
    if text is None:
        text = environ.get(SLURM_END_VARIABLE)
        if text is None or not text.strip():
            return None
        where, text = SLURM_END_VARIABLE, f"@{text.strip()}"
    text = text.strip()
    if text.lower() == "none":
        return None
    duration = parse_duration(text.lower())
    deadline = now + duration if duration is not None else parse_time(text)
    if deadline is None:
        raise ValueError(
            f"{where} {text!r}: not a time (2026-12-04T06:00, @EPOCH) or a duration (90m, 2h30m, 45s); "
            "`none` for no deadline"
        )
    if deadline <= now:
        raise ValueError(f"{where} {text!r}: the deadline is already past "
                         f"({datetime.datetime.fromtimestamp(deadline).isoformat(timespec='seconds')})")
    return deadline


class TooLateToStart(PilotrunError, ValueError):
    """A start that cannot keep its deadline: not in this allocation (`TOO_LATE_EXIT_CODE`, not 2: the
    command was right, the allocation's time is what ran short). A ValueError too, as the deadline's other
    refusals are."""

    exit_code = TOO_LATE_EXIT_CODE


def check_room(deadline: float, now: float, seconds_per_update: float | None, *,
               setup_seconds: float | None = None, save_seconds: float | None = None) -> None:
    """Refuses (TooLateToStart) a start that cannot keep its deadline, as the run's record measured it: this
    session must set up (its fastest recorded set-up), train one update (its fastest) and save (the last
    save's seconds) before it. The set-up and the update at their fastest, so that a refusal
    is all but certain, not a guess; nothing recorded (a fresh run) is never refused."""
    if seconds_per_update is None:
        return
    left = deadline - now
    if left < seconds_per_update:
        raise TooLateToStart(
            f"--stop-by: {left:.1f} s remain before the deadline, less than one update of "
            f"this run (its fastest took {seconds_per_update:.1f} s): nothing could be trained; not started "
            f"in this allocation (exit {TOO_LATE_EXIT_CODE})"
        )
    setup, save = setup_seconds or 0.0, save_seconds or 0.0
    if left < setup + seconds_per_update + save:
        raise TooLateToStart(
            f"--stop-by: {left:.1f} s remain before the deadline, less than this session needs to keep it: "
            f"its set-up ({setup:.1f} s, the run's fastest), one update ({seconds_per_update:.1f} s) and a "
            f"save ({save:.1f} s, the last): not started in this allocation (exit {TOO_LATE_EXIT_CODE})"
        )
