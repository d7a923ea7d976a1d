"""R/report/: summary.json, the PNG plots and a self-contained report.html.

report.html carries everything inside it (the PNGs as base64 data URIs, inline CSS, no script, no
external link), so it can be mailed or archived alone and still show the rule table, the figures and the
plots. Every figure in it comes from the verdict and summary objects; nothing is typed in by hand. What each
rule checks, the thresholds it was held to and the plot its row links to are the rule table's (rules.py).
"""

from __future__ import annotations

import base64
import dataclasses
import html
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pilotrun.common.files import (
    fsync_directory,
    plain_folder,
    recover_folder,
    swap_in_folder,
    temp_path,
    write_text_atomic,
)
from pilotrun.common.strict_json import strict_dumps
from pilotrun.report.drawing.plots import PLOT_TITLES, write_plots
from pilotrun.report.drawing.run_header import run_identity
from pilotrun.report.drawing.tune_plots import TUNE_PLOT_TITLES, write_run_tune_plots
from pilotrun.report.projection.forecast_record import format_forecast
from pilotrun.report.record_check.mixture_account import format_source_passes
from pilotrun.report.record_check.time_split import SPLIT_KEYS, SPLIT_PHASES
from pilotrun.report.verdict.rules import RULES, THROUGHPUT_STEADY
from pilotrun.report.verdict.thresholds import threshold_meaning
from pilotrun.report.verdict.verdict import Verdict
from pilotrun.run.recipe_lock import describe_frozen_status

if TYPE_CHECKING:
    from pilotrun.report.record_check.sessions import SessionSummary
    from pilotrun.report.record_check.summarize import Summary

REPORT_DIR = "report"
STATUS_COLOURS = {"PASS": "#1a7f37", "WARN": "#9a6700", "FAIL": "#cf222e"}


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _shown_plots(plots: dict[str, Path], precision: str | None) -> dict[str, Path]:
    """The plots the page embeds: loss_scale.png only where the run could scale its loss (fp16 or unknown)."""
    return {name: path for name, path in plots.items() if name != "loss_scale" or precision in ("fp16", None)}


def _rule_cell(name: str, shown: dict[str, Path]) -> str:
    """A rule's name, linked to the plot its row is drawn in where the page shows that plot."""
    plot = {rule.name: rule.plot for rule in RULES}.get(name)
    return f"<a href='#plot-{plot}'>{html.escape(name)}</a>" if plot in shown else html.escape(name)


def _rule_rows(verdict: Verdict, shown: dict[str, Path]) -> str:
    e = html.escape
    return "\n".join(
        f"<tr><td>{_rule_cell(r.name, shown)}</td><td "
        f"style='color:{STATUS_COLOURS[r.status]};font-weight:bold'>{r.status}</td>"
        f"<td>{e(r.figure)}</td><td>{e(r.threshold)}</td><td>{e(r.evidence)}</td></tr>"
        for r in verdict.rules
    )


def _session_rows(sessions: list[SessionSummary]) -> str:
    e = html.escape
    return "\n".join(
        f"<tr><td>{e(s.session_id)}</td><td>{'-' if s.resumed_from is None else s.resumed_from}</td>"
        f"<td>{e(s.status)}</td><td>{e(s.end_reason or 'killed (no session_end)')}</td>"
        f"<td>{s.updates_applied:,}</td><td>{s.updates_skipped:,}</td><td>{s.updates_rolled_back:,}</td>"
        f"<td>{s.tokens_processed:,}</td><td>{_fmt(s.train_tokens_per_s)}</td><td>{_fmt(s.wall_tokens_per_s)}</td>"
        f"<td>{' / '.join(f'{getattr(s, k):.1f}' for k in SPLIT_PHASES)} "
        f"of {s.wall_seconds:.1f}{'' if s.time_source == 'session_end' else ' (from events)'}</td></tr>"
        for s in sessions
    )


def _plot_figures(plots: dict[str, Path], shown: dict[str, Path], precision: str | None) -> str:
    """Each shown plot as a figure with its PNG inside the page; why loss_scale.png is left out if it is."""
    e = html.escape
    images = []
    titles = {**PLOT_TITLES, **TUNE_PLOT_TITLES}
    for name, path in shown.items():
        data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        images.append(f"<figure id='plot-{e(name)}'><img alt='{e(name)}' data-file='{e(Path(path).name)}' "
                      f"src='data:image/png;base64,{data}'><figcaption>{e(titles.get(name, name))} "
                      f"({e(Path(path).name)})</figcaption></figure>")
    if len(shown) < len(plots):
        images.append(
            f"<p>loss_scale.png is left out of this page: a {e(str(precision))} run has no loss scaling "
            "(the scale stays 1.0 and no update is skipped for overflow); the file is in the folder.</p>"
        )
    return "".join(images)


def _failed_headline(verdict: Verdict, shown: dict[str, Path]) -> str:
    e = html.escape
    failed = [r for r in verdict.rules if r.status == "FAIL"]
    failed_items = "".join(
        f"<li><b>{_rule_cell(r.name, shown)}</b>: {e(r.figure)} (needs {e(r.threshold)})</li>" for r in failed
    )
    return f"<ul class='failed'>{failed_items}</ul>" if failed else ""


def _warning_list(verdict: Verdict) -> str:
    e = html.escape
    return (
        (
            "<ul class='warnings'>"
            + "".join(f"<li>WARN {e(r.name)}: {e(r.figure)}</li>" for r in verdict.warnings)
            + "</ul>"
        )
        if verdict.warnings
        else ""
    )


def _evidence_paragraphs(verdict: Verdict) -> str:
    """What is said beside the rules: the frozen candidate's status, the forecast and the tuning lines."""
    e = html.escape
    frozen = f"\n<p>{e(describe_frozen_status(verdict.frozen))}</p>" if verdict.frozen is not None else ""
    if verdict.forecast is not None:  # evidence beside the rules, never one of them (forecast_record.py)
        frozen += f"\n<p>Evidence, not a rule: {e(format_forecast(verdict.forecast))}</p>"
    frozen += "".join(f"\n<p>Evidence, not a rule: {e(line)}</p>" for line in verdict.tuning)
    return frozen


def _record_kind(verdict: Verdict) -> tuple[str, str]:
    """(the title's word, what the footer says the record is): a pilot, or a long run from its lock."""
    lock = str((verdict.frozen or {}).get("lock_sha256"))[:16]
    kind_title = "Pilot" if verdict.frozen is None else "Long-run"
    record_kind = ("a pilot" if verdict.frozen is None
                   else f"a long run from the frozen candidate of lock sha256 {lock}")
    return kind_title, record_kind


def _note_items(summary: Summary) -> str:
    e = html.escape
    # The trainer's own notes (schedule and val warnings, what a resume restored) travel in run.json's
    # sessions.
    session_notes = [f"session {s.get('session_id')}: {n}" for s in summary.run.get("sessions") or []
                     for n in s.get("notes") or []]
    return "".join(f"<li>{e(n)}</li>" for n in [*summary.notes, *session_notes]) or "<li>none</li>"


def _account_facts(summary: Summary) -> list[tuple[str, str]]:
    """The run's account, (what, figure) a row: updates, tokens, passes, throughput, time, goodput."""
    o = summary.overall
    t = o.get("time_split") or {}
    return [
        ("updates applied / max_steps", f"{_fmt(o.get('updates_applied'))} / {_fmt(o.get('max_steps'))}"),
        (
            "updates attempted / skipped",
            f"{_fmt(o.get('updates_attempted'))} / {_fmt(o.get('updates_skipped'))}",
        ),
        ("updates rolled back and redone", _fmt(o.get("updates_rolled_back"))),
        ("tokens seen / planned", f"{_fmt(o.get('tokens_seen'))} / {_fmt(o.get('tokens_planned'))}"),
        # a mixture: each source over its own split (a pooled figure hides a small source read many times)
        ("passes over each source's training split", format_source_passes(o["passes_by_source"]))
        if o.get("passes_by_source") else
        ("passes over the training split", _fmt(o.get("passes_over_train_split"), 3)),
        (
            "training-only throughput (tokens processed in training / train seconds)",
            f"{_fmt(o.get('train_tokens_per_s'))} tok/s",
        ),
        (
            "effective wall-clock throughput (kept tokens / wall seconds of all sessions)",
            f"{_fmt(o.get('wall_tokens_per_s'))} tok/s",
        ),
        (
            "time: train / eval / checkpoint / profile / report / other / wall (s)",
            " / ".join(_fmt(t.get(k)) for k in SPLIT_KEYS),
        ),
        ("sessions (kept history)", f"{o.get('sessions')} ({' -> '.join(summary.lineage)})"),
        (
            "goodput (productive training / elapsed, the time ledger)",
            f"{_fmt(100 * o['goodput'])}%" if o.get("goodput") is not None else "n/a",
        ),
    ]


def _mixture_facts(overall: dict[str, Any]) -> list[tuple[str, str]]:
    """A data mixture's rows: each source against its weight (none for one data folder)."""
    facts = []
    for row in (overall.get("mixture") or {}).get("sources") or []:
        share = "n/a" if row.get("share_seen") is None else f"{100 * row['share_seen']:.2f}%"
        facts.append(
            (
                f"source {row.get('name')}: weight (share) / kept tokens (share) / restarts / last val loss",
                f"{row.get('weight')} ({100 * row.get('share_asked', 0):.2f}%) / {row.get('tokens_seen')} "
                f"({share}) / {row.get('restarts')} / {_fmt(row.get('val_loss'), 4)}",
            )
        )
    return facts


def _rule_meanings(verdict: Verdict, shown: dict[str, Path]) -> str:
    """What each rule checks, with every threshold it names and the value it was held to."""
    e = html.escape
    held_to = dataclasses.asdict(verdict.thresholds)
    return "\n".join(
        f"<dt>{_rule_cell(rule.name, shown)}</dt><dd>{e(rule.meaning)}"
        + (
            "<ul>"
            + "".join(
                f"<li><code>{e(name)}</code> = {e(str(held_to[name]))}: {e(threshold_meaning(name))}</li>"
                for name in rule.thresholds
            )
            + "</ul>"
            if rule.thresholds
            else ""
        )
        + "</dd>"
        for rule in RULES
    )


def _evaluation_rows(overall: dict[str, Any]) -> str:
    e = html.escape
    return "\n".join(
        f"<tr><td>{e(str(x.get('step')))}</td><td><code>{e(str(x.get('marker_sha256'))[:16])}</code></td>"
        f"<td>{e(str(x.get('harness')))} {e(str(x.get('harness_version')))}</td><td>"
        + e("; ".join(f"{name} acc {_fmt(f.get('acc'), 3)}, acc_norm {_fmt(f.get('acc_norm'), 3)} "
                      f"({f.get('examples')} examples)" for name, f in x["tasks"].items()))
        + f"</td><td>{e(x['status'])}</td></tr>" for x in overall.get("evaluations") or []) \
        or "<tr><td colspan='5'>none (pilotrun evaluate RUN --tasks ...)</td></tr>"


def _table_rows(pairs: Iterable[tuple[str, str]]) -> str:
    return "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in pairs)


def render_html(verdict: Verdict, plots: dict[str, Path]) -> str:
    summary = verdict.summary
    e = html.escape
    colour = STATUS_COLOURS["PASS" if verdict.decision == "GO" else "FAIL"]
    precision = ((summary.run.get("recipe") or {}).get("train") or {}).get("precision")
    shown = _shown_plots(plots, precision)
    kind_title, record_kind = _record_kind(verdict)
    problems = "".join(f"<li>{e(r)}</li>" for r in summary.reasons) or "<li>none</li>"
    identity_rows = _table_rows(run_identity(summary.run))
    fact_rows = _table_rows([*_account_facts(summary), *_mixture_facts(summary.overall)])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>pilotrun verdict: {e(str(summary.run_id))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #1f2328; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #d0d7de; padding: 4px 8px; text-align: left; vertical-align: top; }}
th {{ background: #f6f8fa; }}
.identity th {{ width: 12em; }}
.failed {{ color: #cf222e; }}
.decision {{ font-size: 2em; font-weight: bold; color: {colour}; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; border: 1px solid #d0d7de; }}
</style></head><body>
<h1>{kind_title} verdict for run <code>{e(str(summary.run_id))}</code></h1>
<table class="identity">{identity_rows}</table>
<p class="decision">{e(verdict.decision)}</p>
{_failed_headline(verdict, shown)}
{_warning_list(verdict)}
<p>{e(verdict.statement)}</p>{_evidence_paragraphs(verdict)}
<h2>Rules</h2>
<table><tr><th>rule</th><th>status</th><th>figure</th><th>threshold</th><th>evidence</th></tr>
{_rule_rows(verdict, shown)}
</table>
<h3>What each rule checks, and the thresholds it was held to</h3>
<dl class="meanings">{_rule_meanings(verdict, shown)}</dl>
<h2>The run's account</h2>
<table>{fact_rows}</table>
<p>Two throughput figures, measuring different things: the table's <i>training-only</i> figure is every
token processed in training updates over the seconds spent inside them, warm-up windows included (updates run
under the profiler, <code>train.profile</code>, are the profile phase's: neither their tokens nor their
seconds count); the <code>{e(THROUGHPUT_STEADY.name)}</code> rule instead compares the median per-window
training-only rate of the last third of windows with the first third, leaving out each session's first
(warm-up) window and every window with profiled updates, both marked in throughput.png. The
<i>wall-clock</i> figure also pays for evaluation, checkpoints, profiling, reporting, start-up and the time
lost to interruptions.</p>
<h3>Sessions</h3>
<table><tr><th>session</th><th>resumed from</th><th>status</th><th>ended</th><th>applied</th><th>skipped</th>
<th>rolled back</th><th>tokens</th><th>train tok/s</th><th>wall tok/s</th>
<th>train / eval / checkpoint / profile / report / other (s)</th></tr>
{_session_rows(summary.sessions)}
</table>
<h3>Evaluations of checkpoints (pilotrun evaluate)</h3>
<table><tr><th>checkpoint step</th><th>its marker's sha256</th><th>harness</th><th>figures</th>
<th>status</th></tr>
{_evaluation_rows(summary.overall)}
</table>
<h3>Record problems</h3><ul>{problems}</ul>
<h3>Notes</h3><ul>{_note_items(summary)}</ul>
<h2>Plots</h2>
{_plot_figures(plots, shown, precision)}
<p><small>Written by <code>pilotrun verdict</code> from {e(summary.run_dir)}/run.json and metrics.jsonl.
The verdict judges this run's own record ({e(record_kind)}); it does not predict the final model's quality.
</small></p>
</body></html>
"""


def write_report(verdict: Verdict, run_dir: str | Path | None = None) -> Path:
    """Write R/report/ (summary.json, NAME.png for every plot, report.html); returns the folder.

    The whole report is built in a temp folder beside it (`.report.tmp-PID`) and swapped in with renames: a
    full disk or an interrupt halfway through the plots leaves the older report whole and no temp behind, and
    what a SIGKILL leaves is cleaned (an older copy put back) by the next verdict. RUN/report as a link, or a
    file, is refused before anything is written."""
    out = Path(run_dir if run_dir is not None else verdict.summary.run_dir) / REPORT_DIR
    plain_folder(out, create=False)
    for line in recover_folder(out):
        print(f"pilotrun: {line}", file=sys.stderr)  # named where the user looks; cleaned before writing
    temp = temp_path(out)
    temp.mkdir()
    try:
        plots = write_plots(verdict.summary, temp)
        plots.update(write_run_tune_plots(verdict.summary.run_dir, temp))  # where `pilotrun tune` ran
        write_text_atomic(temp / "summary.json", strict_dumps(verdict.to_dict(), indent=2) + "\n")
        write_text_atomic(temp / "report.html", render_html(verdict, plots))
        fsync_directory(temp)
        swap_in_folder(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return out
