"""The run record's writer: metrics.jsonl appended one hash-chained line at a time, run.json rewritten
atomically.

The format (names, chain, readers) is pilotrun/run/record.py; this module only writes it. Only rank 0 writes;
other ranks get `enabled=False` writers that do nothing, so the trainer calls them unconditionally. A torn
last line left by a killed process is cut before a resumed session appends, and the chain continues from the
last complete line.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from pathlib import Path
from typing import Any

from pilotrun.common.files import open_for_write, refuse_link, remove_stale_temps, write_text_atomic
from pilotrun.common.strict_json import strict_dumps
from pilotrun.run.record import (
    CHAIN_KEY,
    EVENTS,
    METRICS_JSONL,
    RUN_JSON,
    Counters,
    RecordError,
    chained_line,
    last_chain_value,
    read_run_json,
)


def write_json_atomic(path: str | Path, data: Any) -> None:
    """run.json and friends: a crash at any moment leaves the old file or the new one, never half of one."""
    write_text_atomic(path, strict_dumps(data, indent=2, sort_keys=False) + "\n")



def repair_torn_tail(path: str | Path) -> int:
    """Cut a partial last line (a process killed mid-write) so appends start on a fresh line.

    Returns the number of bytes removed (0 when the file already ends with a newline or is empty).
    """
    path = Path(path)
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        # Walk back to the last newline in chunks; files are small but need not be.
        position = size
        keep = 0
        while position > 0:
            chunk_start = max(0, position - 65536)
            f.seek(chunk_start)
            chunk = f.read(position - chunk_start)
            index = chunk.rfind(b"\n")
            if index >= 0:
                keep = chunk_start + index + 1
                break
            position = chunk_start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return size - keep


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl and flushes it, so a reader (or a crash) sees
    every completed event. `fsync()` is called at checkpoints and at the end of a session.

    Each line carries its hash chain value (module docstring); `head` is the chain value of the last line
    written (None on ranks that do not write). `run_id` defaults to run.json's.
    """

    def __init__(self, run_dir: str | Path, session_id: str, enabled: bool = True, run_id: str | None = None):
        self.path = Path(run_dir) / METRICS_JSONL
        self.session_id = session_id
        self.enabled = enabled
        if run_id is None:
            run_json = Path(run_dir) / RUN_JSON
            run_id = str(read_run_json(run_dir).get("run_id", "")) if enabled and run_json.is_file() else ""
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # before the torn-tail repair, which truncates: never a file outside the run
            refuse_link(self.path)
        self.repaired_bytes = repair_torn_tail(self.path) if enabled else 0
        self.head: str | None = last_chain_value(self.path, run_id) if enabled else None
        self._file = open_for_write(self.path, "a") if enabled else None
        self._lock = threading.Lock()

    def log(self, event: str, counters: Counters, **fields: Any) -> dict[str, Any] | None:
        if event not in EVENTS:
            raise ValueError(f"unknown metrics event '{event}'")
        if not self.enabled:
            return None
        record = {"event": event, "time": time.time(), "session_id": self.session_id, **counters.as_dict()}
        record.update(fields)
        record.pop(CHAIN_KEY, None)  # the chain field is the writer's alone, and always the last
        with self._lock:  # the hang watchdog's thread may end the session while the main thread is stuck
            assert self._file is not None and self.head is not None
            line, value = chained_line(self.head, record)
            self._file.write(line + "\n")
            self._file.flush()
            self.head = value
        return record

    def fsync(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self.fsync()
            self._file.close()
            self._file = None


class RunRecord:
    """run.json held in memory and rewritten atomically on every change (a handful of times per session)."""

    def __init__(self, run_dir: str | Path, data: dict[str, Any], enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.data = data
        self.enabled = enabled

    @classmethod
    def create(cls, run_dir: str | Path, *, run_id: str, tokens_per_update: int, model: dict[str, Any],
               optimizer: dict[str, Any], recipe: dict[str, Any], data: dict[str, Any],
               enabled: bool = True) -> RunRecord:
        record = {
            "run_id": run_id,
            "tokens_per_update": int(tokens_per_update),
            "model": model,
            "optimizer": optimizer,
            "recipe": recipe,
            "data": data,
            "allowed_changes": [],
            "sessions": [],
        }
        return cls(run_dir, record, enabled)

    @classmethod
    def load(cls, run_dir: str | Path, enabled: bool = True) -> RunRecord:
        metrics = Path(run_dir) / METRICS_JSONL
        if os.path.lexists(metrics) and (metrics.is_symlink() or not metrics.is_file()):
            # Refused before run.json gains a session that could never log an event.
            raise RecordError(f"{metrics}: not a regular file; the run record cannot be continued")
        return cls(run_dir, read_run_json(run_dir), enabled)

    def add_session(self, session: dict[str, Any]) -> None:
        self.data["sessions"].append(session)

    def end_session(self, session_id: str, *, reason: str, chain_end: str | None) -> None:
        """Record where a session's lines end in the hash chain (the head after its session_end), so that
        lines removed from the end of the log show, and save."""
        for entry in self.data["sessions"]:
            if isinstance(entry, dict) and entry.get("session_id") == session_id:
                entry.update({"end_reason": reason, "chain_end": chain_end,
                              "ended_at": datetime.datetime.now(datetime.UTC).isoformat()})
        self.save()

    def record_allowed_changes(self, session_id: str, changes: list[dict[str, Any]]) -> None:
        for change in changes:
            self.data["allowed_changes"].append({"session_id": session_id, **change})

    def record_free_changes(self, session_id: str, changes: list[dict[str, Any]]) -> None:
        """The resume-free keys (config.RESUME_FREE_KEYS) this session changed: free, yet on the record, so
        that the run's recipe history is whole (run.json's `recipe` holds only the values in force now)."""
        for change in changes:
            self.data.setdefault("free_changes", []).append({"session_id": session_id, **change})

    def save(self) -> None:
        if self.enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(self.run_dir, RUN_JSON)  # a killed session's .run.json.tmp-PID
            write_json_atomic(self.run_dir / RUN_JSON, self.data)
