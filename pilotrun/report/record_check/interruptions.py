"""A run's sessions by how they ended, what the unplanned ends cost, and their rate beside the lock's MTBF.

Every start of `pilotrun train` is a session on the record, and every session ends under one reason
(docs/RUN_RECORD.md): `completed`, `interrupted` (a stop signal: a pre-emption, a person, a launcher gone),
`deadline` (ended itself before `--stop-by`), `hung` (the hang watchdog), `error`, `stopped` (the run stopped
itself: skips, spikes, a damaged shard), or none: `killed` (no session_end; SIGKILL, a node lost), or
`running` (the latest session while a process still holds the run folder).

Interruptions are the unplanned ends the next session restarts from, what an MTBF counts: `interrupted`,
`hung`, `error` and `killed`. A deadline is planned (the allocation's end), so it is counted but not as an
interruption.

What an end cost (`costs`): the training it lost (the ledger's `redone` part of that session), the dead time
until the next session started and the next session's start-up, from the time ledger (ledger.py).

Beside the lock's MTBF (`pilotrun freeze --mtbf HOURS`, its projection's `failures.mtbf_hours`): with failures
arriving at random at that mean interval, the number in the run's elapsed time is Poisson with mean elapsed /
MTBF. The run restarts faster than the lock expects when at least as many interruptions as it had are that
unlikely: P(N >= n) < `FASTER_P` (1%). One early failure is not enough to say so; several close together are.
"""

from __future__ import annotations

import math
from typing import Any

from pilotrun.report.projection.ledger import Ledger
from pilotrun.run.record import SESSION_END_REASONS

ENDS = (*SESSION_END_REASONS, "killed", "running")
INTERRUPTIONS = ("interrupted", "hung", "error", "killed")
FASTER_P = 0.01


def session_end_of(summary: Any, running: bool) -> str:
    """The reason a session (report/sessions.SessionSummary) ended, `killed` or `running` without a
    session_end."""
    if summary.end_reason:
        return str(summary.end_reason)
    return "running" if summary.latest and running else "killed"


def session_ends(sessions: list[Any], running: bool) -> dict[str, int]:
    """How many sessions ended under each reason (those that occur), in `ENDS` order."""
    ends = [session_end_of(s, running) for s in sessions]
    return {reason: ends.count(reason) for reason in ENDS if reason in ends}


def costs(sessions: list[Any], ledger: Ledger, running: bool) -> dict[str, dict[str, float]]:
    """Per reason other than completed and running: the sessions, and the seconds they cost (the training they
    lost, the dead time after them, the next session's start-up)."""
    by_id = {entry.session_id: entry for entry in ledger.sessions}
    order = [s for s in sessions if s.session_id in by_id]
    out: dict[str, dict[str, float]] = {}
    for index, summary in enumerate(order):
        reason = session_end_of(summary, running)
        if reason in ("completed", "running"):
            continue
        entry = by_id[summary.session_id]
        following = by_id[order[index + 1].session_id] if index + 1 < len(order) else None
        cost = out.setdefault(reason, {"sessions": 0, "redone_seconds": 0.0, "dead_seconds": 0.0,
                                       "restart_seconds": 0.0, "seconds": 0.0})
        cost["sessions"] += 1
        cost["redone_seconds"] += entry.parts.get("redone", 0.0)
        if following is not None:
            cost["dead_seconds"] += following.dead_before
            cost["restart_seconds"] += following.parts.get("startup", 0.0)
        cost["seconds"] = cost["redone_seconds"] + cost["dead_seconds"] + cost["restart_seconds"]
    return out


def poisson_at_least(n: int, mean: float) -> float:
    """P(N >= n) for N Poisson with `mean`; summed on the side that keeps its precision."""
    if n <= 0:
        return 1.0
    if mean <= 0:
        return 0.0

    def term(k: int) -> float:
        return math.exp(-mean + k * math.log(mean) - math.lgamma(k + 1))

    if n <= mean:
        return max(0.0, 1.0 - math.fsum(term(k) for k in range(n)))
    total, k = 0.0, n
    while True:  # past the mean the terms only fall: stop once they no longer add anything
        value = term(k)
        total += value
        if value <= 1e-18 * total or value == 0.0:
            return min(1.0, total)
        k += 1


def against_mtbf(ends: dict[str, int], elapsed_seconds: float, mtbf_hours: Any) -> dict[str, Any] | None:
    """The run's interruptions beside the lock's MTBF; None without an MTBF or elapsed time."""
    if not isinstance(mtbf_hours, int | float) or isinstance(mtbf_hours, bool) or not mtbf_hours > 0 \
            or not math.isfinite(mtbf_hours) or not elapsed_seconds > 0:
        return None
    count = sum(ends.get(reason, 0) for reason in INTERRUPTIONS)
    hours = elapsed_seconds / 3600.0
    expected = hours / float(mtbf_hours)
    p = poisson_at_least(count, expected)
    return {
        "interruptions": count,
        "elapsed_hours": hours,
        "mtbf_hours": float(mtbf_hours),
        "expected": expected,
        "hours_between": hours / count if count else None,
        "p_at_least": p,
        "faster": count > 0 and p < FASTER_P,
        "from": f"interruptions ({', '.join(INTERRUPTIONS)}) in the run's elapsed time, against a Poisson "
                "count "
        f"of mean elapsed / MTBF; faster when P(at least as many) < {FASTER_P:g}",
    }


def mtbf_of(projection: Any) -> Any:
    """The MTBF a lock's projection states (`freeze --mtbf`), or None."""
    failures = projection.get("failures") if isinstance(projection, dict) else None
    return failures.get("mtbf_hours") if isinstance(failures, dict) else None


def format_interruptions(ends: dict[str, int], cost: dict[str, dict[str, float]],
                         mtbf: dict[str, Any] | None) -> str:
    """One line for `summarize`."""
    counted = ", ".join(f"{reason} {n}" for reason, n in ends.items()) or "none"
    priced = "; ".join(
        f"{reason} cost {c['seconds']:.1f} s (redone {c['redone_seconds']:.1f}, dead "
        f"{c['dead_seconds']:.1f}, restart {c['restart_seconds']:.1f})"
        for reason, c in cost.items()
    )
    line = f"sessions by end: {counted}" + (f"; {priced}" if priced else "")
    if mtbf is not None:
        every = "n/a" if mtbf["hours_between"] is None else f"{mtbf['hours_between']:.3g} h"
        line += (
            f"; {mtbf['interruptions']} interruption(s) in {mtbf['elapsed_hours']:.3g} h (one every {every}) "
            f"against the lock's MTBF {mtbf['mtbf_hours']:g} h (expected {mtbf['expected']:.3g}, "
            f"P(at least as many) {mtbf['p_at_least']:.3g}"
            + (": restarting faster than the lock expects)" if mtbf["faster"] else ")")
        )
    return line
