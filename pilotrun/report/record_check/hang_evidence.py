"""A session that hung on a rank other than 0 may leave no session_end: with rank 0 the stuck one (a stopped
process, a dead read), only the waiting rank's watchdog fires, writes its stacks to RUN/hangs/ and exits, and
torchrun ends rank 0 with nothing recorded. The stack file is the evidence: one written while a session
without a session_end ran (its name carries the UTC time it was written) says the session hung, not that it
was killed.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

from pilotrun.run.record import HANGS_DIR

STACK_NAME = re.compile(r"^(\d{8}T\d{6}Z)-rank(\d+)\.txt$")


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


def hung_without_an_end(run_dir: Path, sessions: list[Any], starts: dict[str, float]) -> dict[str, str]:
    """session id -> the stack file that shows it hung, for each session with no session_end during which
    (from its first event to the next session's) a rank wrote its stacks. `starts`: session id -> its first
    event's time. The file's name has whole seconds: it counts from the second the session started."""
    stacks, found = stack_files(run_dir), {}
    for index, summary in enumerate(sessions):
        if summary.end_reason is not None:
            continue
        begin = int(starts.get(summary.session_id, 0.0))
        following = sessions[index + 1].session_id if index + 1 < len(sessions) else None
        end = starts.get(following, float("inf")) if following is not None else float("inf")
        during = [name for when, name in stacks if begin <= when < end]
        if during:
            found[summary.session_id] = during[0]
    return found
