"""`pilotrun verdict`: GO or NO-GO for a pilot, from the documented rules (rules.py) over the kept history of
the run.

Each rule gives PASS, WARN or FAIL with the figure it measured; the pilot is GO when no rule FAILs. WARN means
the evidence is thin or borderline (shown, not blocking). The rules judge the run's own record (a pilot's, or
a long run's started from a frozen candidate, and the statement says which): a GO says
"this recipe ran without the listed problems for these updates", never that the final model will be good.

Only the kept history counts (summarize's reconciliation): windows a crashed session logged after the
checkpoint its successor resumed from are rolled back. They are still useful once: where the resumed session
replayed the same window (same step range and counters), its loss must be bit-identical to the rolled-back
one, which is direct evidence of exact continuation.

What each rule checks, the thresholds it reads with their defaults and meanings, and the plot that shows its
evidence are the rule table's (rules.py; `pilotrun verdict --help` prints it). A rule that finds the evidence
it needs missing from the record FAILs. GO means no rule FAILed; the WARNs are printed under the GO line.

`judge(run)` summarizes with `--require-step max_steps`: a pilot that has not finished is not valid. It opens
the run folder once (pilotrun/run/run_folder.py); both summaries read from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pilotrun.common.files import canonical_sha256
from pilotrun.common.parsing import printable_lines
from pilotrun.common.strict_json import strict_dumps
from pilotrun.config import current_recipe
from pilotrun.report.projection.forecast_record import format_forecast, pilot_forecast
from pilotrun.report.record_check.summarize import Summary, summarize_run
from pilotrun.report.verdict.rules import RULES, THROUGHPUT_STEADY
from pilotrun.report.verdict.thresholds import (
    FAIL,
    WARN,
    RuleResult,
    Thresholds,
)
from pilotrun.report.verdict.tuning import tune_evidence_lines
from pilotrun.run.changes import recipe_changes_in_history
from pilotrun.run.recipe_lock import describe_frozen_status, frozen_candidate_status
from pilotrun.run.run_folder import RunFolder

# The throughput rule judged alone, by the name tests/training/test_trainer_observers.py reaches it with.
rule_throughput_steady = THROUGHPUT_STEADY.apply


@dataclass
class Verdict:
    decision: str  # "GO" or "NO-GO"
    rules: list[RuleResult]
    statement: str
    thresholds: Thresholds
    summary: Summary = field(repr=False)
    # The recipe the evidence supports (the one in force at the end), its sha256 and the changes on resume.
    candidate: dict[str, Any] = field(default_factory=dict)
    # the frozen candidate a run started from, and whether it still matches
    frozen: dict[str, Any] | None = None
    # What a 10x long run of the recipe would reach (report/projection/forecast_record.py): evidence, not a
    # rule.
    forecast: dict[str, Any] | None = None
    # What the learning-rate and batch checks found (`pilotrun tune`, tuning.py): evidence, not a rule.
    tuning: list[str] = field(default_factory=list)

    @property
    def provisional(self) -> bool:
        """Judged while a session still holds the run folder: the record may still grow."""
        return bool(self.summary.overall.get("running"))

    @property
    def warnings(self) -> list[RuleResult]:
        return [r for r in self.rules if r.status == WARN]

    def to_dict(self) -> dict[str, Any]:
        return {"decision": self.decision, "statement": self.statement, "provisional": self.provisional,
                "rules": [dataclasses.asdict(r) for r in self.rules],
                "failed": [r.name for r in self.rules if r.status == FAIL],
                "warnings": [dataclasses.asdict(r) for r in self.warnings], "candidate": self.candidate,
                "frozen": self.frozen, "forecast": self.forecast, "tuning": self.tuning,
                "thresholds": dataclasses.asdict(self.thresholds),
                "summary": self.summary.to_dict()}


def candidate_of(summary: Summary) -> dict[str, Any]:
    """The recipe the pilot's evidence supports: run.json's (in force at the end), with the changes on
    resume."""
    changes = recipe_changes_in_history(summary.run, summary.lineage)
    recipe = current_recipe(summary.run.get("recipe"))  # its identity in today's names, of any recipe format
    final_step = summary.final.step
    return {"recipe_sha256": canonical_sha256(recipe) if isinstance(recipe, dict) else None,
            "changes": [dataclasses.asdict(c) for c in changes],
            "supported_from_update": changes[-1].from_update if changes else 1, "final_step": final_step}


def judged_on(summary: Summary, frozen: dict[str, Any] | None) -> str:
    """What the verdict judged, in words: the run's own record (its id), and which kind of run it is: a
    pilot, or a long run started from a frozen candidate (the lock's sha256 and the pilot it was frozen from),
    so that a long run's verdict never reads as the pilot's."""
    o = summary.overall
    run_id = summary.run.get("run_id")
    figures = (f"{o.get('updates_applied')} applied updates, {o.get('tokens_seen')} tokens, "
               f"{o.get('sessions')} session(s) with {o.get('resumes')} resume(s)")
    if frozen is None:
        return f"Judged on the pilot's own record (run {run_id}): {figures}."
    lock = str(frozen.get("lock_sha256"))[:16]
    return (f"Judged on this long run's own record (run {run_id}, started from the frozen candidate of lock "
            f"sha256 {lock}, frozen from pilot run {frozen.get('pilot_run_id')}), not the pilot's: "
            f"{figures}.")


def judge_summary(summary: Summary, thresholds: Thresholds | None = None) -> Verdict:
    t = thresholds or Thresholds()
    rules = [rule.apply(summary, t) for rule in RULES]
    failed = [r.name for r in rules if r.status == FAIL]
    warned = [r.name for r in rules if r.status == WARN]
    o = summary.overall
    decision = "NO-GO" if failed else "GO"
    candidate = candidate_of(summary)
    frozen = frozen_candidate_status(summary.run)
    basis = judged_on(summary, frozen)
    sha = str(candidate["recipe_sha256"])[:16]
    changes = f" after {len(candidate['changes'])} change(s) on resume" if candidate["changes"] else ""
    supports = (f"The evidence supports the recipe in force at the end (recipe sha256 {sha}), over updates "
                f"{candidate['supported_from_update']}..{candidate['final_step']}"
                f"{changes}.")
    running = o.get("running")
    if running:  # judged on what is recorded so far: the rules may read differently once the run ends
        basis = (
            f"Provisional: the run is still going (pid {running.get('pid')} on host {running.get('host')} "
            f"since {running.get('since')}); judged on the record so far. {basis}"
        )
    if failed:
        statement = f"NO-GO: {', '.join(failed)} failed. {basis}"
    else:
        statement = (
            f"GO: no rule failed{' (warnings: ' + ', '.join(warned) + ')' if warned else ''}. {basis} "
            f"{supports} This says the recipe ran without the problems checked here for this long; it does "
            "not say the final model will be good."
        )
    return Verdict(decision=decision, rules=rules, statement=statement, thresholds=t, summary=summary,
                   candidate=candidate, frozen=frozen,
                   forecast=pilot_forecast(summary), tuning=tune_evidence_lines(summary.run_dir))


def judge(run: RunFolder | str | Path, thresholds: Thresholds | None = None) -> Verdict:
    """Judge a finished pilot: the record must also hold a session_end at its max_steps (the last
    session's)."""
    folder = RunFolder.of(run)
    summary = summarize_run(folder)
    max_steps = summary.overall.get("max_steps")
    if isinstance(max_steps, int):
        summary = summarize_run(folder, require_step=max_steps)
    return judge_summary(summary, thresholds)


def format_verdict(verdict: Verdict) -> str:
    width = max(len(r.name) for r in verdict.rules)
    lines = [f"{'rule':<{width}}  status  figure  [threshold]"]
    for r in verdict.rules:
        lines.append(f"{r.name:<{width}}  {r.status:<6}  {r.figure}  [{r.threshold}]")
    lines += ["", f"VERDICT: {verdict.decision}"]
    lines += [f"  WARN {r.name}: {r.figure}" for r in verdict.warnings]
    lines.append(verdict.statement)
    if verdict.forecast is not None:
        lines.append(f"evidence, not a rule: {format_forecast(verdict.forecast)}")
    lines += [f"evidence, not a rule: {line}" for line in verdict.tuning]
    if verdict.frozen is not None:
        lines.append(describe_frozen_status(verdict.frozen))
    return printable_lines(lines)


def verdict_json(verdict: Verdict) -> str:
    return strict_dumps(verdict.to_dict(), indent=2)  # never a bare Infinity
