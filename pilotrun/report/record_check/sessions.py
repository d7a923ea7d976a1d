"""One session of a run: its events checked against each other and summed, and its summary.

Within a session: counters never go backwards (but at a `rollback`, where they become the restored
checkpoint's, after a closed window; a background save's `checkpoint` event carries its state's counters,
behind the events logged while it was written, and is left out of this order); `updates_skipped` grows by
exactly one per `overflow` event or skipped `spike` event (checked at each train window and at the session's
end); each `train` window's applied/attempted/skipped equal the growth of
step/updates_attempted/updates_skipped since the previous `train` event (or the session start), applied +
skipped = attempted, `window.tokens` = microbatches x tokens_per_microbatch, and the growth of `tokens_seen`
equals `window.tokens`; at a `completed`/`stopped` `session_end` every counter is covered by the windows; its
`time_split` is an account of its wall clock (time_split.py); each `qk_clip` event is consistent with tau and
with its window; no number is non-finite. Every failure is one reason naming the line, event and numbers. What
spans sessions (the resume chain, the lineage, the totals) is summarize.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pilotrun.config import current_key
from pilotrun.report.record_check.time_split import derived_time_split, read_time_split, time_split_problem
from pilotrun.run import events as event_kinds
from pilotrun.run.record import (
    COUNTER_KEYS,
    SESSION_END_REASONS,
    WINDOW_COUNT_KEYS,
    Counters,
    is_finite_number,
    nonfinite_fields,
)


@dataclass
class SessionSummary:
    session_id: str
    index: int
    resumed_from: int | None
    parent_session: str | None  # the session that recorded the checkpoint this one resumed from
    end_reason: str | None  # None: no session_end (killed)
    status: str  # "kept", "partly rolled back" or "rolled back"
    start: dict[str, int]
    last: dict[str, int]
    updates_applied: int
    updates_attempted: int
    updates_skipped: int
    tokens_processed: int
    updates_rolled_back: int
    tokens_rolled_back: int
    train_seconds: float
    eval_seconds: float
    checkpoint_seconds: float
    profile_seconds: float  # 0 in a record written before the profile phase existed
    report_seconds: float  # likewise: that time was inside other_seconds then
    other_seconds: float
    wall_seconds: float
    time_source: str  # "session_end" (the trainer's own split) or "events" (derived: the session was killed)
    train_tokens_per_s: float | None
    wall_tokens_per_s: float | None
    events: int
    latest: bool = False  # the last session in the log: the one a report of "the run now" is about
    # resumed with no checkpoint: began again at 0, naming the work lost
    restart: dict[str, Any] | None = None


def _where(event: dict[str, Any]) -> str:
    return (f"line {event.get('_line', '?')} ({event.get('event')}, session {event.get('session_id')}, step "
            f"{event.get('step')})")


def group_sessions(events: list[dict[str, Any]], reasons: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Events per session in file order; interleaved sessions and sessions started twice are reasons."""
    sessions: dict[str, list[dict[str, Any]]] = {}
    previous_id = None
    for event in events:
        sid = str(event["session_id"])
        if sid != previous_id and sid in sessions:
            reasons.append(f"{_where(event)}: session {sid} continues after another session started "
                           "(two writers on one run, or a session counted twice)")
        if event["event"] == "session_start" and any(
            e["event"] == "session_start" for e in sessions.get(sid, [])
        ):
            reasons.append(f"{_where(event)}: session {sid} started twice; its work would be double-counted")
        sessions.setdefault(sid, []).append(event)
        previous_id = sid
    return sessions


def _check_window(event: dict[str, Any], since: Counters, now: Counters, tokens_per_microbatch: int | None,
                  reasons: list[str]) -> dict[str, Any] | None:
    window = event.get("window")
    where = _where(event)
    if not isinstance(window, dict) or any(not isinstance(window.get(k), int) for k in WINDOW_COUNT_KEYS):
        reasons.append(f"{where}: train event lacks integer window counters {', '.join(WINDOW_COUNT_KEYS)}")
        return None
    applied, attempted, skipped = (
        window["updates_applied"],
        window["updates_attempted"],
        window["updates_skipped"],
    )
    checks = (
        (
            applied == now.step - since.step,
            f"window.updates_applied={applied} but step grew by {now.step - since.step}",
        ),
        (
            attempted == now.updates_attempted - since.updates_attempted,
            f"window.updates_attempted={attempted} but updates_attempted grew by "
            f"{now.updates_attempted - since.updates_attempted}",
        ),
        (
            skipped == now.updates_skipped - since.updates_skipped,
            f"window.updates_skipped={skipped} but updates_skipped grew by "
            f"{now.updates_skipped - since.updates_skipped}",
        ),
        (applied <= attempted, f"window applied ({applied}) exceeds attempted ({attempted})"),
        (
            applied + skipped == attempted,
            f"window applied ({applied}) + skipped ({skipped}) != attempted ({attempted})",
        ),
        (
            window["tokens"] == now.tokens_seen - since.tokens_seen,
            f"window.tokens={window['tokens']} but tokens_seen grew by {now.tokens_seen - since.tokens_seen}",
        ),
    )
    for ok, message in checks:
        if not ok:
            reasons.append(f"{where}: {message}")
    if (
        tokens_per_microbatch is not None
        and window["tokens"] != window["microbatches"] * tokens_per_microbatch
    ):
        reasons.append(
            f"{where}: window.tokens={window['tokens']} != microbatches ({window['microbatches']}) x "
            f"tokens_per_microbatch ({tokens_per_microbatch})"
        )
    return window


# The recipe keys whose change on resume (--allow-change) changes tokens_per_update.
BATCH_KEYS = ("train.batch_size", "train.gradient_accumulation_steps")


def tokens_per_update_of(run: dict[str, Any], sid: str) -> Any:
    """The tokens per update session `sid` ran with: run.json's (the latest session's), taken back through the
    batch changes later sessions made on resume (`allowed_changes`), each a ratio of its old to new value."""
    value = run.get("tokens_per_update")
    order = [str(s.get("session_id")) for s in run.get("sessions") or [] if isinstance(s, dict)]
    if sid not in order or not isinstance(value, int):
        return value
    for change in reversed(run.get("allowed_changes") or []):
        if not isinstance(change, dict) or current_key(str(change.get("key"))) not in BATCH_KEYS:
            continue
        later = str(change.get("session_id")) in order[order.index(sid) + 1:]
        old, new = change.get("old"), change.get("new")
        if later and isinstance(old, int) and isinstance(new, int) and new > 0 and value * old % new == 0:
            value = value * old // new
    return value


def _tokens_per_microbatch(first: dict[str, Any], run: dict[str, Any]) -> int | None:
    """The tokens per microbatch the session start records; for a record without it, the recipe's batch_size x
    seq_len x world_size (None when the recipe lacks them)."""
    tokens_per_microbatch = first.get("tokens_per_microbatch") if first["event"] == "session_start" else None
    if not isinstance(tokens_per_microbatch, int):
        train = (run.get("recipe") or {}).get("train") or {}
        world = first.get("world_size", 1) if isinstance(first.get("world_size"), int) else 1
        if isinstance(train.get("batch_size"), int) and isinstance(train.get("seq_len"), int):
            tokens_per_microbatch = train["batch_size"] * train["seq_len"] * world
        else:
            tokens_per_microbatch = None
    return tokens_per_microbatch


def _check_session_start(sid: str, first: dict[str, Any], run: dict[str, Any], reasons: list[str],
                         notes_out: list[str]) -> None:
    """The session's first event: a session_start, its torn-line repair noted, its tokens_per_update
    run.json's (taken back through later batch changes)."""
    if first["event"] != "session_start":
        reasons.append(f"{_where(first)}: session {sid} does not begin with session_start")
    repaired = first.get("metrics_repaired_bytes")
    if isinstance(repaired, int) and repaired > 0:
        notes_out.append(
            f"{_where(first)}: before appending, the runlog cut a torn last line of {repaired} bytes "
            "(the previous session was killed mid-write)"
        )
    tpu = first.get("tokens_per_update")
    expected = tokens_per_update_of(run, sid)
    if first["event"] == "session_start" and tpu != expected:
        reasons.append(f"{_where(first)}: tokens_per_update {tpu} differs from run.json's {expected}"
                       + ("" if expected == run.get("tokens_per_update") else
                          " (its value before the batch changes allowed on resume)"))


@dataclass
class _SessionPass:
    """The running sums of one pass over a session's events, shared by the checks of each event kind."""

    start: Counters
    tokens_per_microbatch: int | None
    previous: Counters = dataclasses.field(init=False)
    since_train: Counters = dataclasses.field(init=False)  # the counters at the last closed train window
    overflows_since_train: int = 0
    first_clips_since_train: list[list[int]] = dataclasses.field(default_factory=list)
    last_overflow_skipped: int = dataclasses.field(init=False)
    window_sums: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(
        ("tokens", "profiled_tokens", "train_seconds", "profile_seconds", "wall_seconds"), 0.0
    ))
    # seconds by phase, of the events that carry them
    timed: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(
        event_kinds.TIMED_PHASES, 0.0
    ))
    end_event: dict[str, Any] | None = None
    # work in this session that its own rollbacks undid (spikes)
    rolled: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNTER_KEYS, 0))

    def __post_init__(self) -> None:
        self.previous = self.since_train = self.start
        self.last_overflow_skipped = self.start.updates_skipped


def _take_rollback(event: dict[str, Any], now: Counters, walk: _SessionPass, reasons: list[str]) -> None:
    """The counters go back to a checkpoint's (summarize checks which); the work before is in a closed
    window, and the rolled-back part of it is counted beside the counters."""
    if walk.previous != walk.since_train:
        reasons.append(f"{_where(event)}: rollback with work after the last train window (step "
                       f"{walk.since_train.step} -> {walk.previous.step}) that no window accounts for")
    for key in COUNTER_KEYS:
        walk.rolled[key] += getattr(walk.previous, key) - getattr(now, key)
    walk.previous = walk.since_train = now
    walk.last_overflow_skipped, walk.overflows_since_train = now.updates_skipped, 0


def _check_counters_and_skips(event: dict[str, Any], now: Counters, walk: _SessionPass,
                              reasons: list[str]) -> None:
    """Counters never go backwards, and updates_skipped grows by one per skip's own event."""
    previous = walk.previous
    for key in COUNTER_KEYS:
        if getattr(now, key) < getattr(previous, key):
            reasons.append(
                f"{_where(event)}: {key} went backwards ({getattr(previous, key)} -> {getattr(now, key)})"
            )
    kind = event["event"]
    if kind == "overflow" or (kind == "spike" and event.get("skipped") is True):  # a skip's own event
        walk.overflows_since_train += 1
        if now.updates_skipped <= walk.last_overflow_skipped:
            reasons.append(
                f"{_where(event)}: updates_skipped ({now.updates_skipped}) did not grow with this "
                "overflow event"
            )
        walk.last_overflow_skipped = now.updates_skipped
    if kind in ("train", "session_end"):
        # Skips are counted once per overflow event. Compared at window boundaries, not event by event:
        # a data_restart logged in the same update as a skip may already carry the skip in its counters.
        grew = now.updates_skipped - walk.since_train.updates_skipped
        if grew != walk.overflows_since_train:
            reasons.append(
                f"{_where(event)}: updates_skipped grew by {grew} since the previous train window "
                f"but {walk.overflows_since_train} overflow event(s) were logged"
            )


def _close_train_window(event: dict[str, Any], now: Counters, walk: _SessionPass, reasons: list[str]) -> None:
    """A `train` event: its first-time qk_clip list matches the window's events, its window adds up, and its
    figures join the session's sums."""
    recorded = (
        (event.get("qk_clip") or {}).get("first_clipped")
        if isinstance(event.get("qk_clip"), dict)
        else None
    )
    if isinstance(recorded, list) and sorted(recorded) != sorted(walk.first_clips_since_train):
        reasons.append(
            f"{_where(event)}: the window's qk_clip.first_clipped {recorded} differs from the "
            f"first-time qk_clip events logged in it {walk.first_clips_since_train}"
        )
    walk.first_clips_since_train = []
    window = _check_window(event, walk.since_train, now, walk.tokens_per_microbatch, reasons)
    if window is not None:
        for key in walk.window_sums:
            if is_finite_number(window.get(key)):
                walk.window_sums[key] += float(window[key])
    walk.since_train = now
    walk.overflows_since_train = 0


def _check_session_end(event: dict[str, Any], now: Counters, since_train: Counters, reasons: list[str],
                       notes_out: list[str]) -> None:
    """A `session_end`: a known reason, a time split that accounts for the wall clock, and every counter
    covered by the windows (a note, not a reason, where the session was cut short)."""
    if event.get("reason") not in SESSION_END_REASONS:
        reasons.append(
            f"{_where(event)}: session_end reason {event.get('reason')!r} is not one of "
            f"{SESSION_END_REASONS}"
        )
    split_problem = time_split_problem(event.get("time_split"))
    if split_problem:
        reasons.append(f"{_where(event)}: {split_problem}")
    if now != since_train and event.get("reason") in ("interrupted", "deadline", "hung", "error"):
        notes_out.append(
            f"{_where(event)}: ended ({event.get('reason')}) with work after its last train "
            f"window (step {since_train.step} -> {now.step}); a resume rolls it back"
        )
    elif now != since_train:
        reasons.append(
            f"{_where(event)}: the session ends at step {now.step}, tokens_seen {now.tokens_seen}, "
            f"attempted {now.updates_attempted} but its train windows account only for step "
            f"{since_train.step}, tokens_seen {since_train.tokens_seen}, attempted "
            f"{since_train.updates_attempted}"
        )


def _check_event_kind(event: dict[str, Any], now: Counters, run: dict[str, Any], walk: _SessionPass,
                      reasons: list[str], notes_out: list[str]) -> None:
    """The event kind's own check (its registration), then what its kind adds to the session's pass."""
    kind = event["event"]
    registered = event_kinds.EVENT_KINDS.get(kind)  # the reader refuses unregistered kinds: always found
    problem = registered.check(event, run) if registered is not None and registered.check else None
    if problem:
        reasons.append(f"{_where(event)}: {problem}")
    phase = registered.seconds_phase if registered is not None else None
    if kind == "session_start":
        pass  # reported by group_sessions
    elif kind == "qk_clip":
        if problem is None and event["first_time"]:
            walk.first_clips_since_train.append([event["layer"], event["head"]])
    elif kind == "train":
        _close_train_window(event, now, walk, reasons)
    elif phase is not None and is_finite_number(event.get("seconds")):
        walk.timed[phase] += float(event["seconds"])
    elif kind == "session_end":
        walk.end_event = event
        _check_session_end(event, now, walk.since_train, reasons, notes_out)


def _walk_session_events(events: list[dict[str, Any]], run: dict[str, Any], walk: _SessionPass,
                         reasons: list[str], notes_out: list[str]) -> None:
    """One pass over the events after the session's start, in order, into `walk`'s sums."""
    for event in events:
        end_event = walk.end_event
        if end_event is not None:  # a session ends once: what follows its end is not its work
            reasons.append(
                f"{_where(event)}: {event['event']} after this session's session_end "
                f"({end_event.get('reason')} at step {end_event.get('step')}): a session logs nothing "
                "after its end, so the record breaks here"
            )
            break
        now = Counters.of(event)
        if event["event"] == "checkpoint" and event.get("background") is True:
            # Committed after the updates that followed its state: its counters are the state's, behind the
            # events logged meanwhile, and say nothing about the session's progress.
            if is_finite_number(event.get("seconds")):
                walk.timed["checkpoint"] += float(event["seconds"])
            continue
        if event["event"] == "rollback":
            _take_rollback(event, now, walk, reasons)
            continue
        _check_counters_and_skips(event, now, walk, reasons)
        _check_event_kind(event, now, run, walk, reasons, notes_out)
        walk.previous = now


def check_session(sid: str, events: list[dict[str, Any]], run: dict[str, Any],
                   reasons: list[str], notes_out: list[str]) -> dict[str, Any]:
    """Validate one session's events; return its start/last counters and sums for reconciliation."""
    first = events[0]
    walk = _SessionPass(start=Counters.of(first), tokens_per_microbatch=_tokens_per_microbatch(first, run))
    _check_session_start(sid, first, run, reasons, notes_out)
    _walk_session_events(events[1:], run, walk, reasons, notes_out)
    for event in events:
        bad = nonfinite_fields({k: v for k, v in event.items() if not k.startswith("_")})
        if bad:
            reasons.append(f"{_where(event)}: non-finite value in {', '.join(bad)}")
    times = [float(e["time"]) for e in events if is_finite_number(e.get("time"))]
    return {
        "start": walk.start,
        "last": walk.previous,
        "end": walk.end_event,
        "window_sums": walk.window_sums,
        "count": len(events),
        "start_time": times[0] if times else 0.0,
        "last_time": times[-1] if times else 0.0,
        "eval_seconds": walk.timed["eval"],
        "checkpoint_seconds": walk.timed["checkpoint"],
        "rolled": walk.rolled,
        "resumed_from": first.get("resumed_from") if first["event"] == "session_start" else None,
    }


def session_summary(
    sid: str,
    index: int,
    info: dict[str, Any],
    link: tuple[str, Counters] | None,
    status: str,
    kept_end: Counters,
) -> SessionSummary:
    start, last, end = info["start"], info["last"], info["end"]
    sums = info["window_sums"]
    times = read_time_split(end.get("time_split") if end is not None else None)
    if times is not None:
        source = "session_end"
    else:  # killed: derived from the events it did write
        times = derived_time_split(sums["train_seconds"], info["eval_seconds"], info["checkpoint_seconds"],
                                   sums["profile_seconds"], max(0.0, info["last_time"] - info["start_time"]))
        source = "events"
    rolled = info.get("rolled") or dict.fromkeys(COUNTER_KEYS, 0)  # undone by the session's own rollbacks
    tokens = last.tokens_seen - start.tokens_seen + rolled["tokens_seen"]
    return SessionSummary(
        session_id=sid,
        index=index,
        resumed_from=info["resumed_from"],
        parent_session=link[0] if link else None,
        end_reason=end.get("reason") if end is not None else None,
        status=status,
        start=dataclasses.asdict(start),
        last=dataclasses.asdict(last),
        updates_applied=last.step - start.step + rolled["step"],
        updates_attempted=last.updates_attempted - start.updates_attempted + rolled["updates_attempted"],
        updates_skipped=last.updates_skipped - start.updates_skipped + rolled["updates_skipped"],
        tokens_processed=tokens,
        updates_rolled_back=last.step - kept_end.step + rolled["step"],
        tokens_rolled_back=last.tokens_seen - kept_end.tokens_seen + rolled["tokens_seen"],
        time_source=source,
        train_tokens_per_s=(sums["tokens"] - sums["profiled_tokens"]) / sums["train_seconds"]
        if sums["train_seconds"] > 0
        else None,
        wall_tokens_per_s=tokens / times["wall_seconds"] if times["wall_seconds"] > 0 else None,
        events=info["count"],
        **times,
    )
