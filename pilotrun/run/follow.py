"""Reading a run record as it grows (torch-free): what `pilotrun watch` stands on.

A live trainer appends one line at a time to metrics.jsonl (record.py), so a reader that opens the file at any
moment may find its last line torn: the writer is halfway through it. `RecordFollower` keeps the byte offset
of the last complete line it has read and, at each `poll`, reads only what lies beyond it; a line without its
newline is left for the next poll (it is the writer's, not damage). Each complete line is parsed by the
record's own parser (`parse_metrics_bytes`) and chained on from the previous line's value with the record's
own chain functions, so an edited, removed or reordered line is found as soon as it is read, without rereading
the log.

Two things a live log can do that a finished one cannot:
- a resumed session cuts a torn tail (a crash mid-write) before it appends: the file then holds fewer bytes
  than were seen, only ever within the incomplete line; a file that shrank below a complete line read before
  was rewritten, and that is a break of the record, never a repair;
- a new session's `session_start` may follow a torn fragment on the same line (record.py recovers it): the
  parser's note is passed on.

The follower reads through a `RunFolder` (run_folder.py), the one reader of the run folder: the folder reads
the bytes appended since its last read, the follower takes them from there in pieces of at most POLL_BYTES,
and the rules judged on the same folder (`summarize_run(folder)`) read none of them again. It only opens files
for reading: it never writes into the run folder and never takes its lock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pilotrun.run.record import (
    METRICS_JSONL,
    RecordError,
    chain_genesis,
    chain_link,
    not_utf8_problem,
    parse_metrics_bytes,
    unchained_body,
)
from pilotrun.run.run_folder import RunFolder

# The most bytes one poll reads, so that catching up on a long run's log happens in bounded pieces.
POLL_BYTES = 8 << 20


@dataclass
class Poll:
    """What one poll found beyond the previous one."""

    events: list[dict[str, Any]] = field(default_factory=list)  # new complete events, each with `_line`
    breaks: list[str] = field(default_factory=list)  # hash chain breaks and unreadable lines, one reason each
    notes: list[str] = field(default_factory=list)  # torn fragments a crash explains
    pending_bytes: int = 0  # bytes of an incomplete last line left for the next poll


class RecordFollower:
    """Incremental reader of RUN/metrics.jsonl with its hash chain checked line by line."""

    def __init__(self, run: RunFolder | str | Path, *, chained: bool = True):
        """`chained` False: the events only, for a reader that shows progress and judges nothing (the pilot's
        line, which may start before the child has written run.json): no run.json read, no chain checked."""
        self.chained = chained
        # A folder that is not a run: RecordError (bad input), unless only its events are wanted.
        self.folder = (
            RunFolder.of(run) if chained or isinstance(run, RunFolder) else RunFolder(run, run_json=False)
        )
        self.run_dir = self.folder.path
        run_id = self.folder.run_id if chained else ""
        if not isinstance(run_id, str):
            raise RecordError(f"{self.run_dir / 'run.json'}: run_id is not a string; not a run folder")
        self.run_id = run_id
        self.path = self.run_dir / METRICS_JSONL
        self.offset = 0  # bytes of complete lines read so far
        self.lines = 0  # complete lines read so far
        # the chain value of the last complete line (the genesis before any)
        self.head = chain_genesis(run_id)
        self.broken = False  # once the chain broke, later lines are chained from what they say, not rejudged
        self.named_pending: int | None = None  # the number of an incomplete line already named as not UTF-8
        self.rewrites = self.folder.rewrites  # the folder's rewrites this follower has named
        # the folder watched: another one at its path is not read
        self.identity = _folder_identity(self.run_dir)
        self.replaced_named = False

    @property
    def run(self) -> dict[str, Any]:
        """run.json as the folder last read it."""
        return self.folder.run

    def poll(self) -> Poll:
        """Read every complete line appended since the last poll."""
        found = Poll()
        now = _folder_identity(self.run_dir)
        if self.identity is None and now is not None and now != (-1, -1):
            self.identity = now  # the folder appeared after following began (a child about to start its run)
        if now != self.identity:  # swapped for a link or another folder: its record is not this run's
            if not self.replaced_named:
                what = (f"a symbolic link to {os.readlink(self.run_dir)}" if os.path.islink(self.run_dir) else
                        "gone" if now is None else "another folder")
                found.breaks.append(
                    f"{self.run_dir}: the run folder was replaced after watching began (it is now "
                    f"{what}); nothing is read through it"
                )
                self.replaced_named = True
            return found
        if os.path.lexists(self.path) and (self.path.is_symlink() or not self.path.is_file()):
            found.breaks.append(f"{self.path}: not a regular file")
            return found
        self.folder.read_metrics()  # only what was appended since the folder's last read
        if self.folder.rewrites != self.rewrites:
            found.breaks.append(
                f"metrics.jsonl: {self.folder.rewrite_reason}; everything is read again from its "
                "start, chained afresh"
            )
            self.rewrites = self.folder.rewrites
            self._restart()
            return found
        absent = self.folder.metrics_absent
        if absent is not None:
            if os.path.lexists(self.path):  # there but unreadable: bad input, named in one line
                raise RecordError(absent)
            return found  # the session has not opened its log yet
        raw = self.folder.metrics_bytes(self.offset, POLL_BYTES)
        end = raw.rfind(b"\n")
        if end < 0 and len(raw) == POLL_BYTES:  # one line longer than a whole poll: no line the writer writes
            self._skip_long_line(found)
            return found
        found.pending_bytes = len(raw) - (end + 1)
        if end >= 0:
            for raw_line in raw[:end].split(b"\n"):
                self.lines += 1
                self._read_line(raw_line, found)
            self.offset += end + 1
        self._judge_pending(raw[end + 1:], found)
        return found

    def poll_to_end(self) -> Poll:
        """Polls until one reads nothing more, as one Poll: for a reader that looks once (one-shot watch),
        which a single bounded poll would leave before a long line with the rest of the record unread."""
        found = self.poll()
        while True:
            before = (self.offset, self.lines)
            more = self.poll()
            found.events += more.events
            found.breaks += more.breaks
            found.notes += more.notes
            found.pending_bytes = more.pending_bytes
            if (self.offset, self.lines) == before:
                return found

    def _skip_long_line(self, found: Poll) -> None:
        """A line of more than POLL_BYTES is named once, and passed over once its newline is there (the chain
        breaks at the line after it, which follows from it); never waited for in silence."""
        number = self.lines + 1
        newline = self.folder.metrics_newline_after(self.offset)
        if self.named_pending != number:
            found.breaks.append(
                f"metrics.jsonl line {number}: longer than {POLL_BYTES >> 20} MiB (the writer's lines "
                "are kilobytes); not parsed, passed over"
            )
            self.named_pending = number
        if newline is not None:
            self.lines += 1
            self.offset = newline + 1

    def _judge_pending(self, pending: bytes, found: Poll) -> None:
        """An incomplete last line waits for its newline, but an invalid byte inside it (not a character cut
        at its end) is damage no later write can mend: named by its line number, once."""
        if not pending or self.named_pending == self.lines + 1:
            return
        problem = not_utf8_problem(pending, self.lines + 1, unterminated=True)
        if problem is not None:
            found.breaks.append(problem)
            self.named_pending = self.lines + 1

    def _restart(self) -> None:
        """After a rewrite nothing read before can be trusted: read again from the start, chained afresh."""
        self.offset, self.lines, self.head = 0, 0, chain_genesis(self.run_id)
        self.named_pending = None

    def _read_line(self, raw_line: bytes, found: Poll) -> None:
        number = self.lines
        parsed = parse_metrics_bytes(raw_line + b"\n")
        found.notes.extend(_renumber(n, number) for n in parsed.notes)
        if parsed.damage or not parsed.events:
            reasons = [_renumber(d, number) for d in parsed.damage or ["metrics.jsonl line 1: empty line"]]
            if number == self.named_pending:  # named while it waited for its newline: not twice
                reasons = [r for r in reasons if "not UTF-8" not in r]
            found.breaks.extend(reasons)
            return
        event, text = parsed.events[0], parsed.texts[0]
        event["_line"] = number
        if not self.chained:
            found.events.append(event)
            return
        where = f"metrics.jsonl line {number} ({event.get('event')}, step {event.get('step')})"
        split = unchained_body(text)
        if split is None:
            found.breaks.append(
                f"{where}: no hash chain field; the line was not written by pilotrun's writer, or edited"
            )
        else:
            body, value = split
            if chain_link(self.head, body) != value:
                found.breaks.append(
                    f"{where}: hash chain broken: it does not follow from the line before it "
                    "(this line was edited, or lines before it were removed, added or reordered)"
                )
            self.head = value
        found.events.append(event)


def _folder_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the folder itself, never of what a link at its path points to; None when gone."""
    try:
        stat = os.lstat(path)
    except OSError:
        return None
    return (stat.st_dev, stat.st_ino) if not os.path.islink(path) else (-1, -1)


def _renumber(reason: str, number: int) -> str:
    """The parser saw one line as line 1; name it by its place in the file."""
    return reason.replace("metrics.jsonl line 1", f"metrics.jsonl line {number}", 1)
