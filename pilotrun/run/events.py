"""The kinds of event metrics.jsonl holds: one entry each in EVENT_KINDS, the only place an event is
registered (torch-free, like the rest of run/).

An entry says, besides the name, what every reader of the record must know of the event: whether the
trackers receive its scalars (`mirrored`, run/mirror.py); in which phase a killed session's time split,
derived from its events, counts the event's `seconds` (`seconds_phase`: one of TIMED_PHASES, or None for an
event that carries none; report/record_check/sessions.py); the shapes of the fields the readers take apart,
where present (`shapes`: a line carrying another shape is not the writer's, and is damage named by its field;
run/record.py); and a check of one event against run.json (`check(event, run) -> problem or None`: the
session check names the line). record.py's EVENTS, mirror.py's MIRRORED_EVENTS and the session check all
read this table. The event's fields and meaning are documented in docs/RUN_RECORD.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pilotrun.config import QK_CLIP_HARD_GAMMA
from pilotrun.run.values import is_finite_number, is_int

# The phases whose seconds a killed session's time split takes from its events
# (report/record_check/time_split.derived_time_split).
TIMED_PHASES = ("eval", "checkpoint")


@dataclass(frozen=True)
class EventKind:
    name: str
    mirrored: bool
    seconds_phase: str | None
    shapes: dict[str, tuple[str, Callable[[Any], bool]]]
    check: Callable[[dict[str, Any], dict[str, Any]], str | None] | None


def qk_clip_problem(event: dict[str, Any], run: dict[str, Any]) -> str | None:
    """What is wrong with one `qk_clip` event (docs/RUN_RECORD.md), or None: a head (layer, head >= 0), its
    max logit S above the recipe's tau, gamma = tau / S in (0, 1), and the reasons it was logged (first time,
    or gamma < 0.5)."""
    tau = (((run.get("recipe") or {}).get("optim") or {}).get("qk_clip") or {}).get("tau")
    layer, head = event.get("layer"), event.get("head")
    logit, gamma = event.get("max_logit"), event.get("gamma")
    if not (isinstance(layer, int) and isinstance(head, int) and layer >= 0 and head >= 0):
        return f"qk_clip event without a valid layer and head ({layer!r}, {head!r})"
    if not (is_finite_number(logit) and is_finite_number(gamma) and 0 < gamma < 1):
        return (f"qk_clip event for layer {layer} head {head}: max_logit {logit!r}, gamma {gamma!r} "
                "(0 < gamma < 1)")
    if not (isinstance(event.get("first_time"), bool) and isinstance(event.get("hard"), bool)):
        return f"qk_clip event for layer {layer} head {head}: first_time and hard must be booleans"
    if event["hard"] != (gamma < QK_CLIP_HARD_GAMMA) or not (event["first_time"] or event["hard"]):
        return (f"qk_clip event for layer {layer} head {head}: logged with first_time={event['first_time']}, "
                f"hard={event['hard']} at gamma {gamma}")
    if is_finite_number(tau) and tau > 0 and not (logit > tau and abs(gamma * logit - tau) <= 1e-5 * tau):
        return f"qk_clip event for layer {layer} head {head}: gamma {gamma} x max_logit {logit} != tau {tau}"
    return None


_INTEGER = ("an integer", is_int)
_OBJECT = ("an object", lambda v: isinstance(v, dict))
SPIKE_SHAPES = {"spike_step": _INTEGER,
                "signals": ("a list of names",
                            lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
                "bounds": _OBJECT,
                "batches": ("a list", lambda v: isinstance(v, list)),
                "action": ("a name", lambda v: isinstance(v, str)),
                "replay": ("an object or null", lambda v: v is None or isinstance(v, dict)),
                "cause": ("a name or null", lambda v: v is None or isinstance(v, str))}
HANG_FOUND_SHAPES = {"hung_session": ("a session id", lambda v: isinstance(v, str)), "rank": _INTEGER,
                     "stack_file": ("a path under hangs/", lambda v: isinstance(v, str))}
ROLLBACK_SHAPES = {"restored_step": _INTEGER, "spike_step": _INTEGER, "skipped": _OBJECT,
                   "rolled_back": _OBJECT, "rollbacks": _INTEGER, "max_rollbacks": _INTEGER}


def _registered(*kinds: EventKind) -> dict[str, EventKind]:
    return {kind.name: kind for kind in kinds}


# In the order docs/RUN_RECORD.md describes them.
EVENT_KINDS: dict[str, EventKind] = _registered(
    EventKind("session_start", mirrored=False, seconds_phase=None, shapes={}, check=None),
    # an earlier session without a session_end that a rank's stack file shows hung, found at a session's start
    # (run/hang_evidence.py)
    EventKind("hang_found", mirrored=False, seconds_phase=None, shapes=HANG_FOUND_SHAPES, check=None),
    EventKind("train", mirrored=True, seconds_phase=None, shapes={}, check=None),
    EventKind("val", mirrored=True, seconds_phase="eval", shapes={}, check=None),
    EventKind("checkpoint", mirrored=True, seconds_phase="checkpoint", shapes={}, check=None),
    EventKind("overflow", mirrored=True, seconds_phase=None, shapes={}, check=None),
    EventKind("data_restart", mirrored=False, seconds_phase=None, shapes={}, check=None),
    EventKind("qk_clip", mirrored=False, seconds_phase=None, shapes={}, check=qk_clip_problem),
    EventKind("spike", mirrored=False, seconds_phase=None, shapes=SPIKE_SHAPES, check=None),
    EventKind("rollback", mirrored=False, seconds_phase=None, shapes=ROLLBACK_SHAPES, check=None),
    # a shard's sha256 checked in the background on its first read (training/callbacks/shard_check.py)
    EventKind("shard_check", mirrored=False, seconds_phase=None, shapes={}, check=None),
    # the in-loop multiple-choice tasks' figures (training/callbacks/downstream_eval.py)
    EventKind("downstream", mirrored=True, seconds_phase="eval", shapes={}, check=None),
    # `pilotrun evaluate` on a committed checkpoint, outside any session (report/record_check/evaluations.py)
    EventKind("evaluation", mirrored=True, seconds_phase=None, shapes={}, check=None),
    EventKind("session_end", mirrored=False, seconds_phase=None, shapes={}, check=None),
)
