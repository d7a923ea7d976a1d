"""One reader of a run folder (torch-free): run.json, metrics.jsonl and the checkpoint markers, each read
once.

`summarize`, `verdict` and `watch` judge the same three things: run.json (the run's identity, recipe and
sessions), metrics.jsonl (the hash-chained log) and each committed checkpoint's COMMITTED.json marker. A
`RunFolder` reads them once, with the record's own readers (record.py, marker.py), and holds what it read, so
that summarize, the rules behind the verdict and watch's alerts all look at the same bytes: the verdict's two
summaries (the second one with `--require-step`) read nothing again, and watch's judgement of the rules reads
none of the log its follower already read.

A finished run is read once and for all. A live run grows, and `watch` follows it:
- `read_metrics()` reads only what metrics.jsonl holds beyond its complete lines read so far (an incomplete
  last line is read again next time: the writer is halfway through it, or a resumed session cuts it before
  appending); it does not open the file when its size, inode and modification time are what they were. A file
  shorter than the complete lines read was rewritten: everything is read again from its start and `rewrites`
  counts it (run/follow.py names it as a break of the record);
- `refresh()` reads run.json again only when it was replaced (the writer rewrites it by an atomic rename, so
  its inode, size or time changes) and lists the checkpoint folders again; a marker is read again only when
  its file was replaced (a checkpoint committed again at the same step after a rollback);
- `snapshot()` makes what is held one consistent view of a run that may be writing right now: run.json and the
  markers first, metrics.jsonl after them. The trainer writes a line before the marker or the run.json entry
  that names it (a checkpoint's chain head, a session's chain_start and chain_end), so a log read after them
  holds every line they name; read before them, a checkpoint committed in between would name a line not yet
  read and the record would look rewritten. When run.json was replaced while the log was read (a session began
  or ended), it is read again.

`metrics` is what `read_metrics_tolerant` would return for the bytes read (record.py's parser over all of
them, damage and notes collected, never raised). The folder only ever opens files for reading.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pilotrun.run.marker import (
    MARKER_NAME,
    checkpoint_problems,
    committed_checkpoint_steps,
    marker_run_id,
    read_marker,
    step_folder,
)
from pilotrun.run.record import METRICS_JSONL, RUN_JSON, ParsedMetrics, parse_metrics_bytes, read_run_json

# Bytes of the lines already read that each read compares with the file: the last ones, and one more piece.
VERIFY_BYTES = 64 << 10
# What tells a file that was replaced or grew from one that was not, without opening it.
FileKey = tuple[int, int, int, int]


def file_key(path: Path) -> FileKey | None:
    """(inode, size, modification and change time in ns) of the file `path` names, or None when there is
    none."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


class RunFolder:
    """A run folder read once: `run` (run.json), `metrics` (metrics.jsonl parsed) and the checkpoint markers.

    Opening one reads run.json (RecordError when the folder or run.json is missing or unreadable: bad input);
    metrics.jsonl is read at first need, the markers at first need each."""

    def __init__(self, path: str | Path, *, run_json: bool = True):
        """`run_json` False: the log only (`run` stays empty, and bytes already read are not read again to
        look for an in-place edit), for a reader of a session's progress that may start before the session has
        written run.json."""
        self.path = Path(path)
        self.run: dict[str, Any] = read_run_json(self.path) if run_json else {}
        # re-read the bytes before the offset to find an in-place edit (watch, judges)
        self._verify_read = run_json
        self._run_key = file_key(self.path / RUN_JSON)
        self._raw = bytearray()  # metrics.jsonl as read: its complete lines, then the incomplete tail if any
        self._complete = 0  # bytes of complete lines in _raw
        self._log_key: FileKey | None = None  # the file as it was when last read
        self._absent: str | None = None  # why metrics.jsonl could not be read at the last try
        self._read_once = False
        self._parsed: ParsedMetrics | None = None
        self.rewrites = 0  # times metrics.jsonl was found shorter than the complete lines read before
        self.rewritten_from: tuple[int, int] = (0, 0)
        self.rewrite_reason = ""  # what the last rewrite was: truncated, replaced, or a line edited in place
        # where the next piece of the lines read is compared with the file  # (bytes found, bytes of complete
        # lines read) at the last
        self._verify_at = 0
        self._steps: list[int] | None = None
        self._markers: dict[int, tuple[FileKey | None, tuple[dict[str, Any] | None, str | None]]] = {}

    @classmethod
    def of(cls, run: RunFolder | str | Path) -> RunFolder:
        """`run` itself when it is already a RunFolder, else that folder opened (callers that hold a path)."""
        return run if isinstance(run, RunFolder) else cls(run)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    @property
    def run_id(self) -> Any:
        return self.run.get("run_id")

    # -------------------------------------------------------------------------------------------- run.json
    def refresh(self) -> None:
        """For a run that is still being written: run.json read again when it was replaced, the checkpoint
        folders listed again at their next use (metrics.jsonl is read by `read_metrics`)."""
        key = file_key(self.path / RUN_JSON)
        if key is None or key != self._run_key:
            self.run = read_run_json(self.path)  # gone or unreadable now: RecordError, as on opening
            self._run_key = key
        self._steps = None

    def snapshot(self, attempts: int = 5) -> None:
        """One consistent view of a run that may be live (module docstring): run.json and the markers, then
        metrics.jsonl, again while run.json changed under the read (`attempts` at most; a run.json replaced on
        every try is judged as last read)."""
        for _ in range(attempts):
            self.refresh()
            self.checkpoint_heads()
            self.read_metrics()
            if file_key(self.path / RUN_JSON) == self._run_key:
                return

    # --------------------------------------------------------------------------------------------
    # metrics.jsonl
    def read_metrics(self) -> None:
        """Read what metrics.jsonl holds beyond the complete lines read so far (module docstring)."""
        path = self.path / METRICS_JSONL
        self._read_once = True
        # Checked as read_metrics_tolerant checks it (a link to a file is read through, as it always was).
        if not path.is_file():
            self._absent = f"{path}: not found" if not path.exists() else f"{path}: not a file"
            self._parsed = None
            return
        key = file_key(path)
        if key is not None and key == self._log_key and self._absent is None:
            return  # nothing was written since the last read
        try:
            with open(path, "rb") as handle:
                size = handle.seek(0, os.SEEK_END)
                changed = self._changed_before(handle, key) if size >= self._complete else None
                if size < self._complete or changed is not None:  # lines read before are gone: never repaired
                    self.rewrites += 1
                    self.rewritten_from = (size, self._complete)
                    self.rewrite_reason = changed or (
                        f"the file holds {size} bytes but {self._complete} bytes of "
                        "complete lines were read before: it was truncated"
                    )
                    self._raw.clear()
                    self._complete = 0
                handle.seek(self._complete)
                new = handle.read(size - self._complete)
        except OSError as exc:
            self._absent = f"{path}: cannot be read ({exc.strerror or exc})"
            self._parsed = None
            return
        self._absent, self._log_key = None, key
        del self._raw[self._complete:]
        self._raw += new
        end = new.rfind(b"\n")
        if end >= 0:
            self._complete += end + 1
        self._parsed = None

    def _changed_before(self, handle: Any, key: FileKey | None) -> str | None:
        """Why the complete lines already read are no longer what the file holds, or None: another file now at
        the path (its inode), or bytes before the offset that differ from those read (a line edited in place).
        Each read compares the last VERIFY_BYTES before the offset, and one more piece of the rest in turn, so
        that an edit anywhere is found within a bounded number of reads at a bounded cost each."""
        if not self._complete:
            return None
        if self._log_key is not None and key is not None and key[0] != self._log_key[0]:
            return "metrics.jsonl was replaced by another file (a new inode) after its lines were read"
        if not self._verify_read:  # a session's progress reader judges nothing: each byte is read once
            return None
        tail = max(0, self._complete - VERIFY_BYTES)
        if self._verify_at >= tail:
            self._verify_at = 0
        pieces = [(tail, self._complete - tail), (self._verify_at, min(VERIFY_BYTES, tail - self._verify_at))]
        self._verify_at += VERIFY_BYTES
        for start, length in pieces:
            if length <= 0:
                continue
            handle.seek(start)
            found = handle.read(length)
            held = bytes(self._raw[start:start + length])
            if found != held:
                at = start + next((i for i, (a, b) in enumerate(zip(found, held, strict=False)) if a != b),
                                  min(len(found), len(held)))
                line = self._raw.count(b"\n", 0, at) + 1
                return f"metrics.jsonl line {line} changed after it was read (edited in place)"
        return None

    def metrics_bytes(self, offset: int, limit: int) -> bytes:
        """At most `limit` bytes of metrics.jsonl from `offset`, as read so far (run/follow.py consumes
        them)."""
        return bytes(self._raw[offset:offset + limit])

    def metrics_newline_after(self, offset: int) -> int | None:
        """Where the next newline of metrics.jsonl lies from `offset`, in what was read so far (None: none
        yet)."""
        found = self._raw.find(b"\n", offset, self._complete)
        return found if found >= 0 else None

    @property
    def metrics_absent(self) -> str | None:
        """Why metrics.jsonl could not be read at the last try (missing, not a file, unreadable), or None."""
        return self._absent

    @property
    def metrics(self) -> ParsedMetrics:
        """metrics.jsonl parsed as read_metrics_tolerant parses it (read at first need)."""
        if not self._read_once:
            self.read_metrics()
        if self._absent is not None:
            parsed = ParsedMetrics(missing=True)
            parsed.damage.append(self._absent)
            return parsed
        if self._parsed is None:
            self._parsed = parse_metrics_bytes(bytes(self._raw))
        return self._parsed

    # -------------------------------------------------------------------------------------------- checkpoints
    def committed_steps(self) -> list[int]:
        """Steps of the committed checkpoint folders (a marker present), ascending; listed once per
        refresh."""
        if self._steps is None:
            self._steps = committed_checkpoint_steps(self.path)
        return list(self._steps)

    def marker(self, step: int) -> tuple[dict[str, Any] | None, str | None]:
        """(marker, None) for the committed checkpoint at `step`, or (None, why it cannot be trusted), as
        marker.read_marker says; the marker file is read again only when it was replaced."""
        key = file_key(step_folder(self.path, step) / MARKER_NAME)
        cached = self._markers.get(step)
        if cached is not None and key is not None and cached[0] == key:
            return cached[1]
        found = read_marker(self.path, step)
        self._markers[step] = (key, found)
        return found

    def checkpoint_heads(self) -> tuple[dict[int, Any], dict[int, str | None]]:
        """step -> the metrics chain head each committed checkpoint's marker recorded (None where it has
        none), and step -> the run_id its marker names (None for a marker older than run identity)."""
        heads, owners = {}, {}
        for step in self.committed_steps():
            marker, _problem = self.marker(step)
            meta = marker.get("meta") if marker is not None else None
            if isinstance(meta, dict):
                heads[step] = meta.get("metrics_chain_head")
                owners[step] = marker_run_id(marker)
        return heads, owners

    def checkpoint_problems(self, step: int) -> tuple[list[str], int, int]:
        """The checkpoint at `step` rehashed against its marker (marker.checkpoint_problems), this run's
        run_id the owner it must name; the marker is the one already read."""
        return checkpoint_problems(self.path, step, self.run_id, already_read=self.marker(step))
