"""The run record in one place: its schema, its writer and its two readers (torch-free).

A run folder holds `run.json` (rewritten atomically, a handful of times per session) and `metrics.jsonl`
(one JSON object a line, appended and flushed). docs/RUN_RECORD.md describes every field; this module owns
the names that writer and readers share, so they cannot drift apart:

- file names (RUN_JSON, METRICS_JSONL), event kinds (EVENTS), session-end reasons (SESSION_END_REASONS);
- `Counters`, the four counters every event carries (step, tokens_seen, updates_attempted,
  updates_skipped), used by the trainer, the writer, summarize and verdict;
- the writer: `MetricsWriter` (metrics.jsonl) and `RunRecord` (run.json). Only rank 0 writes; other ranks
  get `enabled=False` writers that do nothing, so the trainer calls them unconditionally;
- two readers of metrics.jsonl, built on one parser: `read_metrics_tolerant` (summarize, verdict, reports:
  damage is collected as reasons, never raised) and `read_metrics_strict` (tools that must not act on a
  damaged record, such as inspect-batch: the first damaged line raises RecordError).

Non-finite floats (a NaN loss, an infinite grad norm) are written as the strings "NaN", "Infinity" and
"-Infinity" so that every line is strict JSON (Python's json would otherwise write bare NaN, which other
readers reject); both readers turn them back into floats.

A process killed mid-write can leave the last line of metrics.jsonl torn (a prefix of a JSON object with no
newline). A crash explains that, so it is a note, not damage; the writer cuts such a tail before a resumed
session appends. Should a torn fragment still be followed by a new session's `session_start` on the same
line, the event is recovered and the fragment noted. Any other unreadable line is damage.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pilotrun.errors import PilotrunError
from pilotrun.files import write_text_atomic

RUN_JSON = "run.json"
METRICS_JSONL = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
REPORT_DIR = "report"

EVENTS = ("session_start", "train", "val", "checkpoint", "overflow", "data_restart", "qk_clip", "session_end")
SESSION_END_REASONS = ("completed", "interrupted", "error", "stopped")
COUNTER_KEYS = ("step", "tokens_seen", "updates_attempted", "updates_skipped")
# The `window` object of a `train` event: what summarize reconciles against the counters' growth.
WINDOW_COUNT_KEYS = ("updates_applied", "updates_attempted", "updates_skipped", "microbatches", "tokens")
# A `qk_clip` event is logged for a head clipped for the first time or with gamma below this. The writer is
# pilotrun.optim.qk_clip (HARD_CLIP_GAMMA, which imports it from here), the reader is summarize.
QK_CLIP_HARD_GAMMA = 0.5
NONFINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# Free-text fields where the word "NaN" is text, not a number.
TEXT_KEYS = {"event", "session_id", "reason", "message", "path", "mfu", "device", "device_name"}


class RecordError(PilotrunError):
    """Not a readable run folder (no run.json, unreadable JSON), or damage a strict reader refuses: exit 2."""


@dataclass(frozen=True)
class Counters:
    """The counters every event carries. `tokens_seen` advances per processed microbatch, `step` only on an
    applied update; `updates_attempted = step + updates_skipped` within one lineage."""

    step: int = 0
    tokens_seen: int = 0
    updates_attempted: int = 0
    updates_skipped: int = 0

    @classmethod
    def of(cls, event: dict[str, Any]) -> Counters:
        return cls(*(int(event[k]) for k in COUNTER_KEYS))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def covers(self, other: Counters) -> bool:
        """True when `other` happened no later than these counters (used to cut a session at a checkpoint)."""
        return other.updates_attempted <= self.updates_attempted and other.tokens_seen <= self.tokens_seen


# ---------------------------------------------------------------------------------------------- JSON form
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


def restore_nonfinite(value: Any, key: str = "") -> Any:
    """Turn the writer's "NaN"/"Infinity"/"-Infinity" strings back into floats (recursively)."""
    if isinstance(value, str) and key not in TEXT_KEYS and value in NONFINITE_STRINGS:
        return NONFINITE_STRINGS[value]
    if isinstance(value, dict):
        return {k: restore_nonfinite(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [restore_nonfinite(v, key) for v in value]
    return value


def dumps_line(record: dict[str, Any]) -> str:
    return json.dumps(json_safe(record), allow_nan=False, separators=(",", ":"))


def write_json_atomic(path: str | Path, data: Any) -> None:
    """run.json and friends: a crash at any moment leaves the old file or the new one, never half of one."""
    write_text_atomic(path, json.dumps(json_safe(data), indent=2, sort_keys=False, allow_nan=False) + "\n")


def nonfinite_fields(value: Any, prefix: str = "") -> list[str]:
    """Dotted names of every non-finite number inside an event (lists shown as name[i])."""
    found: list[str] = []
    if isinstance(value, float):
        if not math.isfinite(value):
            found.append(prefix or "value")
    elif isinstance(value, dict):
        for k, v in value.items():
            if k.startswith("_"):
                continue
            found.extend(nonfinite_fields(v, f"{prefix}.{k}" if prefix else k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found.extend(nonfinite_fields(v, f"{prefix}[{i}]"))
    return found


def is_finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------- readers
def read_run_json(run_dir: str | Path) -> dict[str, Any]:
    """run.json as a dict. A missing folder or file, or an unreadable file, is a RecordError (bad input)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RecordError(f"run folder not found: {run_dir}")
    path = run_dir / RUN_JSON
    if not path.is_file():
        raise RecordError(f"{path}: not found (is {run_dir} a run folder written by `pilotrun train`?)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # torn, not UTF-8, unreadable: damage to name, never a traceback
        raise RecordError(f"{path}: unreadable run record ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise RecordError(f"{path}: expected a JSON object at the top level")
    return data


@dataclass
class ParsedMetrics:
    """metrics.jsonl as read: events in file order, each carrying `_line` (its 1-based line number)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # torn lines a crash explains: reported, not fatal
    damage: list[str] = field(default_factory=list)  # unreadable lines nothing explains: the record is invalid
    missing: bool = False  # no metrics.jsonl at all


def _parse_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _recover_after_torn_fragment(text: str) -> tuple[dict[str, Any], int] | None:
    """A torn fragment followed (same line) by a complete object: return that object and its offset."""
    start = text.find("{", 1)
    while start > 0:
        value = _parse_object(text[start:])
        if value is not None:
            return value, start
        start = text.find("{", start + 1)
    return None


def _event_problem(event: dict[str, Any]) -> str | None:
    missing = [k for k in ("event", "session_id", *COUNTER_KEYS) if k not in event]
    if missing:
        return f"event lacks {', '.join(missing)}"
    if event["event"] not in EVENTS:
        return f"unknown event '{event['event']}'"
    bad = [k for k in COUNTER_KEYS if not _is_int(event[k]) or event[k] < 0]
    if bad:
        return f"counter(s) {', '.join(bad)} not a non-negative integer"
    return None


def parse_metrics_bytes(raw: bytes) -> ParsedMetrics:
    """The one parser of metrics.jsonl; both readers below are built on it."""
    parsed = ParsedMetrics()
    lines = raw.split(b"\n")
    ends_with_newline = raw.endswith(b"\n")
    if ends_with_newline:
        lines = lines[:-1]  # the empty string after the final newline
    for index, raw_line in enumerate(lines):
        number = index + 1
        is_last = index == len(lines) - 1
        try:
            text = raw_line.decode("utf-8")
        except UnicodeDecodeError as exc:
            if not (is_last and not ends_with_newline):  # a torn last line may end mid-character: judged below
                parsed.damage.append(f"metrics.jsonl line {number}: not UTF-8 (byte 0x{raw_line[exc.start]:02x} "
                                     f"at column {exc.start + 1})")
                continue
            text = raw_line.decode("utf-8", errors="replace")
        if not text.strip():
            if not is_last:
                parsed.damage.append(f"metrics.jsonl line {number}: empty line")
            continue
        event = _parse_object(text)
        if event is None and is_last and not ends_with_newline:
            parsed.notes.append(f"metrics.jsonl line {number}: torn last line ({len(raw_line)} bytes, a crash "
                                "mid-write); ignored")
            continue
        if event is None:
            recovered = _recover_after_torn_fragment(text)
            if recovered is not None and recovered[0].get("event") == "session_start":
                event, offset = recovered
                parsed.notes.append(f"metrics.jsonl line {number}: torn fragment ({offset} bytes, a crash "
                                    "mid-write) before a resumed session's session_start; fragment ignored")
            else:
                parsed.damage.append(f"metrics.jsonl line {number}: not a JSON object ({text[:60]!r})")
                continue
        problem = _event_problem(event)
        if problem is not None:
            parsed.damage.append(f"metrics.jsonl line {number}: {problem}")
            continue
        event = restore_nonfinite(event)
        event["_line"] = number
        parsed.events.append(event)
    return parsed


def read_metrics_tolerant(run_dir: str | Path) -> ParsedMetrics:
    """For summarize, verdict and reports: every readable event, with notes and damage listed, never raised.
    A missing metrics.jsonl is damage too."""
    path = Path(run_dir) / METRICS_JSONL
    if not path.is_file():
        parsed = ParsedMetrics(missing=True)
        parsed.damage.append(f"{path}: not found" if not path.exists() else f"{path}: not a file")
        return parsed
    try:
        raw = path.read_bytes()
    except OSError as exc:
        parsed = ParsedMetrics(missing=True)
        parsed.damage.append(f"{path}: cannot be read ({exc.strerror or exc})")
        return parsed
    return parse_metrics_bytes(raw)


def read_metrics_strict(run_dir: str | Path) -> list[dict[str, Any]]:
    """For tools that must not act on a damaged record (inspect-batch, tests): the events, or RecordError
    naming the first damaged line. A torn last line (a crash mid-write, or a line being written right now)
    is not damage and is left out; a folder whose session has not opened its log yet has no events."""
    path = Path(run_dir) / METRICS_JSONL
    if os.path.lexists(path) and (path.is_symlink() or not path.is_file()):
        raise RecordError(f"{path}: not a regular file")
    if not path.is_file():
        return []
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RecordError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    parsed = parse_metrics_bytes(raw)
    if parsed.damage:
        raise RecordError(f"{path}: damaged record: {parsed.damage[0]}"
                          + (f" (and {len(parsed.damage) - 1} more)" if len(parsed.damage) > 1 else ""))
    return parsed.events


# ---------------------------------------------------------------------------------------------- writers
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
    """

    def __init__(self, run_dir: str | Path, session_id: str, enabled: bool = True):
        self.path = Path(run_dir) / METRICS_JSONL
        self.session_id = session_id
        self.enabled = enabled
        self.repaired_bytes = repair_torn_tail(self.path) if enabled else 0
        self._file = open(self.path, "a", encoding="utf-8") if enabled else None

    def log(self, event: str, counters: Counters, **fields: Any) -> dict[str, Any] | None:
        if event not in EVENTS:
            raise ValueError(f"unknown metrics event '{event}'")
        if not self.enabled:
            return None
        record = {"event": event, "time": time.time(), "session_id": self.session_id, **counters.as_dict()}
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
            raise RecordError(f"{metrics}: not a regular file; the run record cannot be continued")
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
