"""pilotrun/run/events.py: every registered event kind, each registered whole (said whether trackers mirror
it, where a killed session counts its seconds, its field shapes and its own check, and documented in
docs/RUN_RECORD.md); the record's kinds, the mirror's and the session check all reading the one table."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from pilotrun.report.record_check.sessions import check_session
from pilotrun.run import events, mirror, record
from pilotrun.run.events import EVENT_KINDS, TIMED_PHASES

RUN_RECORD_DOC = Path(__file__).resolve().parents[2] / "docs" / "RUN_RECORD.md"


def half_registrations() -> list[str]:
    """What an event's registration lacks: a decision on mirroring, a known phase (or none) for its seconds,
    field shapes as (words, test) pairs, a check that can be called (or none), a line of docs/RUN_RECORD.md;
    and the record's or the mirror's kinds out of step with the table."""
    documented = set(re.findall(r"^- `(\w+)`:", RUN_RECORD_DOC.read_text(encoding="utf-8"), re.M))
    found = []
    for name, kind in events.EVENT_KINDS.items():
        if kind.name != name:
            found.append(f"{name}: registered under another name ({kind.name})")
        if not isinstance(kind.mirrored, bool):
            found.append(f"{name}: not said whether trackers mirror it")
        if kind.seconds_phase is not None and kind.seconds_phase not in TIMED_PHASES:
            found.append(f"{name}: its seconds go to {kind.seconds_phase!r}, not a phase of {TIMED_PHASES}")
        shapes = kind.shapes.values() if isinstance(kind.shapes, dict) else [None]
        if not all(isinstance(shape, tuple) and len(shape) == 2 and isinstance(shape[0], str)
                   and callable(shape[1]) for shape in shapes):
            found.append(f"{name}: field shapes not (words, test) pairs")
        if kind.check is not None and not callable(kind.check):
            found.append(f"{name}: its check cannot be called")
        if name not in documented:
            found.append(f"{name}: not documented in docs/RUN_RECORD.md")
    if record.EVENTS != tuple(events.EVENT_KINDS):
        found.append("record.EVENTS differs from the registry")
    if mirror.MIRRORED_EVENTS != tuple(n for n, k in events.EVENT_KINDS.items() if k.mirrored is True):
        found.append("mirror.MIRRORED_EVENTS differs from the registry")
    return found


def test_every_event_kind_is_registered_whole():
    assert tuple(EVENT_KINDS) == ("session_start", "hang_found", "train", "val", "checkpoint", "overflow",
                                  "data_restart", "qk_clip", "spike", "rollback", "shard_check", "downstream",
                                  "evaluation", "session_end")
    assert mirror.MIRRORED_EVENTS == ("train", "val", "checkpoint", "overflow", "downstream", "evaluation")
    assert {n: k.seconds_phase for n, k in EVENT_KINDS.items() if k.seconds_phase} == {
        "val": "eval", "checkpoint": "checkpoint", "downstream": "eval"}
    assert sorted(record.FIELD_SHAPES) == ["hang_found", "rollback", "spike"]
    assert [n for n, k in EVENT_KINDS.items() if k.check] == ["qk_clip"]
    assert half_registrations() == []


def test_a_half_registered_event_is_named(monkeypatch):
    planted = dataclasses.replace(EVENT_KINDS["val"], name="probe", mirrored=None, seconds_phase="idle",
                                  shapes={"x": "an integer"}, check="yes")
    monkeypatch.setattr(events, "EVENT_KINDS", {**EVENT_KINDS, "probe": planted})
    assert half_registrations() == [
        "probe: not said whether trackers mirror it",
        "probe: its seconds go to 'idle', not a phase of ('eval', 'checkpoint')",
        "probe: field shapes not (words, test) pairs", "probe: its check cannot be called",
        "probe: not documented in docs/RUN_RECORD.md", "record.EVENTS differs from the registry"]


def _event(kind: str, line: int, **fields) -> dict:
    return {"event": kind, "session_id": "s", "time": float(line), "step": 0, "tokens_seen": 0,
            "updates_attempted": 0, "updates_skipped": 0, "_line": line, **fields}


def test_the_session_check_reads_an_event_kind_from_the_registry(monkeypatch):
    probe = events.EventKind("probe", mirrored=False, seconds_phase="eval", shapes={},
                             check=lambda event, run: None if event.get("ok") else "probe not ok")
    monkeypatch.setattr(events, "EVENT_KINDS", {**EVENT_KINDS, "probe": probe})
    reasons: list[str] = []
    checked = check_session("s", [_event("session_start", 1), _event("probe", 2, seconds=1.5, ok=True),
                                  _event("probe", 3, seconds=2.0)], {}, reasons, [])
    assert reasons == ["line 3 (probe, session s, step 0): probe not ok"]
    assert checked["eval_seconds"] == 3.5 and checked["checkpoint_seconds"] == 0.0
