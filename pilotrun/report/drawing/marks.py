"""The run's loud moments as marks on the plots, taken from the record's events: a data pass boundary (the
training split, or a mixture's source, read again from its start: the loss drop that follows is the data, not
the recipe), a spike, a rollback (the span of updates undone and redone) and a recipe change at resume.

`run_marks(summary)` says where and what (a plain list a test reads); `draw_marks(ax, marks, kinds)` draws the
kinds a plot shows: a vertical line per mark (a shaded span per rollback) with its short label along the top
of the axes, and one legend entry per kind. The training log says each of them when it happens
(training/notices.py, training/spikes/rollback.py); these are the same moments, read back from metrics.jsonl
and run.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pilotrun.common.parsing import terminal_safe
from pilotrun.report.record_check.spike_history import once_each
from pilotrun.report.record_check.summarize import Summary
from pilotrun.run.changes import recipe_changes_in_history
from pilotrun.run.values import is_int

MARK_KINDS = ("pass", "spike", "rollback", "recipe_change")
# kind -> (legend label, colour, line style)
MARK_STYLES = {
    "pass": ("data pass boundary", "C2", "--"),
    "spike": ("spike", "C3", "-"),
    "rollback": ("rolled back (undone and redone)", "C3", None),
    "recipe_change": ("recipe change at resume", "C4", "-."),
}


def drawn(value: Any) -> str:
    """A recorded string (a session id, a group or task name) as a plot may draw it: a control character or a
    terminal escape written as its Python escape, as the text output prints it (the font has no glyph for
    them), and a dollar sign escaped, so that a name can never switch the label into matplotlib's math
    mode."""
    return terminal_safe(str(value)).replace("$", r"\$")


@dataclass(frozen=True)
class Mark:
    kind: str  # one of MARK_KINDS
    step: int  # where it is drawn (a rollback's restored step)
    label: str  # the short text drawn along the top of the plot
    end: int | None = None  # a rollback's span ends at the step of the spike it undid


def _restarted_sources(train: list[dict[str, Any]], step: int) -> list[str]:
    """A mixture's sources whose restarts grew over the windows around `step` (`restarts_by_source`)."""
    before = [e for e in train if e["step"] < step]
    after = [e for e in train if e["step"] >= step]
    if not after or not isinstance(after[0].get("restarts_by_source"), dict):
        return []
    old = (before[-1].get("restarts_by_source") or {}) if before else {}
    return [name for name, count in after[0]["restarts_by_source"].items()
            if is_int(count) and count > (old.get(name) or 0)]


def pass_marks(summary: Summary) -> list[Mark]:
    """One mark per step where the training split (or a mixture's source) was read again from its start."""
    train = [e for e in summary.kept_events if e.get("event") == "train" and is_int(e.get("step"))]
    marks: dict[int, Mark] = {}
    for event in summary.kept_events:
        if event.get("event") != "data_restart" or not is_int(event.get("step")) or event["step"] in marks:
            continue
        step = event["step"]
        sources = _restarted_sources(train, step)
        label = (f"source {', '.join(sources)} again" if sources else
                 f"pass {int(event['epoch']) + 1}" if is_int(event.get("epoch")) else "data again")
        marks[step] = Mark("pass", step, label)
    return list(marks.values())


def spike_marks(summary: Summary) -> list[Mark]:
    """Each spike once (a redone attempt logs it again), at the step it would have made, and each rollback as
    the span it undid: from the restored step to the spike's."""
    events = summary.kept_events + summary.rolled_back_events
    spikes = once_each([e for e in events if e.get("event") == "spike" and is_int(e.get("spike_step"))])
    rollbacks = once_each([e for e in events if e.get("event") == "rollback"
                           and is_int(e.get("restored_step")) and is_int(e.get("spike_step"))])
    marks = [Mark("spike", e["spike_step"], f"spike ({e.get('action', '?')})") for e in spikes]
    marks += [Mark("rollback", e["restored_step"], f"rollback to {e['restored_step']}", end=e["spike_step"])
              for e in rollbacks]
    return sorted(marks, key=lambda m: (m.step, m.kind))


def recipe_change_marks(summary: Summary) -> list[Mark]:
    """One mark per resumed session of the kept history that changed the recipe, at the step it resumed from:
    the keys it changed, allowed (--allow-change) or free."""
    by_step: dict[int, list[str]] = {}
    for kind in ("allowed", "free"):
        for change in recipe_changes_in_history(summary.run, summary.lineage, kind):
            by_step.setdefault(change.from_update - 1, []).append(change.key)
    return [Mark("recipe_change", step, "changed " + ", ".join(keys))
            for step, keys in sorted(by_step.items())]


def run_marks(summary: Summary) -> list[Mark]:
    """Every mark of the run, in step order."""
    marks = pass_marks(summary) + spike_marks(summary) + recipe_change_marks(summary)
    return sorted(marks, key=lambda m: (m.step, MARK_KINDS.index(m.kind)))


def draw_marks(ax, marks: list[Mark], kinds: tuple[str, ...] = MARK_KINDS) -> None:
    """Draw the marks of `kinds` on `ax`: a line (a span for a rollback) and its label along the top."""
    labelled: set[str] = set()
    top = ax.get_xaxis_transform()  # x in data, y in axes fractions: the label stays at the top
    for mark in marks:
        if mark.kind not in kinds:
            continue
        name, colour, style = MARK_STYLES[mark.kind]
        legend = name if mark.kind not in labelled else None
        labelled.add(mark.kind)
        if mark.end is not None:
            ax.axvspan(mark.step, mark.end, color=colour, alpha=0.12, label=legend)
        else:
            ax.axvline(mark.step, color=colour, linestyle=style, linewidth=1.0, alpha=0.8, label=legend)
        ax.text(mark.step, 0.98, drawn(mark.label), transform=top, rotation=90, va="top", ha="right",
                fontsize=6, color=colour, clip_on=True)
