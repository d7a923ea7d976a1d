"""The report card: one Markdown file in the run folder (CARD_NAME) that a researcher can paste into notes.

`pilotrun summarize` writes it for a valid record (and `pilotrun evaluate` writes it again after its
evaluation), from the summary it has just made: nothing here is measured or computed again. An invalid record
gets none: it is left exactly as found, and its problems are summarize's output. Each figure is the summary's
(or run.json's, or one kept metrics.jsonl line's) and its row says which field or line it comes from: the
model and its parameters, tokens and passes against the plan, the final and best losses, the evaluations with
their chance level and checkpoint, the hardware and the time ledger (goodput), the lock and what was allowed
to change, the interruptions, and the validity of the record. A figure the record does not hold is written
"n/a" and a missing section says what is missing (no evaluation, not started from a lock). The header names
the log's last line and its chain value, so a card older than the record shows it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pilotrun.common.files import write_text_atomic
from pilotrun.common.parsing import printable_lines
from pilotrun.report.projection.forecast_record import val_points
from pilotrun.report.record_check.interruptions import session_end_of
from pilotrun.report.record_check.mixture_account import source_passes
from pilotrun.report.record_check.summarize import Summary
from pilotrun.run.changes import RecipeChange
from pilotrun.run.recipe_lock import describe_difference

CARD_NAME = "report.md"
MODEL_KEYS = ("n_layers", "n_dense_layers", "d_model", "n_heads", "n_routed_experts", "n_shared_experts",
              "top_k", "vocab_size")


def _n(value: Any, digits: int = 4) -> str:
    """A figure as the card prints it: integers with separators, floats to `digits` significant digits."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _cell(value: Any) -> str:
    """A recorded name in a table cell: a `|` in it would end the cell."""
    return str(value).replace("|", "\\|")


def _table(rows: list[tuple[str, str, str]]) -> list[str]:
    lines = ["| | value | from |", "|---|---|---|"]
    lines += [f"| {what} | {value} | {where} |" for what, value, where in rows]
    return lines


def _pct(value: Any) -> str:
    return "n/a" if not isinstance(value, int | float) else f"{100 * value:.1f}%"


def model_section(summary: Summary) -> list[str]:
    model = summary.run.get("model") or {}
    config = model.get("config") or {}
    shape = ", ".join(f"{k} {config[k]}" for k in MODEL_KEYS if k in config)
    return ["## Model", *_table([
        ("parameters", _n(model.get("parameters")), "run.json model.parameters"),
        ("active parameters per token", _n(model.get("active_parameters")),
         "run.json model.active_parameters"),
        ("training FLOP per token", _n(model.get("flops_per_token")), "run.json model.flops_per_token"),
        ("shape", shape or "n/a", "run.json model.config"),
    ])]


def data_section(summary: Summary) -> list[str]:
    o, run = summary.overall, summary.run
    data = run.get("data") or {}
    planned = ((run.get("plan") or {}).get("data") or {}).get("passes")
    rows = [
        ("updates applied", f"{_n(o.get('updates_applied'))} of max_steps {_n(o.get('max_steps'))} (skipped "
         f"{_n(o.get('updates_skipped'))}, rolled back and redone {_n(o.get('updates_rolled_back'))})",
         "summarize overall.updates_applied, max_steps, updates_skipped, updates_rolled_back"),
        ("tokens seen", f"{_n(o.get('tokens_seen'))} of {_n(o.get('tokens_planned'))} planned "
         f"({_pct(o.get('tokens_fraction_of_plan'))})", "summarize overall.tokens_seen, tokens_planned"),
        ("passes over the training split", _n(o.get("passes_over_train_split"), 3),
         "summarize overall.passes_over_train_split (kept tokens / the split's tokens)"),
        ("passes planned", _n(planned, 3), "run.json plan.data.passes (the latest session's plan: max_steps "
         "x tokens_per_update over the loader's pass, whole global batches of the split)"),
        ("data", f"metadata_sha256 {str(data.get('train', {}).get('metadata_sha256'))[:16]}..., train split "
         f"{_n(data.get('train', {}).get('tokens'))} tokens", "run.json data.train"),
    ]
    lines = ["## Tokens and passes", *_table(rows)]
    mixture = o.get("mixture")
    if mixture:
        seq_len = ((run.get("recipe") or {}).get("train") or {}).get("seq_len")
        passes = {r["name"]: r["passes"] for r in source_passes(run, summary.kept_events,
                                                                 seq_len if isinstance(seq_len, int) else 0)}
        lines += ["", f"Mixture (seed {mixture.get('seed')}; summarize overall.mixture, passes per source as "
                  "the verdict's data_passes counts them):", "",
                  "| source | weight | tokens seen | share | passes | last val loss |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {_cell(r['name'])} | {_n(r['weight'])} | {_n(r['tokens_seen'])} | "
                  f"{_pct(r['share_seen'])} | {_n(passes.get(r['name']), 3)} | {_n(r['val_loss'])} |"
                  for r in mixture["sources"]]
    return lines


def loss_section(summary: Summary) -> list[str]:
    trains = [e for e in summary.kept_events if e.get("event") == "train"]
    last = trains[-1] if trains else {}
    vals = [e for e in summary.kept_events if e.get("event") == "val"]
    points = val_points(vals)
    where = f"metrics.jsonl line {last.get('_line')} (the last kept train event)" if last else "no train"
    rows = [("final training loss", f"{_n(last.get('loss'))} at step {_n(last.get('step'))}", where)]
    if points:
        best = min(points, key=lambda p: p[1])
        line_of = {int(e["step"]): e.get("_line") for e in vals}
        rows += [("final validation loss", f"{_n(points[-1][1])} at step {points[-1][0]:,}",
                  f"metrics.jsonl line {line_of.get(points[-1][0])} (the last kept val event)"),
                 ("best validation loss", f"{_n(best[1])} at step {best[0]:,}",
                  f"metrics.jsonl line {line_of.get(best[0])} (the lowest of {len(points)} kept val events)")]
    else:
        rows.append(("validation loss", "none recorded", "no kept val event in metrics.jsonl"))
    return ["## Losses", *_table(rows)]


def _scores(f: dict[str, Any]) -> str:
    return " | ".join(_n(f.get(k)) for k in ("acc", "acc_norm", "chance", "examples"))


def evaluation_section(summary: Summary) -> list[str]:
    entries = summary.overall.get("evaluations") or []
    lines = ["## Evaluations"]
    if not entries:
        lines.append("No evaluation on the record: `pilotrun evaluate RUN --tasks ...` scores a committed "
                     "checkpoint and writes this card again (summarize overall.evaluations is empty).")
    else:
        lines += ["From summarize overall.evaluations (each an `evaluation` event of metrics.jsonl, its "
                  "results file under evals/):", "",
                  "| task | acc | acc_norm | chance | examples | step | checkpoint marker | harness | stands "
                  "| line |", "|---|---|---|---|---|---|---|---|---|---|"]
        for e in entries:
            where = (f"{_n(e.get('step'))} | {str(e.get('marker_sha256'))[:12]} | {e.get('harness')} "
                     f"{e.get('harness_version')} | {e.get('status')} | {e.get('line')}")
            lines += [f"| {_cell(name)} | {_scores(f)} | {where} |" for name, f in e["tasks"].items()]
    downstream = next((e for e in reversed(summary.kept_events) if e.get("event") == "downstream"), None)
    tasks = (downstream or {}).get("tasks")
    if isinstance(tasks, dict) and tasks:
        lines += ["", "In-loop tasks (train.downstream): the last kept `downstream` event, metrics.jsonl "
                  f"line {downstream.get('_line')} at step {_n(downstream.get('step'))}, bound to no "
                  "checkpoint:", "", "| task | acc | acc_norm | chance | examples |", "|---|---|---|---|---|"]
        lines += [f"| {_cell(name)} | {_scores(f)} |" for name, f in tasks.items() if isinstance(f, dict)]
    return lines


def time_section(summary: Summary) -> list[str]:
    o = summary.overall
    ledger = o.get("time_ledger") or {}
    sessions = [s for s in summary.run.get("sessions") or [] if isinstance(s, dict)]
    machines = []
    for s in sessions:
        hw = s.get("hardware") or {}
        machine = (f"{hw.get('device_name') or hw.get('device')} x {hw.get('world_size')}, "
                   f"{hw.get('torch_threads')} thread(s)")
        if machine not in machines:
            machines.append(machine)
    elapsed = ledger.get("elapsed_seconds")
    rows = [("hardware", "; ".join(machines) or "n/a",
             "run.json sessions[].hardware (device_name, world_size, torch_threads)"),
            ("elapsed", f"{_n(elapsed)} s", "summarize overall.time_ledger.elapsed_seconds")]
    for part, seconds in (ledger.get("parts") or {}).items():
        share = seconds / elapsed if isinstance(elapsed, int | float) and elapsed > 0 else None
        rows.append((part, f"{_n(seconds)} s ({_pct(share)})", f"summarize overall.time_ledger.parts.{part}"))
    rows += [("goodput", _pct(o.get("goodput")), "summarize overall.goodput (productive / elapsed)"),
             ("training-only tokens/s", _n(o.get("train_tokens_per_s")),
              "summarize overall.train_tokens_per_s"),
             ("wall-clock tokens/s", _n(o.get("wall_tokens_per_s")), "summarize overall.wall_tokens_per_s")]
    against = o.get("against_projection")
    if isinstance(against, dict) and isinstance(against.get("elapsed_seconds"), dict):
        e = against["elapsed_seconds"]
        rows.append(("elapsed against the lock's projection",
                     f"{_n(e.get('actual'))} s of {_n(e.get('projected'))} s projected (ratio "
                     f"{_n(e.get('ratio'), 3)})",
                     "summarize overall.against_projection.elapsed_seconds"))
    return ["## Hardware and time", *_table(rows)]


def lock_section(summary: Summary) -> list[str]:
    o = summary.overall
    changes = o.get("recipe_changes") or {}
    named = {kind: "; ".join(RecipeChange(**c).describe() for c in changes.get(kind) or []) or "none"
             for kind in ("allowed", "free")}
    rows = [("changed on resume with --allow-change", named["allowed"],
             "summarize overall.recipe_changes.allowed"),
            ("free changes on resume", named["free"], "summarize overall.recipe_changes.free")]
    status = o.get("frozen_candidate")
    if not isinstance(status, dict):
        return ["## Lock", "Not started from a lock (`train --frozen`): run.json has no `frozen` section.",
                "", *_table(rows)]
    frozen = summary.run.get("frozen") or {}
    def listed(differences: Any) -> str:
        return "; ".join(describe_difference(d) for d in differences or []) or "none"

    rows = [("lock sha256", str(status.get("lock_sha256")), "summarize overall.frozen_candidate.lock_sha256"),
            ("lock file", f"{status.get('lock_path')} ({status.get('lock_file')})",
             "summarize overall.frozen_candidate.lock_path, lock_file"),
            ("pilot run", str(status.get("pilot_run_id")), "run.json frozen.pilot_run_id"),
            ("allowed to change", ", ".join(frozen.get("allowed") or []) or "nothing",
             "run.json frozen.allowed"),
            ("differences accepted at the start", listed(frozen.get("differences")),
             "run.json frozen.differences"),
            ("allowed differences now", listed(status.get("allowed_differences")),
             "summarize overall.frozen_candidate.allowed_differences"),
            ("unallowed differences now", listed(status.get("drift")),
             "summarize overall.frozen_candidate.drift"),
            ("runs the frozen candidate", "yes" if status.get("matches") else "NO",
             "summarize overall.frozen_candidate.matches"), *rows]
    return ["## Lock", *_table(rows)]


def interruption_section(summary: Summary) -> list[str]:
    o = summary.overall
    running = o.get("running") is not None
    lines = ["## Sessions and interruptions",
             f"{len(summary.sessions)} session(s), {_n(o.get('resumes'))} resume(s); kept history "
             f"{' -> '.join(summary.lineage) or '(none)'}; ended: {o.get('ended')} (summarize sessions, "
             "overall.resumes, lineage, ended).", "",
             "| session | resumed from | end | status | updates applied | wall s |",
             "|---|---|---|---|---|---|"]
    for s in summary.sessions:
        lines.append(f"| {_cell(s.session_id)} | {_n(s.resumed_from)} | {session_end_of(s, running)} | "
                     f"{s.status} | {_n(s.updates_applied)} | {_n(s.wall_seconds)} |")
    costs = o.get("interruption_costs") or {}
    if costs:
        priced = "; ".join(
            f"{reason}: {c['sessions']} session(s), {_n(c['seconds'])} s (redone {_n(c['redone_seconds'])}, "
            f"dead {_n(c['dead_seconds'])}, restart {_n(c['restart_seconds'])})"
            for reason, c in costs.items()
        )
        lines += ["", f"Cost of each kind of ending (summarize overall.interruption_costs): {priced}"]
    mtbf = o.get("against_mtbf")
    if isinstance(mtbf, dict):
        lines += ["", f"{mtbf['interruptions']} interruption(s) in {_n(mtbf['elapsed_hours'])} h against the "
                  f"lock's MTBF {_n(mtbf['mtbf_hours'])} h: expected {_n(mtbf['expected'])}, P(at least as "
                  f"many) {_n(mtbf['p_at_least'])} (summarize overall.against_mtbf)."]
    return lines


def validity_section(summary: Summary) -> list[str]:
    if summary.valid:
        head = ("The record is VALID: summarize found no problem in run.json and metrics.jsonl (counters, "
                "sessions, resumes, hash chain, checkpoints, evaluations).")
    else:
        head = f"The record is INVALID: summarize lists {len(summary.reasons)} problem(s):"
    lines = ["## Validity of the record", head]
    lines += [f"- {reason}" for reason in summary.reasons]
    if summary.notes:
        lines += ["", f"Notes ({len(summary.notes)}, summarize notes):"]
        lines += [f"- {note}" for note in summary.notes]
    return lines


def report_card(summary: Summary, written_by: str = "pilotrun summarize") -> str:
    """The card's Markdown (module docstring)."""
    events = summary.folder.metrics.events if summary.folder is not None else summary.kept_events
    last = events[-1] if events else {}
    header = [f"# Report card: {summary.run_id}",
              f"Written by `{written_by}` from {summary.run_dir}/run.json and metrics.jsonl up to line "
              f"{last.get('_line')} (its chain value {str(last.get('chain'))[:16]}...: a card whose line is "
              "no longer the log's last is older than the record); every figure names the field or line it "
              "comes from (`summarize --json` has the same fields)."]
    parts = [header, model_section(summary), data_section(summary), loss_section(summary),
             evaluation_section(summary), time_section(summary), lock_section(summary),
             interruption_section(summary), validity_section(summary)]
    # each line as the terminal's printable lines are: a recorded field cannot start a line of its own making
    return "\n\n".join(printable_lines(part) for part in parts) + "\n"


def write_report_card(summary: Summary, written_by: str = "pilotrun summarize") -> Path:
    """The card, CARD_NAME in the run folder, written atomically (never through a link); returns its path."""
    path = Path(summary.run_dir) / CARD_NAME
    write_text_atomic(path, report_card(summary, written_by))
    return path
