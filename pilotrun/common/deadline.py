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
past, is bad input (exit 2) before anything is written; `check_room` refuses one shorter than one update of
the run's record.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping

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


def check_room(deadline: float, now: float, seconds_per_update: float | None) -> None:
    """A deadline closer than one update of this run (its fastest, as its record measured) leaves no update to
    do: refused."""
    if seconds_per_update is not None and deadline - now < seconds_per_update:
        raise ValueError(
            f"--stop-by: {deadline - now:.1f} s remain before the deadline, less than one update of "
            f"this run (its fastest took {seconds_per_update:.1f} s): nothing could be trained"
        )
