"""What a run folder says about continuing the run, and the verdict's judges of it: its resumes, its final
checkpoint and its recipe changes on resume. Each returns a Finding; the rule table (rules.py) names it and
says what it means.

These are the facts behind the verdict's "can it continue" rules, read without torch: the checkpoint's
COMMITTED.json marker (written last by the checkpointer) lists every file with its sha256 and size, so the
final checkpoint is checked by rehashing its files against the marker, exactly what a resume would do before
loading them.

Recipe changes accepted on resume are read with `pilotrun.run.changes.recipe_changes_in_history`. The markers
are the ones the summary's run folder already read (pilotrun/run/run_folder.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pilotrun.report.verdict.evidence import window_of
from pilotrun.report.verdict.thresholds import FAIL, PASS, WARN, Finding, Thresholds
from pilotrun.run.changes import recipe_changes_in_history

if TYPE_CHECKING:
    from pilotrun.report.record_check.summarize import Summary


def _window_key(e: dict[str, Any]) -> tuple:
    w = window_of(e)
    return (e["event"], e["step"], e["tokens_seen"], e["updates_attempted"], w.get("updates_applied"),
            w.get("updates_attempted"))


def not_exact_sessions(run: dict[str, Any]) -> dict[str, str]:
    """session_id -> what that resume changed across which bit-exactness is not promised (run.json's
    `not_exact`: the thread count, a numerics software version, the device), in words."""
    out = {}
    for entry in run.get("sessions") or []:
        found = entry.get("not_exact") if isinstance(entry, dict) else None
        if isinstance(found, dict) and found.get("changes"):
            changes = ", ".join(
                f"{c.get('key')} {c.get('old')!r} -> {c.get('new')!r}"
                for c in found["changes"]
                if isinstance(c, dict)
            )
            out[str(entry.get("session_id"))] = f"{changes} from update {found.get('from_update')}"
    return out


def redone_on_other_data(summary: Summary) -> list[tuple[int, int]]:
    """(restored_step, spike_step] of each kept rollback whose cause was the model's state: it restored a
    checkpoint from before the suspect documents and skipped them, so its redone updates read other batches
    than the ones rolled back by design, and their windows are no replay to compare."""
    spans = []
    for e in summary.kept_events:
        restore = e.get("restore") if e["event"] == "rollback" else None
        if isinstance(restore, dict) and restore.get("cause") == "model_state":
            restored, spiked = e.get("restored_step"), e.get("spike_step")
            if isinstance(restored, int) and isinstance(spiked, int):
                spans.append((restored, spiked))
    return spans


def judge_resumed(summary: Summary, t: Thresholds) -> Finding:
    """At least one resume in the kept history, counters continuous, replayed windows bit-identical. A resume
    that changed what exactness depends on (the thread count, a numerics library, the device: run.json's
    `not_exact`) is not promised a bit-identical replay, so the replay itself is the fact: windows replayed
    bit-identical show the continuation (WARN naming the change, across which exactness is not promised);
    windows that differ name the change as their likely cause and prove no continuation (another resume
    must)."""
    sessions = {s.session_id: s for s in summary.sessions}
    resumes = [sid for sid in summary.lineage if sessions[sid].resumed_from is not None]
    not_exact = not_exact_sessions(summary.run)
    # A resume is evidence only when training went on from it: at least one kept update after the restart.
    trained_on = [
        sid for sid in resumes if sessions[sid].updates_applied - sessions[sid].updates_rolled_back > 0
    ]
    continued = [sid for sid in trained_on if sid not in not_exact]
    threshold = (
        ">= 1 resume followed by >= 1 applied update, counters continuous; replayed windows bit-identical"
    )
    kept = {_window_key(e): e for e in summary.kept_events if e["event"] in ("train", "val")}
    # A session that changed the recipe on resume computes other figures after its first update by design.
    changed = {c.session_id for c in recipe_changes_in_history(summary.run, summary.lineage)}
    compared, not_comparable, mismatched, unpromised, excused = 0, 0, [], 0, []
    other_data, skipped_spans = 0, redone_on_other_data(summary)
    for e in summary.rolled_back_events:
        twin = kept.get(_window_key(e)) if e["event"] in ("train", "val") else None
        if twin is None:
            continue
        if any(restored < twin["step"] <= spiked for restored, spiked in skipped_spans):
            other_data += 1
            continue
        if twin["session_id"] in changed:
            not_comparable += 1
            continue
        differ = [
            f"{e['event']} step {e['step']} {key} {e.get(key)!r} before the kill vs {twin.get(key)!r} after "
            "the resume"
            for key in ("loss", "grad_norm")
            if key in e and e.get(key) != twin.get(key)
        ]
        if twin["session_id"] in not_exact:
            unpromised += 1
            excused += [f"{d} (likely cause: {not_exact[twin['session_id']]})" for d in differ]
            continue
        compared += 1
        mismatched += differ
    replay = (f"{compared} replayed window(s) compared, {len(mismatched)} differ" if compared
              else "no replayed window to compare")
    if not_comparable:
        replay += f"; {not_comparable} replayed under a changed recipe, not compared"
    if other_data:
        replay += (f"; {other_data} redone past a model_state rollback's skip (other data by design), "
                   "not compared")
    if unpromised:
        replay += (f"; {unpromised} replayed after a change across which bit-exactness is not promised, "
                   f"{len(excused)} figure(s) differ" + (f", first: {excused[0]}" if excused else ""))
    evidence = "session starts vs committed checkpoints; rolled-back vs replayed windows; run.json not_exact"
    points = ", ".join(f"session {sid} from step {sessions[sid].resumed_from} then "
                       f"{sessions[sid].updates_applied - sessions[sid].updates_rolled_back} update(s)"
                       for sid in continued)
    if mismatched:
        return Finding(FAIL, f"{replay}; first: {mismatched[0]}", threshold, evidence)
    # A damaged final checkpoint makes the record invalid too, but says nothing about the resumes before it:
    # final_checkpoint reports it.
    checkpoint_reasons = (summary.overall.get("final_checkpoint") or {}).get("reasons") or []
    if resumes and any(reason not in checkpoint_reasons for reason in summary.reasons):
        return Finding(FAIL, f"{len(resumes)} resume(s) but the record is invalid (see record_valid)",
                       threshold, evidence)
    if continued:
        return Finding(PASS, f"{len(continued)} resume(s) with training after them: {points}; "
                       f"counters continuous; {replay}", threshold, evidence)
    idle = ", ".join(f"session {sid} from step {sessions[sid].resumed_from}" for sid in resumes)
    if trained_on:
        named = "; ".join(f"session {sid}: {not_exact[sid]}" for sid in trained_on)
        if unpromised and not excused:
            return Finding(
                WARN,
                f"{len(trained_on)} resume(s) with training after them, each across a change "
                f"bit-exactness is not promised across ({named}); {unpromised} replayed window(s) "
                "after it, all bit-identical: the replay shows the continuation",
                threshold,
                evidence,
            )
        missing = (
            f"{len(trained_on)} resume(s) with training after them, each across a change bit-exactness is "
            f"not promised across ({named}); such a resume proves no exact continuation; {replay}"
        )
    else:
        missing = (
            f"{len(resumes)} resume(s) ({idle}) but no update applied after any of them: a run resumed with "
            "nothing left to do proves nothing"
            if resumes
            else "no resume in the kept history"
        )
    if not t.resume_required:
        return Finding(WARN, f"{missing}; waived (--no-resume-required)", threshold, evidence)
    return Finding(FAIL, f"{missing}: the pilot never proved it can continue", threshold, evidence)


def judge_final_checkpoint(summary: Summary, t: Thresholds) -> Finding:
    """The run can be continued from where it ended: its final checkpoint is committed and intact."""
    final_step = summary.final.step
    threshold = (
        "the checkpoint at the final step is committed, this run's (its marker's run_id), and its files "
        "match the marker's sha256"
    )
    evidence = "checkpoints/ marker and files, rehashed"
    checked = summary.overall.get("final_checkpoint")
    # summarize --require-step rehashed it
    if isinstance(checked, dict) and checked.get("step") == final_step:
        problems, files, size = checked["problems"], checked["files"], checked["bytes"]
    else:
        problems, files, size = summary.folder.checkpoint_problems(final_step)
    if problems:
        committed = summary.folder.committed_steps()
        newest = (
            f"; newest committed: step {committed[-1]}" if committed else "; no committed checkpoint at all"
        )
        listed = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        return Finding(FAIL, f"cannot continue from step {final_step}: {listed}{newest}",
                       threshold, evidence)
    return Finding(PASS, f"step {final_step}: {files} file(s), {size / 2**20:.1f} MiB, "
                   "this run's (marker run_id), every sha256 matches its marker", threshold, evidence)


def base_lr_not_applied(summary: Summary, from_update: int) -> str | None:
    """Whether the windows from `from_update` on ran the recipe's peak LR: each train event records its first
    optimizer group's `lr` and `lr_multiplier`, whose ratio is the base LR the optimizer really used; run.json
    names that group's optimizer (muon or adamw), whose `optim.<optimizer>.lr` the recipe holds. A change
    recorded but not applied (the optimizer's saved hyperparameters restored over it) shows here."""
    groups = (summary.run.get("optimizer") or {}).get("groups") or []
    kind = groups[0].get("optimizer") if groups and isinstance(groups[0], dict) else None
    expected = ((summary.run.get("recipe") or {}).get("optim") or {}).get(str(kind), {})
    expected = expected.get("lr") if isinstance(expected, dict) else None
    if not isinstance(expected, int | float) or expected <= 0:
        return None
    for e in summary.kept_events:
        lr, multiplier = e.get("lr"), e.get("lr_multiplier")
        if e["event"] != "train" or e["step"] < from_update or not isinstance(lr, int | float) \
                or not isinstance(multiplier, int | float) or multiplier <= 0:
            continue
        used = lr / multiplier
        if abs(used - expected) > 1e-6 * expected:
            return (
                f"but the window ending at update {e['step']} ran a peak LR of {used:.6g} in group "
                f"{groups[0].get('group')} ({kind}), not the recipe's optim.{kind}.lr = {expected:g}: the "
                "recorded recipe is not the one that ran"
            )
    return None


def judge_recipe_changes(summary: Summary, t: Thresholds) -> Finding:
    """Every recipe change accepted on resume, with the update it took effect from; the evidence supports the
    recipe in force at the end, over the updates since the last change."""
    changes = recipe_changes_in_history(summary.run, summary.lineage)
    free = "; ".join(c.describe() for c in recipe_changes_in_history(summary.run, summary.lineage, "free"))
    free = f"; free changes (no --allow-change needed): {free}" if free else ""
    final_step = summary.final.step
    threshold = "named, with the update each took effect from (a change WARNs; it does not block GO)"
    evidence = (
        "run.json allowed_changes and free_changes of the kept sessions; the recipe in run.json is the one "
        "in force at the end"
    )
    if not changes:
        return Finding(PASS, f"none: all {final_step} updates ran the final recipe{free}", threshold,
                       evidence)
    since = changes[-1].from_update
    covered = max(0, final_step - since + 1)
    described = "; ".join(c.describe() for c in changes)
    not_applied = base_lr_not_applied(summary, since)
    if not_applied:
        return Finding(FAIL, f"{len(changes)} change(s) on resume: {described}, {not_applied}",
                       threshold, evidence + "; lr / lr_multiplier of the train windows")
    return Finding(WARN, f"{len(changes)} change(s) on resume: "
                   f"{'; '.join(c.describe() for c in changes)}. The evidence supports the final recipe over "
                   f"updates {since}..{final_step} ({covered} of {final_step}){free}", threshold, evidence)
