"""Spikes and rollbacks as the record tells them (torch-free): where a rollback cuts the kept history, whether
each one restored a committed checkpoint's counters, and the figures the verdict, summarize and watch read.

A `rollback` event carries the counters of the checkpoint it restored (training/spikes/rollback.py). The work
logged between that checkpoint and the rollback was undone: like the work after the checkpoint a resume
started from, it leaves the kept history (and is counted as rolled back, its training seconds as redone), and
the kept history goes on from the rollback. The `spike` events themselves stay on the record whichever side
they fall: a spike that was rolled back happened all the same.

Once, however often it is on the record: a session killed after a spike (or after its rollback, before the
next checkpoint) is resumed from a checkpoint before it, and the resumed session attempts the same update on
the same data from the same state again, so it logs the same spike (and rollback) a second time. That is one
spike of the run, not two: the interrupted run trained exactly as the uninterrupted one did, and everything
counted from the record (verdict, summarize, watch) counts each attempt once. An attempt is named by the step
it would have made, the batches it read and the counters it was logged at (`spike_key`, `rollback_key`): a
redone attempt repeats all of them, while any other spike differs in one (a later attempt has more updates
attempted or tokens seen).
"""

from __future__ import annotations

import json
from typing import Any

from pilotrun.report.verdict.thresholds import FAIL, PASS, WARN, Finding, Thresholds
from pilotrun.run.record import Counters, is_finite_number


def split_rollbacks(kept: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(kept, rolled back) once every rollback has cut the history at the counters it restored."""
    out: list[dict[str, Any]] = []
    rolled: list[dict[str, Any]] = []
    for event in kept:
        if event.get("event") == "rollback":
            restored = Counters.of(event)
            while out and out[-1].get("event") != "rollback" and not restored.covers(Counters.of(out[-1])):
                rolled.insert(0, out.pop())
        out.append(event)
    rolled.sort(key=lambda e: e.get("_line", 0))
    return out, rolled


def rollback_problems(events: list[dict[str, Any]]) -> list[str]:
    """One reason per rollback whose counters are no committed checkpoint's recorded before it (the step it
    names with the counters the `checkpoint` event recorded): the kept history would not go on from a real
    state."""
    reasons = []
    checkpoints: dict[int, Counters] = {}
    for event in sorted(events, key=lambda e: e.get("_line", 0)):
        kind = event.get("event")
        if kind == "checkpoint":
            checkpoints[int(event["step"])] = Counters.of(event)
        elif kind == "rollback":
            step = event.get("restored_step")
            if checkpoints.get(step) != Counters.of(event):
                reasons.append(
                    f"line {event.get('_line')} (rollback, step {event.get('step')}): restores step "
                    f"{step!r} with counters {Counters.of(event).as_dict()}, which no checkpoint recorded "
                    "before it holds"
                )
    return reasons


def spike_key(event: dict[str, Any]) -> str:
    """Which update attempt a `spike` event is about (the module's docstring): the same for a redone
    attempt."""
    return json.dumps(["spike", event.get("spike_step"), event.get("batches"), event.get("step"),
                       event.get("updates_attempted"), event.get("tokens_seen")], default=str)


def rollback_key(event: dict[str, Any]) -> str:
    """Which rollback a `rollback` event is: the spike it answered and the state and data it restored and
    skipped."""
    return json.dumps(["rollback", event.get("spike_step"), event.get("restored_step"), event.get("skipped"),
                       event.get("updates_attempted"), event.get("tokens_seen")], default=str, sort_keys=True)


def once_each(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events in file order with each spike and rollback kept once (its first record; the module's
    docstring)."""
    seen: set[str] = set()
    out = []
    for event in sorted(events, key=lambda e: e.get("_line", 0)):
        kind = event.get("event")
        key = spike_key(event) if kind == "spike" else rollback_key(event) if kind == "rollback" else None
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        out.append(event)
    return out


def spike_overview(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Every spike and rollback of the record (kept or rolled back), in file order, each once (a resumed
    session's redo of an attempt is not a second spike), and their counts."""
    ordered = once_each(events)
    spikes = [{"step": e.get("spike_step"), "line": e.get("_line"), "action": e.get("action"),
               "cause": e.get("cause"), "signals": e.get("signals"), "loss": e.get("loss"),
               "grad_norm": e.get("grad_norm"), "batches": e.get("batches"),
               "ranks_differing": (e.get("replay") or {}).get("ranks_differing")}
              for e in ordered if e.get("event") == "spike"]
    rollbacks = [
        {
            "line": e.get("_line"),
            "restored_step": e.get("restored_step"),
            "spike_step": e.get("spike_step"),
            "skipped": e.get("skipped"),
            "redo_updates": e.get("redo_updates"),
        }
        for e in ordered
        if e.get("event") == "rollback"
    ]
    return {
        "spikes": len(spikes),
        "rollbacks": len(rollbacks),
        "not_reproducible": sum(1 for s in spikes if s["cause"] == "not_reproducible"),
        "skipped_tokens": sum(
            r["skipped"].get("tokens", 0)
            for r in rollbacks
            if isinstance(r["skipped"], dict) and is_finite_number(r["skipped"].get("tokens"))
        ),
        "list": spikes,
        "rollback_list": rollbacks,
    }


def replay_seconds(events: list[dict[str, Any]]) -> float:
    """Seconds one session spent replaying spikes and restoring checkpoints for rollbacks (the ledger's
    replay)."""
    total = 0.0
    for e in events:
        value = (e.get("replay") or {}).get("seconds") if e.get("event") == "spike" else \
            e.get("seconds") if e.get("event") == "rollback" else None
        if is_finite_number(value):
            total += float(value)
    return total


def describe_spikes(overview: dict[str, Any] | None) -> str | None:
    """summarize's line about spikes, or None when there were none."""
    if not overview or not overview["spikes"]:
        return None
    named = "; ".join(
        f"update {s['step']} {'+'.join(s['signals'] or [])} -> {s['action']}, cause "
        f"{s['cause'] or 'not replayed'}"
        for s in overview["list"][:8]
    )
    more = f" (and {overview['spikes'] - 8} more)" if overview["spikes"] > 8 else ""
    skips = "; ".join(named_skip(r["skipped"]) for r in overview["rollback_list"][:8])
    return (f"spikes: {overview['spikes']} ({named}{more}); rollbacks {overview['rollbacks']}"
            f"{f' ({skips})' if skips else ''}, data skipped by them {overview['skipped_tokens']} tokens")


def named_skip(skipped: Any) -> str:
    """A rollback's skip in words: the batches it stepped over and, where the record names them, the documents
    the spiking batches read, to their end (a record from before rollbacks named documents has the batches
    only)."""
    if not isinstance(skipped, dict) or not all(
        isinstance(skipped.get(k), int) for k in ("first_batch", "batches")
    ):
        return "skip not recorded"
    first, count = skipped["first_batch"], skipped["batches"]
    documents = [d for d in skipped.get("documents") or [] if isinstance(d, dict)]
    named = ", ".join(
        f"{d['source'] + ' ' if d.get('source') else ''}documents {d.get('first')}..{d.get('last')}"
        f" (pass {d.get('pass')})"
        for d in documents
    )
    return f"batches {first}..{first + count - 1}" + (f": {named}" if named else "")


def judge_spikes(summary: Any, t: Thresholds) -> Finding:
    """The `spikes` rule: no spike PASSes; each spike WARNs with its cause and action (never a silent GO);
    more spikes, rollbacks or unreproduced spikes than the thresholds allow FAIL."""
    overview = (summary.overall or {}).get("spikes") or spike_overview(
        summary.kept_events + summary.rolled_back_events
    )
    n, rollbacks, unreproduced = overview["spikes"], overview["rollbacks"], overview["not_reproducible"]
    bound = (
        f"at most {t.max_spikes} spike(s), {t.max_spike_rollbacks} rollback(s), {t.max_unreproduced_spikes} "
        "unreproduced spike(s); any spike WARNs"
    )
    evidence = "spike and rollback events of metrics.jsonl (kept and rolled back)"
    if n == 0 and rollbacks == 0:
        return Finding(PASS, "no spike detected", bound, evidence)
    figure = (f"{n} spike(s), {rollbacks} rollback(s), {unreproduced} not reproducible: "
              + "; ".join(f"update {s['step']} -> {s['action']} (cause {s['cause'] or 'not replayed'}"
                          + (f", rank(s) {s['ranks_differing']}" if s["ranks_differing"] else "") + ")"
                          for s in overview["list"][:6]))
    failed = n > t.max_spikes or rollbacks > t.max_spike_rollbacks or unreproduced > t.max_unreproduced_spikes
    return Finding(FAIL if failed else WARN, figure, bound, evidence)
