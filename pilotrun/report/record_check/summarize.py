"""`pilotrun summarize`: validate metrics.jsonl against run.json and reconcile every session.

Validation (each failure is one reason naming the line, event and numbers):
- within a session (sessions.py): counters add up window by window, skips match overflow events, the time
  split is an account of the wall clock (time_split.py), no number is non-finite;
- sessions are not interleaved and no session is started twice; run.json and metrics.jsonl agree on each
  session's start;
- a resumed session starts exactly at the counters of a committed checkpoint an earlier session recorded;
  starting anywhere else would count the rolled-back work twice (or lose work);
- the hash chain of metrics.jsonl (record.py): every line follows from the one before it, each session starts
  and ends where run.json says the chain stood, each checkpoint's recorded chain head is a line, and
  run.json's sections equal the digests the latest session_start recorded;
- a data mixture's tokens per source add up to tokens_seen in every train window
  (report/record_check/mixture_account.py);
- `--require-step N`: a `completed` session_end at step N in the kept history, and the checkpoint at N
  committed with every file matching its marker's sha256;
- every `evaluation` event (`pilotrun evaluate`) names a committed checkpoint of this run whose files still
  match, and its results file is as written (evaluations.py); `--require-eval TASK,...` requires a standing
  evaluation of each task on the final checkpoint.

The run folder is read once, through a `RunFolder` (pilotrun/run/run_folder.py): `summarize_run` takes one (or
a path, which it opens), and the verdict and watch hand it the folder they already hold.

Reconciliation: the kept history (lineage) is found by walking back from the last session through the
checkpoints each session resumed from. A session's work after the checkpoint its successor resumed from is
rolled back, and a session nobody resumed from is rolled back entirely; so is the work a spike's rollback
undid (report/record_check/spike_history.py); rolled-back work is reported but never counted in the run's
totals.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pilotrun.common.parsing import one_line, printable_lines
from pilotrun.common.strict_json import strict_dumps
from pilotrun.report.projection.forecast_record import against_own_lock, describe_against
from pilotrun.report.projection.ledger import (
    against_projection,
    format_against,
    format_ledger,
    ledger_problem,
    time_ledger,
)
from pilotrun.report.record_check.evaluations import (
    format_evaluations,
    is_evaluation,
    reconcile_evaluations,
    require_evaluations,
)
from pilotrun.report.record_check.interruptions import (
    against_mtbf,
    costs,
    format_interruptions,
    mtbf_of,
    session_ends,
)
from pilotrun.report.record_check.mixture_account import (
    format_mixture,
    format_source_passes,
    mixture_overview,
    mixture_problems,
    passes_by_source,
)
from pilotrun.report.record_check.sessions import (
    SessionSummary,
    check_session,
    group_sessions,
    session_summary,
)
from pilotrun.report.record_check.spike_history import (
    describe_spikes,
    rollback_problems,
    spike_overview,
    split_rollbacks,
)
from pilotrun.report.record_check.time_split import (
    SPLIT_KEYS,
    SPLIT_PHASES,
    window_train_tokens,
)
from pilotrun.run.changes import RecipeChange, recipe_changes_in_history
from pilotrun.run.folder_lock import live_holder
from pilotrun.run.hang_evidence import hung_without_an_end, recorded_hangs
from pilotrun.run.recipe_lock import describe_frozen_status, frozen_candidate_status, lock_projection_of
from pilotrun.run.record import Counters, is_finite_number, record_integrity_problems
from pilotrun.run.run_folder import RunFolder


@dataclass
class Summary:
    run_dir: str
    run_id: str | None
    valid: bool
    reasons: list[str]
    notes: list[str]
    sessions: list[SessionSummary]
    lineage: list[str]
    overall: dict[str, Any]
    # Not serialized: the events, split into what counts and what was rolled back (for verdict and plots).
    kept_events: list[dict[str, Any]] = field(default_factory=list, repr=False)
    rolled_back_events: list[dict[str, Any]] = field(default_factory=list, repr=False)
    run: dict[str, Any] = field(default_factory=dict, repr=False)
    # the kept history's counters at its end (what the rules count)
    final: Counters = field(default_factory=Counters)
    # The folder it was read from, for the rules that look at checkpoints again (continuity.py): nothing is
    # reread.
    folder: RunFolder | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": self.run_dir,
            "run_id": self.run_id,
            "valid": self.valid,
            "reasons": list(self.reasons),
            "notes": list(self.notes),
            "lineage": list(self.lineage),
            "overall": dict(self.overall),
            "sessions": [dataclasses.asdict(s) for s in self.sessions],
        }


def _count_hangs(run_dir: Path, sessions: list[SessionSummary], starts: dict[str, float],
                 events: list[dict[str, Any]]) -> list[str]:
    """Sessions without a session_end that a rank's stack file shows hung (run/hang_evidence.py: the files, or
    the `hang_found` event a later session's start recorded) are counted hung, each with a note."""
    ended = [(s.session_id, s.end_reason is not None) for s in sessions]
    by_files = hung_without_an_end(run_dir, ended, starts)
    recorded = recorded_hangs(events)
    notes = []
    for summary in sessions:
        evidence = by_files.get(summary.session_id) or recorded.get(summary.session_id)
        if summary.end_reason is not None or evidence is None:
            continue
        summary.end_reason = "hung"
        told = "; a later session's start recorded it (hang_found)" if summary.session_id in recorded else ""
        notes.append(
            f"session {summary.session_id}: no session_end, but a rank wrote its stacks during it "
            f"({evidence.path()}, rank {evidence.rank}{told}): it hung (the stuck rank recorded nothing), "
            "counted as hung, not killed"
        )
    return notes


def _find_resume_point(index: int, resumed_from: int, start: Counters, order: list[str],
                       groups: dict[str, list[dict[str, Any]]]) -> tuple[str, Counters, bool | str] | None:
    """The latest earlier session that recorded committing checkpoint `resumed_from`, its counters, and False.

    Failing that, a session killed between committing that checkpoint and logging its `checkpoint` line: every
    checkpoint is saved right after a `train` event closes the window at the same counters (a `val` event may
    come between), so an earlier session that closed a window at exactly the resumed session's starting
    counters (step `resumed_from`) and logged nothing past them is where the checkpoint came from; then the
    third element is True (a note, not an error). A background save commits after later updates, so a kill
    there leaves more events: the resumed session's start names the session its checkpoint's marker says
    committed it, and the counters it holds (`resumed_checkpoint`): matching an earlier session and these
    counters, that is where the checkpoint came from (the third element "marker", a note too)."""
    for earlier in reversed(order[:index]):
        for event in groups[earlier]:
            if event["event"] == "checkpoint" and event["step"] == resumed_from:
                return earlier, Counters.of(event), False
    for earlier in reversed(order[:index]):
        events = groups[earlier]
        closed_there = any(e["event"] == "train" and Counters.of(e) == start for e in events)
        if closed_there and start.step == resumed_from and Counters.of(events[-1]) == start:
            return earlier, start, True
    marker = groups[order[index]][0].get("resumed_checkpoint")
    if (
        isinstance(marker, dict)
        and marker.get("session_id") in order[:index]
        and marker.get("step") == resumed_from
        and isinstance(marker.get("counters"), dict)
        and marker["counters"] == start.as_dict()
    ):
        return str(marker["session_id"]), start, "marker"
    return None


# What the verdict's rules read from run.json. A record without one of them is invalid: a rule never falls
# back to a default the run may not have used.
RUN_JSON_REQUIRED = (
    "recipe.train.max_steps",
    "recipe.train.memory_budget_gb",
    "recipe.optim.grad_clip",
    "recipe.optim.qk_clip.enabled",
    "recipe.optim.qk_clip.tau",
    "model.config.n_layers",
    "model.config.n_dense_layers",
    "data.train.metadata_sha256",
    "allowed_changes",
    "sessions",
)


def run_json_missing_fields(run: dict[str, Any]) -> list[str]:
    """One reason per field of RUN_JSON_REQUIRED that run.json lacks (or holds as null)."""
    reasons = []
    for dotted in RUN_JSON_REQUIRED:
        node: Any = run
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            reasons.append(f"run.json lacks {dotted}, which the verdict's rules need")
    return reasons


def _downstream_tasks(run: dict[str, Any]) -> list[str]:
    """The recipe's downstream task files (train.downstream.tasks): where `--require-eval` finds a task that
    is named by its stem."""
    train = (run.get("recipe") or {}).get("train") if isinstance(run.get("recipe"), dict) else None
    downstream = train.get("downstream") if isinstance(train, dict) else None
    tasks = downstream.get("tasks") if isinstance(downstream, dict) else None
    return [str(t) for t in tasks] if isinstance(tasks, list) else []


def _run_json_problems(folder: RunFolder) -> list[str]:
    """run.json's own checks and the record's integrity (the hash chain, the checkpoints' chain heads,
    run.json's digests)."""
    run, log = folder.run, folder.metrics
    reasons = []
    if not isinstance(run.get("tokens_per_update"), int) or run["tokens_per_update"] <= 0:
        reasons.append(
            f"run.json: tokens_per_update is {run.get('tokens_per_update')!r}, not a positive integer"
        )
    reasons.extend(run_json_missing_fields(run))
    heads, owners = folder.checkpoint_heads()
    reasons.extend(record_integrity_problems(run, log, heads, owners))
    return reasons


def _check_declared_sessions(run: dict[str, Any], order: list[str], reasons: list[str],
                             notes: list[str]) -> None:
    """run.json's sessions and metrics.jsonl's name the same sessions, in the same order."""
    declared = [str(s.get("session_id")) for s in run.get("sessions") or [] if isinstance(s, dict)]
    for sid in order:
        if sid not in declared:
            reasons.append(f"metrics.jsonl: session {sid} is not listed in run.json's sessions")
    for sid in declared:
        if sid not in order:
            notes.append(
                f"run.json: session {sid} has no events in metrics.jsonl (killed before its first line?)"
            )
    if [s for s in declared if s in order] != order:
        reasons.append("metrics.jsonl: sessions appear in a different order than in run.json")
    if not order:
        reasons.append("metrics.jsonl: no events")


def _check_declared_starts(run: dict[str, Any], order: list[str], checked: dict[str, dict[str, Any]],
                           reasons: list[str]) -> None:
    """Each session's start as run.json records it equals its session_start's."""
    declared_by_id = {str(s.get("session_id")): s for s in run.get("sessions") or [] if isinstance(s, dict)}
    for sid in order:
        entry, start = declared_by_id.get(sid), checked[sid]["start"]
        if entry is None:
            continue
        for key, value in (("start_step", start.step), ("start_tokens_seen", start.tokens_seen),
                           ("resumed_from", checked[sid]["resumed_from"])):
            if key in entry and entry[key] != value:
                reasons.append(
                    f"run.json session {sid}: {key}={entry[key]!r} but its session_start says {value!r}"
                )


def _resume_link(sid: str, index: int, order: list[str], groups: dict[str, list[dict[str, Any]]],
                 checked: dict[str, dict[str, Any]], reasons: list[str],
                 notes: list[str]) -> tuple[str, Counters] | None:
    """A resumed session's link to the checkpoint it starts from: the session that committed it and its
    counters (None when none did), with a reason where its start differs from them."""
    start, resumed_from = checked[sid]["start"], checked[sid]["resumed_from"]
    found = _find_resume_point(index, resumed_from, start, order, groups)
    if found is not None and found[2] == "marker":
        notes.append(
            f"session {sid}: resumed from checkpoint step {resumed_from}, which session {found[0]} "
            "committed (its marker says so, as this session recorded at its start) but whose checkpoint "
            "event never reached metrics.jsonl: killed between the commit and its record"
        )
    elif found is not None and found[2]:
        notes.append(
            f"session {sid}: resumed from checkpoint step {resumed_from}, which session {found[0]} "
            "committed but did not log (it was killed between the two); its last train window ends at "
            "exactly these counters"
        )
    if found is None:
        reasons.append(
            f"session {sid}: resumed from checkpoint step {resumed_from}, but no earlier session "
            "recorded committing that checkpoint"
        )
    elif found[1] != start:
        ckpt = found[1]
        what = ("the rolled-back work would be counted twice" if start.tokens_seen > ckpt.tokens_seen
                or start.updates_attempted > ckpt.updates_attempted else "work would go missing")
        reasons.append(
            f"session {sid}: starts at step {start.step}, tokens_seen {start.tokens_seen}, attempted "
            f"{start.updates_attempted}, skipped {start.updates_skipped}, but the checkpoint at step "
            f"{resumed_from} (session {found[0]}) recorded step {ckpt.step}, tokens_seen "
            f"{ckpt.tokens_seen}, attempted {ckpt.updates_attempted}, skipped {ckpt.updates_skipped}: "
            f"{what}"
        )
    return found[:2] if found is not None else None


def _resume_chain(order: list[str], groups: dict[str, list[dict[str, Any]]],
                  checked: dict[str, dict[str, Any]], reasons: list[str],
                  notes: list[str]) -> dict[str, tuple[str, Counters] | None]:
    """Each resumed session starts exactly at a committed checkpoint's counters; a fresh one at zero (or a
    restart that names what it loses). Returns each session's parent link."""
    parent: dict[str, tuple[str, Counters] | None] = {}
    for index, sid in enumerate(order):
        start, resumed_from = checked[sid]["start"], checked[sid]["resumed_from"]
        if resumed_from is None:
            parent[sid] = None
            if start != Counters():
                reasons.append(
                    f"session {sid}: starts at {dataclasses.asdict(start)} without resuming from a "
                    "checkpoint (a fresh start must begin at zero)"
                )
            _check_restart(sid, index, order, groups, checked, reasons, notes)
            continue
        parent[sid] = _resume_link(sid, index, order, groups, checked, reasons, notes)
    return parent


def _lineage(order: list[str], parent: dict[str, tuple[str, Counters] | None]
             ) -> tuple[list[str], dict[str, Counters | None]]:
    """The kept history: walk back from the last session; each session is cut where its successor
    resumed."""
    lineage: list[str] = []
    cut_at: dict[str, Counters | None] = {}
    sid = order[-1] if order else None
    while sid is not None and sid not in lineage:
        lineage.insert(0, sid)
        cut_at.setdefault(sid, None)
        link = parent.get(sid)
        if link is None:
            break
        cut_at[link[0]] = link[1]
        sid = link[0]
    return lineage, cut_at


def _kept_and_rolled_back(order: list[str], groups: dict[str, list[dict[str, Any]]],
                          checked: dict[str, dict[str, Any]], parent: dict[str, tuple[str, Counters] | None],
                          lineage: list[str], cut_at: dict[str, Counters | None]
                          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[SessionSummary]]:
    """Every event kept or rolled back by the lineage's cuts, and each session's summary with its status."""
    kept_events: list[dict[str, Any]] = []
    rolled_back_events: list[dict[str, Any]] = []
    sessions: list[SessionSummary] = []
    for index, sid in enumerate(order):
        info = checked[sid]
        start, last = info["start"], info["last"]
        if sid in lineage:
            cut = cut_at.get(sid)
            kept_end = cut if cut is not None else last
            for event in groups[sid]:
                (kept_events if cut is None or cut.covers(Counters.of(event)) else rolled_back_events).append(
                    event
                )
            status = "kept" if kept_end == last else "partly rolled back"
        else:
            kept_end = start
            rolled_back_events.extend(groups[sid])
            status = "rolled back"
        sessions.append(session_summary(sid, index, info, parent.get(sid), status, kept_end))
        sessions[-1].restart = restart_of(groups[sid])
    if sessions:
        sessions[-1].latest = True
    return kept_events, rolled_back_events, sessions


def _add_record_sections(overall: dict[str, Any], run: dict[str, Any], lineage: list[str],
                         kept_events: list[dict[str, Any]], rolled_back_events: list[dict[str, Any]]) -> None:
    """The overview's spikes, data mixture, frozen candidate and recipe changes."""
    overall["spikes"] = spike_overview(kept_events + rolled_back_events)
    mixture = mixture_overview(run, kept_events)
    if mixture is not None:  # a run on one folder has no mixture and no such key
        overall["mixture"] = mixture
        # each source restarts alone: its passes are over its own split (the pooled figure hides a small one)
        overall["passes_by_source"] = passes_by_source(run, kept_events)
    overall["frozen_candidate"] = frozen_candidate_status(run)  # None unless started with train --frozen
    overall["recipe_changes"] = {
        kind: [dataclasses.asdict(c) for c in recipe_changes_in_history(run, lineage, kind)]
        for kind in ("allowed", "free")
    }


def _add_time_sections(overall: dict[str, Any], run_dir: Path, run: dict[str, Any],
                       sessions: list[SessionSummary], kept_events: list[dict[str, Any]],
                       rolled_back_events: list[dict[str, Any]], reasons: list[str],
                       notes: list[str]) -> None:
    """Whether the run is still running, its time ledger beside the lock's projection, its interruptions
    and its forecast graded."""
    # A session that has not ended may simply be running: the folder's lock says so (read, never taken).
    holder = live_holder(run_dir)
    overall["running"] = {k: holder.get(k) for k in ("pid", "host", "since")} if holder is not None else None
    if holder is not None and overall["ended"] == NO_SESSION_END:
        overall["ended"] = f"running ({describe_running(overall['running'])})"
    # The time ledger over every session (goodput), and beside the lock's projection where the run has one.
    ledger = time_ledger(sessions, kept_events, rolled_back_events, run)
    problem = ledger_problem(ledger)
    if problem is not None:
        reasons.append(problem)
    notes.extend(ledger.notes)
    overall["time_ledger"] = ledger.to_dict()
    overall["goodput"] = ledger.goodput
    overall["against_projection"] = against_projection(lock_projection_of(run), ledger, overall,
                                                     kept_events + rolled_back_events)
    # Every restart, pre-emption, deadline and hang is a session with its reason: counted, priced, and set
    # beside the lock's MTBF (interruptions.py).
    ends = overall["session_ends"] = session_ends(sessions, holder is not None)
    overall["interruption_costs"] = costs(sessions, ledger, holder is not None)
    overall["against_mtbf"] = against_mtbf(ends, ledger.elapsed_seconds, mtbf_of(lock_projection_of(run)))
    overall["forecast"] = against_own_lock(run, kept_events)  # the lock's val-loss forecast, graded (or None)


def summarize_run(run: RunFolder | str | Path, require_step: int | None = None,
                  require_eval: list[str] | tuple[str, ...] = ()) -> Summary:
    """Validate and reconcile the run folder (module docstring): a RunFolder, or a path opened here once.
    `require_eval`: tasks that must have a standing evaluation of the final checkpoint
    (report/record_check/evaluations.py)."""
    folder = RunFolder.of(run)
    # a run still writing is read as one consistent moment of it, never half before, half after
    folder.snapshot()
    run_dir, run, log = folder.path, folder.run, folder.metrics
    reasons = list(log.damage)
    notes = list(log.notes)
    reasons.extend(_run_json_problems(folder))
    # `pilotrun evaluate`'s events belong to no session: reconciled with their checkpoints (evaluations.py).
    groups = group_sessions([e for e in log.events if not is_evaluation(e)], reasons)
    order = list(groups)
    _check_declared_sessions(run, order, reasons, notes)
    checked = {sid: check_session(sid, groups[sid], run, reasons, notes) for sid in order}
    _check_declared_starts(run, order, checked, reasons)
    parent = _resume_chain(order, groups, checked, reasons, notes)
    lineage, cut_at = _lineage(order, parent)
    kept_events, rolled_back_events, sessions = _kept_and_rolled_back(order, groups, checked, parent,
                                                                      lineage, cut_at)
    starts = {sid: checked[sid]["start_time"] for sid in order}
    notes.extend(_count_hangs(Path(run_dir), sessions, starts, [e for sid in order for e in groups[sid]]))
    # A spike's rollback cuts the kept history at the checkpoint it restored
    # (report/record_check/spike_history.py).
    kept_events, undone = split_rollbacks(kept_events)
    rolled_back_events = sorted(rolled_back_events + undone, key=lambda e: e.get("_line", 0))
    reasons.extend(rollback_problems(log.events))
    reasons.extend(mixture_problems(run, log.events))  # a mixture's tokens per source add up exactly

    final = Counters.of(kept_events[-1]) if kept_events else Counters()
    final_checkpoint = None
    if require_step is not None:
        final_checkpoint = _require_step(folder, require_step, kept_events, final, reasons)
    overall = _overall(run, groups, order, sessions, final, kept_events)
    overall["final_checkpoint"] = final_checkpoint  # None unless --require-step asked for it
    overall["evaluations"] = reconcile_evaluations(folder, reasons, notes)
    if require_eval:
        require_evaluations(overall["evaluations"], require_step if require_step is not None else final.step,
                            list(require_eval), reasons, run_dir=run_dir, task_files=_downstream_tasks(run))
    _add_record_sections(overall, run, lineage, kept_events, rolled_back_events)
    _add_time_sections(overall, run_dir, run, sessions, kept_events, rolled_back_events, reasons, notes)
    return Summary(
        run_dir=str(run_dir),
        run_id=run.get("run_id"),
        valid=not reasons,
        reasons=reasons,
        notes=notes,
        sessions=sessions,
        lineage=lineage,
        overall=overall,
        kept_events=kept_events,
        rolled_back_events=rolled_back_events,
        run=run,
        final=final,
        folder=folder,
    )


def restart_of(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The `restart` a session_start records: a --resume that found no committed checkpoint and began at 0."""
    restart = events[0].get("restart") if events and events[0]["event"] == "session_start" else None
    return restart if isinstance(restart, dict) else None


def _check_restart(sid: str, index: int, order: list[str], groups: dict[str, list[dict[str, Any]]],
                   checked: dict[str, dict[str, Any]], reasons: list[str], notes: list[str]) -> None:
    """A session that starts at zero after others: a restart names the work it loses, and that must be the
    earlier sessions' own last counters (all of it is then rolled back, as the lineage counts it)."""
    restart = restart_of(groups[sid])
    if index == 0:
        if restart is not None:
            reasons.append(f"session {sid}: records a restart from nothing, but no session came before it")
        return
    before = checked[order[index - 1]]["last"]
    if restart is None:
        notes.append(f"session {sid}: a fresh start after {index} earlier session(s); their "
                     f"{before.step} update(s) are counted as rolled back")
        return
    lost = (restart.get("lost_updates"), restart.get("lost_tokens"), restart.get("after_session"))
    if lost != (before.step, before.tokens_seen, order[index - 1]):
        reasons.append(
            f"session {sid}: its restart names {lost[0]} update(s), {lost[1]} tokens lost after session "
            f"{lost[2]}, but session {order[index - 1]} ended at step {before.step}, tokens_seen "
            f"{before.tokens_seen}"
        )
        return
    notes.append(
        f"session {sid}: resumed with no committed checkpoint, so it started again at step 0; the "
        f"{before.step} update(s) ({before.tokens_seen} tokens) before it are lost, counted as rolled back"
    )


def _require_step(folder: RunFolder, step: int, kept_events: list[dict[str, Any]], final: Counters,
                  reasons: list[str]) -> dict[str, Any]:
    """`--require-step N`: the kept history ends with a `completed` session_end at step N, and the checkpoint
    at N is committed with every file matching its marker (the run can be continued from where it claims to
    have ended). Returns what was found for the JSON output."""
    ends = [e for e in kept_events if e["event"] == "session_end" and e["step"] == step]
    if not ends:
        killed = kept_events and kept_events[-1]["event"] != "session_end"
        reasons.append(
            f"--require-step {step}: no session_end at step {step} in the kept history (it ends at step "
            f"{final.step}{', killed without session_end' if killed else ''})"
        )
    elif ends[-1].get("reason") != "completed":
        reasons.append(
            f"--require-step {step}: the session_end at step {step} (line {ends[-1].get('_line')}) has "
            f"reason {ends[-1].get('reason')!r}, not 'completed'"
        )
    problems, files, size = folder.checkpoint_problems(step)
    checkpoint_reasons = [f"--require-step {step}: final checkpoint: {problem}" for problem in problems]
    reasons.extend(checkpoint_reasons)
    return {"step": step, "intact": not problems, "problems": problems, "files": files, "bytes": size,
            "reasons": checkpoint_reasons}


def _overall(
    run: dict[str, Any],
    groups: dict[str, list[dict[str, Any]]],
    order: list[str],
    sessions: list[SessionSummary],
    final: Counters,
    kept_events: list[dict[str, Any]],
) -> dict[str, Any]:
    tpu = run.get("tokens_per_update") if isinstance(run.get("tokens_per_update"), int) else None
    max_steps = None
    for sid in reversed(order):
        first = groups[sid][0]
        if first["event"] == "session_start" and isinstance(first.get("max_steps"), int):
            max_steps = first["max_steps"]
            break
    if max_steps is None:
        max_steps = ((run.get("recipe") or {}).get("train") or {}).get("max_steps")
    train_split_tokens = ((run.get("data") or {}).get("train") or {}).get("tokens")
    # The training phase's tokens: a profiled attempt's tokens go with its seconds, outside train_seconds.
    train_tokens = sum(window_train_tokens(e["window"]) or 0.0 for sid in order for e in groups[sid]
                       if e["event"] == "train" and isinstance(e.get("window"), dict))
    time_split = {k: sum(getattr(s, k) for s in sessions) for k in SPLIT_KEYS}
    planned = max_steps * tpu if isinstance(max_steps, int) and tpu else None
    last_kept = kept_events[-1] if kept_events else {}
    return {
        "updates_applied": final.step,
        "updates_attempted": final.updates_attempted,
        "updates_skipped": final.updates_skipped,
        "tokens_seen": final.tokens_seen,
        "max_steps": max_steps,
        "tokens_planned": planned,
        "tokens_fraction_of_plan": final.tokens_seen / planned if planned else None,
        "passes_over_train_split": final.tokens_seen / train_split_tokens
        if is_finite_number(train_split_tokens) and train_split_tokens > 0
        else None,
        "updates_rolled_back": sum(s.updates_rolled_back for s in sessions),
        "tokens_rolled_back": sum(s.tokens_rolled_back for s in sessions),
        "sessions": len(order),
        "resumes": sum(1 for s in sessions if s.resumed_from is not None),
        "ended": last_kept.get("reason") if last_kept.get("event") == "session_end" else NO_SESSION_END,
        "time_split": time_split,
        # Training-only: every token the hardware processed in the training phase (rolled-back work included,
        # profiled
        # attempts not) per training second.
        "train_tokens_per_s": train_tokens / time_split["train_seconds"]
        if time_split["train_seconds"] > 0
        else None,
        # Effective wall-clock: tokens that count per second of every session's wall clock (losses included).
        "wall_tokens_per_s": final.tokens_seen / time_split["wall_seconds"]
        if time_split["wall_seconds"] > 0
        else None,
    }


NO_SESSION_END = "no session_end (killed, or still running)"


def describe_running(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')}"


def format_summary(summary: Summary) -> str:
    """The human-readable summary printed by `pilotrun summarize`."""
    o = summary.overall
    running = o.get("running")
    lines = [f"run {summary.run_id} ({summary.run_dir}): {'VALID' if summary.valid else 'INVALID'}"]
    # escaped before the column is sized: printable_lines below leaves an escaped name as it is
    names = [one_line(s.session_id) + (" (latest)" if s.latest else "") for s in summary.sessions]
    width = max([len("session"), *map(len, names)])
    header = (f"{'session':<{width}} {'from':>7} {'status':<18} {'end':<13} {'applied':>8} {'skipped':>7} "
              f"{'rolled back':>11} {'tokens':>11} {'train tok/s':>11} {'wall tok/s':>10} "
              f"{'train/eval/ckpt/prof/rep/other s':>32}")
    lines += ["", header, "-" * len(header)]
    for name, s in zip(names, summary.sessions, strict=True):
        split = "/".join(f"{getattr(s, k):.1f}" for k in SPLIT_PHASES)
        start = (
            "restart" if s.restart is not None else str(s.resumed_from if s.resumed_from is not None else "-")
        )
        end = s.end_reason or ("running" if s.latest and running else "killed")
        if end == "completed" and s.resumed_from is not None and s.updates_attempted == 0:
            end = "nothing to do"  # resumed at max_steps: a session that had no update left to run
        lines.append(f"{name:<{width}} {start:>7} {s.status:<18} {end:<13} {s.updates_applied:>8} "
                     f"{s.updates_skipped:>7} "
                     f"{s.updates_rolled_back:>11} {s.tokens_processed:>11} {_fmt(s.train_tokens_per_s):>11} "
                     f"{_fmt(s.wall_tokens_per_s):>10} {split:>32}"
                     f"{'' if s.time_source == 'session_end' else ' (from events)'}")
    t = o["time_split"]
    latest = next((s for s in summary.sessions if s.latest), None)
    unended = f"running, {describe_running(running)}" if running else "killed, or still running"
    lines += [
        "",
        f"latest session: {latest.session_id} ({latest.end_reason or unended} at step "
        f"{latest.last['step']}; {latest.status})"
        if latest
        else "latest session: none",
        f"kept history: {' -> '.join(summary.lineage) or '(none)'}",
        f"updates applied {o['updates_applied']} of max_steps {o['max_steps']}; attempted "
        f"{o['updates_attempted']}, "
        f"skipped {o['updates_skipped']}; rolled back and redone {o['updates_rolled_back']}",
        f"tokens seen {o['tokens_seen']} of planned {o['tokens_planned']} "
        f"({_pct(o['tokens_fraction_of_plan'])}); {_passes_text(o)}; "
        f"rolled-back tokens {o['tokens_rolled_back']}",
        f"throughput: training-only {_fmt(o['train_tokens_per_s'])} tok/s (tokens processed in training / "
        "train "
        "seconds), "
        f"effective wall-clock {_fmt(o['wall_tokens_per_s'])} tok/s (kept tokens / all sessions' wall "
        "seconds)",
        "time: " + ", ".join(f"{k.removesuffix('_seconds')} {t[k]:.1f} s" for k in SPLIT_KEYS),
    ]
    spikes = describe_spikes(o.get("spikes"))
    if spikes is not None:
        lines.append(spikes)
    if o.get("time_ledger") is not None:
        lines.append(format_ledger(o["time_ledger"]))
    if o.get("session_ends") is not None:
        lines.append(
            format_interruptions(o["session_ends"], o.get("interruption_costs") or {}, o.get("against_mtbf"))
        )
    against = format_against(o.get("against_projection"))
    if against is not None:
        lines.append(against)
    forecast = describe_against(o.get("forecast"))
    if forecast is not None:
        lines.append(forecast)
    checkpoint = o.get("final_checkpoint")
    if checkpoint is not None:
        lines.append(f"final checkpoint at step {checkpoint['step']}: "
                     + (f"intact ({checkpoint['files']} file(s), every sha256 matches its marker)"
                        if checkpoint["intact"] else "DAMAGED or missing"))
    mixture = format_mixture(o.get("mixture"))
    if mixture is not None:
        lines.extend(mixture.split("\n"))  # its names one_line'd there: each break is the formatter's
    lines.extend(format_evaluations(o.get("evaluations") or []))
    for kind, what in (
        ("allowed", "changed on resume with --allow-change"),
        ("free", "free changes on resume"),
    ):
        changes = [RecipeChange(**c) for c in (o.get("recipe_changes") or {}).get(kind, [])]
        if changes:
            lines.append(f"{what}: {'; '.join(c.describe() for c in changes)}")
    if o.get("frozen_candidate") is not None:
        lines.append(describe_frozen_status(o["frozen_candidate"]))
    for note in summary.notes:
        lines.append(f"note: {note}")
    for reason in summary.reasons:
        lines.append(f"INVALID: {reason}")
    return printable_lines(lines)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _passes_text(o: dict[str, Any]) -> str:
    """The passes over the training data: one folder's split, or each source's own split of a mixture."""
    by_source = o.get("passes_by_source")
    if by_source:
        return f"passes over each source's training split {format_source_passes(by_source)}"
    if "passes_by_source" in o:
        return "passes over each source's training split n/a (the sources' split tokens are not recorded)"
    return f"passes over the training split {_fmt(o['passes_over_train_split'], 3)}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def summary_json(summary: Summary) -> str:
    return strict_dumps(summary.to_dict(), indent=2)  # never a bare Infinity
