"""The run record: run.json (rewritten atomically) and metrics.jsonl (appended, flushed per line).

docs/RUN_RECORD.md is the schema; `pilotrun summarize` and `verdict` read exactly what is written here.
Only rank 0 writes: other ranks get a `MetricsLog(enabled=False)` whose `log` does nothing, so the
trainer can call it unconditionally.

Non-finite floats (a NaN loss, an infinite grad norm) are written as the strings "NaN", "Infinity" and
"-Infinity" so that every line is strict JSON (Python's json would otherwise write bare NaN, which
other readers reject); `float(value)` reads them back.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from pilotrun.errors import PilotrunError
from pilotrun.files import write_text_atomic

RUN_JSON = "run.json"
METRICS_JSONL = "metrics.jsonl"

EVENTS = ("session_start", "train", "val", "checkpoint", "overflow", "data_restart", "qk_clip", "session_end")
SESSION_END_REASONS = ("completed", "interrupted", "error", "stopped")


def json_safe(value: Any) -> Any:
    """Recursively replace non-finite floats by strings and tuples by lists; everything else is kept.

    Finite floats are left as Python floats, whose JSON form (repr) round-trips exactly: the loss is
    written at full precision.
    """
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def dumps_line(record: dict[str, Any]) -> str:
    return json.dumps(json_safe(record), allow_nan=False, separators=(",", ":"))


def write_json_atomic(path: str | Path, data: Any) -> None:
    """run.json and friends: a crash at any moment leaves the old file or the new one, never half of one."""
    write_text_atomic(path, json.dumps(json_safe(data), indent=2, sort_keys=False, allow_nan=False) + "\n")


def read_run_json(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / RUN_JSON
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:  # torn, not UTF-8, a folder: damage to report, not a traceback
        raise PilotrunError(f"{path}: unreadable run record ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise PilotrunError(f"{path}: expected a JSON object at the top level")
    return data


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every complete line of metrics.jsonl, parsed (a torn last line from a crash is ignored)."""
    path = Path(run_dir) / METRICS_JSONL
    if not path.exists():
        return []
    records = []
    try:
        raw_lines = path.read_bytes().split(b"\n")[:-1]  # the part after the last newline: torn, ignored
    except OSError as exc:
        raise PilotrunError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except ValueError as exc:  # UnicodeDecodeError included: name this line, not an offset in the file
            raise PilotrunError(f"{path} line {number}: not a JSON object ({' '.join(str(exc).split())})") from None
        if not isinstance(record, dict):
            raise PilotrunError(f"{path} line {number}: not a JSON object")
        records.append(record)
    return records


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


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl and flushes it, so a reader (or a crash) sees
    every completed event. `fsync()` is called at checkpoints and at the end of a session.
    """

    def __init__(self, run_dir: str | Path, session_id: str, enabled: bool = True):
        self.path = Path(run_dir) / METRICS_JSONL
        self.session_id = session_id
        self.enabled = enabled
        self.repaired_bytes = repair_torn_tail(self.path) if enabled else 0
        self._file = open(self.path, "a", encoding="utf-8") if enabled else None

    def log(self, event: str, *, step: int, tokens_seen: int, updates_attempted: int, updates_skipped: int,
            **fields: Any) -> dict[str, Any] | None:
        if event not in EVENTS:
            raise ValueError(f"unknown metrics event '{event}'")
        if not self.enabled:
            return None
        record = {"event": event, "time": time.time(), "session_id": self.session_id, "step": int(step),
                  "tokens_seen": int(tokens_seen), "updates_attempted": int(updates_attempted),
                  "updates_skipped": int(updates_skipped)}
        record.update(fields)
        assert self._file is not None
        self._file.write(dumps_line(record) + "\n")
        self._file.flush()
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
        record = {"run_id": run_id, "tokens_per_update": int(tokens_per_update), "model": model,
                  "optimizer": optimizer, "recipe": recipe, "data": data, "allowed_changes": [], "sessions": []}
        return cls(run_dir, record, enabled)

    @classmethod
    def load(cls, run_dir: str | Path, enabled: bool = True) -> RunRecord:
        metrics = Path(run_dir) / METRICS_JSONL
        if os.path.lexists(metrics) and (metrics.is_symlink() or not metrics.is_file()):
            # Refused before run.json gains a session that could never log an event.
            raise PilotrunError(f"{metrics}: not a regular file; the run record cannot be continued")
        return cls(run_dir, read_run_json(run_dir), enabled)

    def add_session(self, session: dict[str, Any]) -> None:
        self.data["sessions"].append(session)

    def record_allowed_changes(self, session_id: str, changes: list[dict[str, Any]]) -> None:
        for change in changes:
            self.data["allowed_changes"].append({"session_id": session_id, **change})

    def save(self) -> None:
        if self.enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.run_dir / RUN_JSON, self.data)
