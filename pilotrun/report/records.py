"""Reading a run record back: run.json and metrics.jsonl, tolerant of what a crash legitimately leaves.

A process killed mid-write can leave the last line of metrics.jsonl torn (a prefix of a JSON object with
no newline). That is expected after a SIGKILL, so it is reported as a note, not an error. The trainer's
runlog cuts such a tail before a resumed session appends; should a torn fragment still be followed by a
new session's `session_start` on the same line, the event is recovered and the fragment noted. Any other
unreadable line is damage and becomes a reason the record is invalid.

The runlog writes non-finite floats as the strings "NaN", "Infinity" and "-Infinity" (strict JSON); they
are turned back into floats here so that every check sees numbers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pilotrun.errors import PilotrunError

RUN_JSON = "run.json"
METRICS_JSONL = "metrics.jsonl"
KNOWN_EVENTS = ("session_start", "train", "val", "checkpoint", "overflow", "data_restart", "qk_clip", "session_end")
# spec 3.4: a `qk_clip` event is logged for a head clipped for the first time or with gamma below this (the
# writer's pilotrun.optim.qk_clip.HARD_CLIP_GAMMA; the reader keeps its own copy, as KNOWN_EVENTS, torch-free).
QK_CLIP_HARD_GAMMA = 0.5
COUNTER_KEYS = ("step", "tokens_seen", "updates_attempted", "updates_skipped")
NONFINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# Free-text fields where the word "NaN" is text, not a number.
TEXT_KEYS = {"event", "session_id", "reason", "message", "path", "mfu", "device", "device_name"}


class RecordError(PilotrunError):
    """The folder is not a run folder (no run.json): bad input, exit 2."""


@dataclass
class MetricsLog:
    """Parsed metrics.jsonl: events in file order, each carrying `_line` (1-based line number)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # torn lines a crash explains: reported, not fatal
    damage: list[str] = field(default_factory=list)  # unreadable lines nothing explains: the record is invalid


def read_run_json(run_dir: str | Path) -> dict[str, Any]:
    """run.json as a dict. A missing folder or file is bad input; an unreadable file is a RecordError too."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RecordError(f"run folder not found: {run_dir}")
    path = run_dir / RUN_JSON
    if not path.is_file():
        raise RecordError(f"{path}: not found (is {run_dir} a run folder written by `pilotrun train`?)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RecordError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise RecordError(f"{path}: expected a JSON object at the top level")
    return data


def restore_nonfinite(value: Any, key: str = "") -> Any:
    """Turn the runlog's "NaN"/"Infinity"/"-Infinity" strings back into floats (recursively)."""
    if isinstance(value, str) and key not in TEXT_KEYS and value in NONFINITE_STRINGS:
        return NONFINITE_STRINGS[value]
    if isinstance(value, dict):
        return {k: restore_nonfinite(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [restore_nonfinite(v, key) for v in value]
    return value


def _parse_event(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _recover_after_torn_fragment(text: str) -> tuple[dict[str, Any], int] | None:
    """A torn fragment followed (same line) by a complete object: return that object and its offset."""
    start = text.find("{", 1)
    while start > 0:
        value = _parse_event(text[start:])
        if value is not None:
            return value, start
        start = text.find("{", start + 1)
    return None


def read_metrics(run_dir: str | Path) -> MetricsLog:
    path = Path(run_dir) / METRICS_JSONL
    log = MetricsLog()
    if not path.is_file():
        log.damage.append(f"{path}: not found" if not path.exists() else f"{path}: not a file")
        return log
    try:
        raw = path.read_bytes()
    except OSError as exc:
        log.damage.append(f"{path}: cannot be read ({exc.strerror or exc})")
        return log
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
                log.damage.append(f"metrics.jsonl line {number}: not UTF-8 (byte 0x{raw_line[exc.start]:02x} at "
                                  f"column {exc.start + 1})")
                continue
            text = raw_line.decode("utf-8", errors="replace")
        if not text.strip():
            if not is_last:
                log.damage.append(f"metrics.jsonl line {number}: empty line")
            continue
        event = _parse_event(text)
        if event is None and is_last and not ends_with_newline:
            log.notes.append(f"metrics.jsonl line {number}: torn last line ({len(raw_line)} bytes, a crash "
                             "mid-write); ignored")
            continue
        if event is None:
            recovered = _recover_after_torn_fragment(text)
            if recovered is not None and recovered[0].get("event") == "session_start":
                event, offset = recovered
                log.notes.append(f"metrics.jsonl line {number}: torn fragment ({offset} bytes, a crash mid-write) "
                                 "before a resumed session's session_start; fragment ignored")
            else:
                log.damage.append(f"metrics.jsonl line {number}: not a JSON object ({text[:60]!r})")
                continue
        missing = [k for k in ("event", "session_id", *COUNTER_KEYS) if k not in event]
        if missing:
            log.damage.append(f"metrics.jsonl line {number}: event lacks {', '.join(missing)}")
            continue
        if event["event"] not in KNOWN_EVENTS:
            log.damage.append(f"metrics.jsonl line {number}: unknown event '{event['event']}'")
            continue
        bad_counters = [k for k in COUNTER_KEYS if not _is_int(event[k]) or event[k] < 0]
        if bad_counters:
            log.damage.append(f"metrics.jsonl line {number}: counter(s) {', '.join(bad_counters)} not a "
                              "non-negative integer")
            continue
        event = restore_nonfinite(event)
        event["_line"] = number
        log.events.append(event)
    return log


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
