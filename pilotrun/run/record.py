"""The run record in one place: its schema, its writer and its two readers (torch-free).

A run folder holds `run.json` (rewritten atomically, a handful of times per session) and `metrics.jsonl`
(one JSON object a line, appended and flushed). docs/RUN_RECORD.md describes every field; this module owns
the names that writer and readers share, so they cannot drift apart:

- file names (RUN_JSON, METRICS_JSONL), event kinds (EVENTS, registered in events.py), session-end reasons
  (SESSION_END_REASONS);
- `Counters`, the four counters every event carries (step, tokens_seen, updates_attempted,
  updates_skipped), used by the trainer, the writer, summarize and verdict;
- the time phases a session's `time_split` accounts for (PHASES);
- the writer lives beside this module (pilotrun/run/writer.py: `MetricsWriter`, `RunRecord`), built on the
  chain functions here;
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

The log is hash-chained, so that an edit after the fact shows: every line ends with `"chain":"<hex>"`, the
sha256 of the previous line's chain value and this line's text without the field (the first line chains to
a digest of run.json's `run_id`). Editing, removing, adding or reordering lines breaks the chain at the first
line whose predecessor changed; `chain_breaks` names it. The chain head (the last line's value) is recorded
in each checkpoint's marker and in run.json per session (where it started and ended), and each
`session_start` carries digests of run.json's sections as they were then, so that a rewritten run.json
shows too. This detects accidents and casual editing; it is not a signature: anyone who can run this code
can recompute a chain over a forged log (docs/RUN_RECORD.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pilotrun.common.errors import PilotrunError
from pilotrun.common.files import canonical_json
from pilotrun.common.parsing import read_json_file
from pilotrun.common.strict_json import json_safe, strict_dumps
from pilotrun.run.events import EVENT_KINDS
from pilotrun.run.values import first_field, is_finite_number, is_int

RUN_JSON = "run.json"
METRICS_JSONL = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
HANGS_DIR = "hangs"  # every thread's stack of a rank that hung (training/callbacks/hang_watchdog.py)
REPORT_DIR = "report"

EVENTS = tuple(EVENT_KINDS)  # registered in run/events.py
SESSION_END_REASONS = ("completed", "interrupted", "deadline", "hung", "error", "stopped")
COUNTER_KEYS = ("step", "tokens_seen", "updates_attempted", "updates_skipped")
# Where a session's time goes: a session_end `time_split` carries `<phase>_seconds` for each, beside
# `wall_seconds` (the trainer's clock, pilotrun.training.timing, switches between them; summarize checks they
# add up). Records written before `profile` and `report` existed lack those two: that time is inside `other`.
PHASES = ("train", "eval", "checkpoint", "profile", "report", "other")
# The `window` object of a `train` event: what summarize reconciles against the counters' growth.
WINDOW_COUNT_KEYS = ("updates_applied", "updates_attempted", "updates_skipped", "microbatches", "tokens")
NONFINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
# Free-text fields where the word "NaN" is text, not a number.
TEXT_KEYS = {
    "event",
    "session_id",
    "reason",
    "message",
    "path",
    "mfu",
    "device",
    "device_name",
    "chain",
    "note",
    "explanation",
    "reproduce",
    "cause",
    "action",
    "policy",
}
# The hash chain over metrics.jsonl (module docstring). CHAIN_KEY is the last field of every line.
CHAIN_KEY = "chain"
CHAIN_GENESIS_PREFIX = b"pilotrun metrics.jsonl chain of run "
# run.json's sections whose digests each session_start records (RUN_JSON_DIGEST_KEY), and the keys of a
# session entry that are written only when the session ends (left out of the digest, which is taken at start).
RUN_JSON_DIGEST_KEY = "run_json_sha256"
RUN_JSON_DIGESTED = ("run_id", "tokens_per_update", "model", "optimizer", "recipe", "data", "allowed_changes",
                     "frozen", "sessions")
SESSION_END_KEYS = ("chain_end", "ended_at", "end_reason")


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
# Non-finite floats are written as strings by common/strict_json.py (json_safe, strict_dumps: every JSON
# pilotrun prints or writes) and read back here.
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
    return strict_dumps(record, separators=(",", ":"))


def chain_genesis(run_id: str) -> str:
    """What the first line of a run's metrics.jsonl chains to."""
    return hashlib.sha256(CHAIN_GENESIS_PREFIX + str(run_id).encode("utf-8")).hexdigest()


def chain_link(previous: str, body: str) -> str:
    """The chain value of a line whose text without the chain field is `body`."""
    return hashlib.sha256(previous.encode("ascii") + b"\n" + body.encode("utf-8")).hexdigest()


def chained_line(previous: str, record: dict[str, Any]) -> tuple[str, str]:
    """(the line to write, without its newline; its chain value) for an event that follows `previous`."""
    body = dumps_line(record)
    value = chain_link(previous, body)
    return f'{body[:-1]},"{CHAIN_KEY}":"{value}"}}', value


def unchained_body(text: str) -> tuple[str, str] | None:
    """(body, chain value) of a written line, or None when the line does not end with a chain field."""
    tail = len(CHAIN_KEY) + 64 + 7  # ,"chain":"<64 hex>"}
    if len(text) < tail + 1 or not text.endswith('"}') or text[-tail:-66] != f',"{CHAIN_KEY}":"':
        return None
    value = text[-66:-2]
    if any(c not in "0123456789abcdef" for c in value):
        return None
    body = text[:-tail] + "}"
    return body, value


def run_json_digests(data: dict[str, Any]) -> dict[str, str]:
    """sha256 per digested section of run.json (RUN_JSON_DIGESTED) as it stands, session end fields left
    out."""
    digests = {}
    for key in RUN_JSON_DIGESTED:
        if key not in data:
            continue
        value = data[key]
        if key == "sessions" and isinstance(value, list):
            value = [{k: v for k, v in entry.items() if k not in SESSION_END_KEYS} if isinstance(entry, dict)
                     else entry for entry in value]
        # The project's canonical JSON (the data manifest's), after the writer's form of non-finite floats.
        digests[key] = hashlib.sha256(canonical_json(json_safe(value))).hexdigest()
    return digests


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


# ---------------------------------------------------------------------------------------------- readers
def read_run_json(run_dir: str | Path) -> dict[str, Any]:
    """run.json as a dict. A missing folder or file, or an unreadable file, is a RecordError (bad input)."""
    run_dir = Path(run_dir)
    # named as what it is, not "not found" (files.refuse_wrong_kind)
    if run_dir.exists() and not run_dir.is_dir():
        raise RecordError(f"run folder {run_dir} is a file, not a folder")
    if not run_dir.is_dir():
        raise RecordError(f"run folder not found: {run_dir}")
    path = run_dir / RUN_JSON
    if not path.is_file():
        raise RecordError(f"{path}: not found (is {run_dir} a run folder written by `pilotrun train`?)")
    # Torn, not UTF-8, unreadable, nested past reason: damage to name in one line, never a traceback.
    data = read_json_file(path, f"{path}: unreadable run record:", RecordError)
    if not isinstance(data, dict):
        raise RecordError(f"{path}: expected a JSON object at the top level")
    return data


@dataclass
class ParsedMetrics:
    """metrics.jsonl as read: events in file order, each carrying `_line` (its 1-based line number)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # torn lines a crash explains: reported, not fatal
    # unreadable lines nothing explains: the record is invalid
    damage: list[str] = field(default_factory=list)
    missing: bool = False  # no metrics.jsonl at all
    texts: list[str] = field(default_factory=list, repr=False)  # each event's exact text, for the hash chain


def _parse_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # bad syntax, an integer too long, a nesting no parser follows
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
    bad = [k for k in COUNTER_KEYS if not is_int(event[k]) or event[k] < 0]
    if bad:
        return f"counter(s) {', '.join(bad)} not a non-negative integer"
    if not isinstance(event["session_id"], str):
        return (f"session_id is {str(event['session_id'])[:20]!r} ({type(event['session_id']).__name__}), "
                f"not a string")
    # Every reader takes `time` as seconds (stall, intervals, the time ledger): a line without one is not the
    # writer's.
    if "time" not in event:
        return "event lacks time"
    if not is_finite_number(event["time"]):
        return f"time is {str(event['time'])[:20]!r} ({type(event['time']).__name__}), not a finite number"
    huge = _huge_integer(event)
    if huge is not None:
        return f"{huge}: an integer too large for a float or an index (the writer never writes one)"
    for key, (shape, fits) in FIELD_SHAPES.get(event["event"], {}).items():
        if key in event and not fits(event[key]):
            return (f"{event['event']} field {key} is {type(event[key]).__name__} {str(event[key])[:30]!r}, "
                    f"not {shape}")
    return None


# The shapes of the fields the readers take apart, per event kind (run/events.py).
FIELD_SHAPES: dict[str, dict[str, tuple[str, Any]]] = {name: kind.shapes for name, kind in EVENT_KINDS.items()
                                                       if kind.shapes}


# Beyond this an integer is no count, step or byte size pilotrun writes, and float() or an index would
# overflow.
LARGEST_INTEGER = 2**63 - 1


def _huge_integer(value: Any) -> str | None:
    """The dotted name of the first integer in `value` beyond LARGEST_INTEGER either way, or None."""
    found = first_field(value, lambda v: is_int(v) and abs(v) > LARGEST_INTEGER)
    return None if found is None else found or "a value"


def not_utf8_problem(raw_line: bytes, number: int, *, unterminated: bool = False) -> str | None:
    """Why line `number` of metrics.jsonl is not UTF-8, naming it, or None. An `unterminated` last line (a
    writer mid-line, or killed there) may end partway through a character, which a tear explains; an invalid
    byte before its end is damage like on any other line (the writer only ever writes UTF-8)."""
    try:
        raw_line.decode("utf-8")
    except UnicodeDecodeError as exc:
        # the first bad byte starts a cut character
        if unterminated and exc.reason == "unexpected end of data":
            return None
        return (f"metrics.jsonl line {number}: not UTF-8 (byte 0x{raw_line[exc.start]:02x} at column "
                f"{exc.start + 1})")
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
        unterminated = is_last and not ends_with_newline
        problem = not_utf8_problem(raw_line, number, unterminated=unterminated)
        if problem is not None:
            parsed.damage.append(problem)
            continue
        text = raw_line.decode("utf-8", errors="replace")  # only a torn last line's cut character is replaced
        if not text.strip():
            if not is_last:
                parsed.damage.append(f"metrics.jsonl line {number}: empty line")
            continue
        event = _parse_object(text)
        if event is None and is_last and not ends_with_newline:
            parsed.notes.append(
                f"metrics.jsonl line {number}: torn last line ({len(raw_line)} bytes, a crash "
                "mid-write); ignored"
            )
            continue
        object_text = text
        if event is None:
            recovered = _recover_after_torn_fragment(text)
            if recovered is not None and recovered[0].get("event") == "session_start":
                event, offset = recovered
                object_text = text[offset:]
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
        parsed.texts.append(object_text)
    return parsed


def chain_breaks(parsed: ParsedMetrics, run_id: str) -> list[str]:
    """One reason per line whose hash chain does not follow from the line before it (or, for the first line,
    from run.json's run_id). An edited line breaks itself; a removed line breaks the line after the gap; two
    swapped lines break both and the line after them. A line already unreadable (damage) is not in `parsed`,
    so the one after it breaks too."""
    reasons = []
    previous = chain_genesis(run_id)
    for event, text in zip(parsed.events, parsed.texts, strict=True):
        split = unchained_body(text)
        where = f"metrics.jsonl line {event['_line']} ({event.get('event')}, step {event.get('step')})"
        if split is None:
            reasons.append(
                f"{where}: no hash chain field; the line was not written by pilotrun's writer, or edited"
            )
            continue
        body, value = split
        if chain_link(previous, body) != value:
            first = "run.json's run_id" if event is parsed.events[0] else "the line before it"
            reasons.append(
                f"{where}: hash chain broken: it does not follow from {first} (this line was edited, "
                "or lines before it were removed, added or reordered)"
            )
        previous = value
    return reasons


def record_integrity_problems(run: dict[str, Any], parsed: ParsedMetrics,
                              checkpoint_heads: dict[int, Any] | None = None,
                              checkpoint_owners: dict[int, Any] | None = None) -> list[str]:
    """Everything the hash chain says about a run folder, as reasons (empty: the record is as written).

    - every line follows from the one before it (`chain_breaks`);
    - each run.json session starts where the chain stood when it opened (`chain_start`: the line before its
      first line) and, if it ended, its last line is the `chain_end` it recorded: lines removed at the end of
      a session, or a whole session removed, show here;
    - each committed checkpoint's `metrics_chain_head` is a line of the log (`checkpoint_heads`: step ->
      head), and a checkpoint whose marker names another run (`checkpoint_owners`: step -> run_id) is named as
      such;
    - run.json's sections equal the digests the latest session_start recorded (a rewritten recipe shows)."""
    run_id = run.get("run_id")
    if not isinstance(run_id, str):
        return ["run.json: run_id is not a string; the hash chain of metrics.jsonl cannot be checked"]
    reasons = chain_breaks(parsed, run_id)
    own = line_chain_values(parsed)
    values = {value: index for index, value in enumerate(own) if value is not None}
    genesis = chain_genesis(run_id)
    events = parsed.events
    span: dict[Any, list[int]] = {}  # session id -> [index of its first line, index of its last]
    for index, event in enumerate(events):
        span.setdefault(event.get("session_id"), [index, index])[1] = index
    for entry in run.get("sessions") or []:
        if not isinstance(entry, dict):
            continue
        sid = entry.get("session_id")
        start, end = entry.get("chain_start"), entry.get("chain_end")
        if sid not in span:
            if end is not None:
                reasons.append(
                    f"run.json session {sid}: ended (chain_end recorded) but metrics.jsonl holds none "
                    "of its lines (removed)"
                )
            continue
        first, last = span[sid]
        if start is None:
            reasons.append(f"run.json session {sid}: no chain_start recorded (a record not written by this "
                           "version of pilotrun, or edited)")
        else:
            before = genesis if first == 0 else own[first - 1]
            if start != before:
                reasons.append(
                    f"run.json session {sid}: its recorded chain_start is not the line before its first "
                    f"line (metrics.jsonl line {events[first]['_line']}): lines before it were removed, "
                    "added or rewritten"
                )
        if end is not None and values.get(end) != last:
            reasons.append(
                f"run.json session {sid}: its recorded chain_end is not its last line in metrics.jsonl "
                f"(line {events[last]['_line']}): lines at its end were removed, or the log rewritten"
            )
    owners = checkpoint_owners or {}
    for step, head in sorted((checkpoint_heads or {}).items()):
        owner = owners.get(step)
        if isinstance(owner, str) and owner != run_id:
            reasons.append(f"checkpoint step {step}: its marker names run {owner}, not this run {run_id}: a "
                           "checkpoint of another run was put into this folder")
        elif head is not None and head not in values and head != genesis:
            found = f"{head[:12]}..." if isinstance(head, str) else repr(head)[:20]
            reasons.append(
                f"checkpoint step {step}: its marker's metrics_chain_head ({found}) is none of the "
                f"{len(values)} lines of metrics.jsonl: the log up to that checkpoint was rewritten, or "
                "the checkpoint comes from another copy of this run"
            )
    starts = [e for e in events if e.get("event") == "session_start"]
    if starts:
        latest = starts[-1]
        recorded = latest.get(RUN_JSON_DIGEST_KEY)
        if not isinstance(recorded, dict):
            reasons.append(f"metrics.jsonl line {latest['_line']}: the latest session_start records no "
                           f"{RUN_JSON_DIGEST_KEY}, so run.json cannot be checked against it")
        else:
            now = run_json_digests(run)
            changed = sorted(k for k in set(recorded) | set(now) if recorded.get(k) != now.get(k))
            if changed:
                reasons.append(
                    f"run.json: {', '.join(changed)} differ(s) from what the latest session recorded at "
                    f"its start (metrics.jsonl line {latest['_line']}): run.json was edited after the fact"
                )
    return reasons


def line_chain_values(parsed: ParsedMetrics) -> list[str | None]:
    """Each event's recorded chain value, in file order (None for a line without one)."""
    return [split[1] if split is not None else None for split in map(unchained_body, parsed.texts)]


def last_chain_value(path: str | Path, run_id: str) -> str:
    """The chain head of an existing metrics.jsonl: the last complete line's chain value (the genesis of
    `run_id` for an empty or missing file). A last line without one (not written by this writer) is chained
    through its digest, so that appends still form a chain from there."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return chain_genesis(run_id)
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        block = 65536
        tail = b""
        position = size
        while position > 0:  # read backwards until the last line is whole
            start = max(0, position - block)
            f.seek(start)
            tail = f.read(position - start) + tail
            position = start
            if tail.rstrip(b"\n").count(b"\n") >= 1:
                break
    last = tail.rstrip(b"\n").rsplit(b"\n", 1)[-1].decode("utf-8", errors="replace")
    split = unchained_body(last)
    return split[1] if split is not None else hashlib.sha256(last.encode("utf-8")).hexdigest()


def read_metrics_tolerant(run_dir: str | Path) -> ParsedMetrics:
    """For summarize, verdict and reports: every readable event, with notes and damage listed, never raised.
    A missing metrics.jsonl is damage too."""
    return _read_metrics(Path(run_dir) / METRICS_JSONL)[0]


def _read_metrics(path: Path) -> tuple[ParsedMetrics, bytes | None]:
    """read_metrics_tolerant's parse, and the bytes it parsed (None: missing or unreadable)."""
    if not path.is_file():
        parsed = ParsedMetrics(missing=True)
        parsed.damage.append(f"{path}: not found" if not path.exists() else f"{path}: not a file")
        return parsed, None
    try:
        raw = path.read_bytes()
    except OSError as exc:
        parsed = ParsedMetrics(missing=True)
        parsed.damage.append(f"{path}: cannot be read ({exc.strerror or exc})")
        return parsed, None
    return parse_metrics_bytes(raw), raw


def _whole_lines_from(raw: bytes, start: int) -> bytes:
    """The bytes read from offset `start` of the file, less the line cut at the start (where start > 0)."""
    if start > 0:
        raw = raw[raw.find(b"\n") + 1:] if b"\n" in raw else b""
    return raw


def _tail_events(run_dir: str | Path, tail_bytes: int) -> list[dict[str, Any]]:
    """The complete events in the last `tail_bytes` bytes of metrics.jsonl (the line cut at the start left
    out); none where the file cannot be read."""
    path = Path(run_dir) / METRICS_JSONL
    try:
        with open(path, "rb") as handle:
            start = max(0, handle.seek(0, os.SEEK_END) - tail_bytes)
            handle.seek(start)
            raw = handle.read()
    except OSError:
        return []
    return parse_metrics_bytes(_whole_lines_from(raw, start)).events


def _file_stamp(path: Path) -> tuple[int, int, int, int] | None:
    """The file's device, inode, size and modification time (None: not there): an append changes it."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns


@dataclass(frozen=True)
class RecordRead:
    """metrics.jsonl as one read found it, for a later step of the same command to use while the file is
    unchanged (`current`) instead of reading it again: its events, its last RECENT_BYTES' whole lines (what
    a session's plan reads its recent rate from) and the file's identity before the read (None: none read)."""

    events: list[dict[str, Any]]
    recent: bytes
    stamp: tuple[int, int, int, int] | None

    def current(self, run_dir: str | Path) -> bool:
        """Whether metrics.jsonl is still the file read: same file, size and modification time."""
        return self.stamp is not None and self.stamp == _file_stamp(Path(run_dir) / METRICS_JSONL)

    def recent_seconds_per_update(self) -> list[float]:
        """recorded_seconds_per_update(run_dir, RECENT_BYTES) of the bytes read."""
        return seconds_per_update_of(parse_metrics_bytes(self.recent).events)


def read_record_once(run_dir: str | Path) -> RecordRead:
    """One read of metrics.jsonl: read_metrics_tolerant's events and, from the same bytes, the lines
    recorded_seconds_per_update(run_dir, RECENT_BYTES) reads; the file's identity taken before reading, so
    that an append during the read makes it not `current`."""
    path = Path(run_dir) / METRICS_JSONL
    stamp = _file_stamp(path)
    parsed, raw = _read_metrics(path)
    if raw is None:
        return RecordRead(parsed.events, b"", None)
    start = max(0, len(raw) - RECENT_BYTES)
    return RecordRead(parsed.events, _whole_lines_from(raw[start:], start), stamp)


# The record's windows a session's plan reads its rate from: the log's last MiB (hundreds of windows), so that
# a resume of a long run reads it in the same time (the whole log: 25 s for 50,000 windows, shared machine).
RECENT_BYTES = 1 << 20


def recorded_seconds_per_update(run_dir: str | Path, tail_bytes: int | None = None) -> list[float]:
    """The training-only seconds per update of each recorded `train` window, in record order (empty: no record
    yet): what the start-up checks measure a bound or a deadline against. `tail_bytes`: only the windows in
    the log's last that many bytes (the plan's recent rate, read in the same time however long the run)."""
    whole = tail_bytes is None
    return seconds_per_update_of(read_metrics_tolerant(run_dir).events if whole
                                 else _tail_events(run_dir, tail_bytes))


def seconds_per_update_of(events: list[dict[str, Any]]) -> list[float]:
    """recorded_seconds_per_update's figures from events already read."""
    rates = []
    for event in events:
        window = event.get("window") if isinstance(event.get("window"), dict) else {}
        seconds, attempted = window.get("train_seconds"), window.get("updates_attempted")
        counted = isinstance(seconds, float) and isinstance(attempted, int) and attempted > 0
        if event.get("event") == "train" and counted:
            rates.append(seconds / attempted)
    return rates


def read_metrics_strict(run_dir: str | Path, run_id: str | None = None) -> list[dict[str, Any]]:
    """For tools that must not act on a damaged record (inspect-batch, tests): the events, or RecordError
    naming the first damaged line. A torn last line (a crash mid-write, or a line being written right now)
    is not damage and is left out; a folder whose session has not opened its log yet has no events. With
    `run_id` (run.json's), a line whose hash chain is broken is damage too."""
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
    damage = parsed.damage + (chain_breaks(parsed, run_id) if run_id is not None else [])
    if damage:
        raise RecordError(f"{path}: damaged record: {damage[0]}"
                          + (f" (and {len(damage) - 1} more)" if len(damage) > 1 else ""))
    return parsed.events
