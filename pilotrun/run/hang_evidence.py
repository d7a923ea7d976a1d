"""A session that hung on a rank other than 0 may leave no session_end: with rank 0 the stuck one (a stopped
process, a dead read), only the waiting rank's watchdog fires, writes its stacks to RUN/hangs/ and exits, and
torchrun ends rank 0 with nothing recorded. The stack file is the evidence: one written while a session
without a session_end ran (its name carries the UTC time it was written and the rank) says the session hung,
not that it was killed.

One rule, read by two: the next session's start (rank 0, before training) records what it finds as a
`hang_found` event naming the session, the rank and the stack file, so the record itself says it; summarize
counts such a session hung, from the files or from that event (the files may have been cleared since).
"""

from __future__ import annotations

import datetime
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pilotrun.run.record import HANGS_DIR
from pilotrun.run.values import is_finite_number

STACK_NAME = re.compile(r"^(\d{8}T\d{6}Z)-rank(\d+)\.txt$")


@dataclass(frozen=True)
class HangEvidence:
    """A session's hang as a stack file shows it: the session, the rank that wrote it, the file's name."""

    session_id: str
    rank: int
    stacks: str  # a name under RUN/hangs/

    def path(self) -> str:
        return f"{HANGS_DIR}/{self.stacks}"


def stack_files(run_dir: Path) -> list[tuple[float, str]]:
    """(epoch seconds written, name) of every rank's stack file, oldest first."""
    folder = run_dir / HANGS_DIR
    if not folder.is_dir() or folder.is_symlink():
        return []
    found = []
    for path in folder.iterdir():
        match = STACK_NAME.match(path.name)
        if match:
            when = datetime.datetime.strptime(match.group(1), "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.UTC)
            found.append((when.timestamp(), path.name))
    return sorted(found)


def hung_without_an_end(run_dir: Path, sessions: list[tuple[str, bool]], starts: dict[str, float],
                        until: float = math.inf) -> dict[str, HangEvidence]:
    """session id -> the evidence that it hung, for each session with no session_end during which (from its
    first event to the next session's, or to `until` for the last) a rank wrote its stacks. `sessions`:
    (session id, has a session_end) in record order; `starts`: session id -> its first event's time. The
    file's name has whole seconds: it counts from the second the session started."""
    stacks, found = stack_files(run_dir), {}
    for index, (session_id, ended) in enumerate(sessions):
        if ended:
            continue
        begin = int(starts.get(session_id, 0.0))
        following = sessions[index + 1][0] if index + 1 < len(sessions) else None
        end = starts.get(following, until) if following is not None else until
        during = [name for when, name in stacks if begin <= when < end]
        if during:
            rank = int(STACK_NAME.match(during[0]).group(2))
            found[session_id] = HangEvidence(session_id, rank, during[0])
    return found


def sessions_of(events: list[dict[str, Any]]) -> tuple[list[tuple[str, bool]], dict[str, float]]:
    """The record's sessions in order, each with whether it has a session_end, and each one's first time."""
    order: list[str] = []
    ended: set[str] = set()
    starts: dict[str, float] = {}
    for event in events:
        sid = event.get("session_id")
        if not isinstance(sid, str) or event.get("event") == "evaluation":
            continue  # an evaluation is outside any session
        if sid not in starts and is_finite_number(event.get("time")):
            order.append(sid)
            starts[sid] = float(event["time"])
        if event.get("event") == "session_end":
            ended.add(sid)
    return [(sid, sid in ended) for sid in order], starts


def recorded_hangs(events: list[dict[str, Any]]) -> dict[str, HangEvidence]:
    """The hangs a later session's start recorded (`hang_found` events), by the session they name."""
    found = {}
    for event in events:
        if event.get("event") == "hang_found" and isinstance(event.get("hung_session"), str):
            sid, name = event["hung_session"], str(event.get("stack_file", "")).removeprefix(f"{HANGS_DIR}/")
            found[sid] = HangEvidence(sid, int(event.get("rank", -1)), name)
    return found


def unrecorded_hangs(run_dir: Path, events: list[dict[str, Any]], until: float) -> list[HangEvidence]:
    """What a new session's start finds: earlier sessions without a session_end that a rank's stack file shows
    hung (files written before `until`, the new session's start), and that no `hang_found` event names yet."""
    sessions, starts = sessions_of(events)
    known = recorded_hangs(events)
    found = hung_without_an_end(run_dir, sessions, starts, until)
    return [evidence for sid, evidence in found.items() if sid not in known]
