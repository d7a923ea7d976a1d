"""What the verdict's judges read from a summary, and the first judge: that the evidence itself holds.

Every rule reads the kept history (summarize's reconciliation), never the rolled-back work, and the recipe
run.json recorded, never a default: a rule whose evidence the record lacks FAILs rather than guessing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pilotrun.report.thresholds import FAIL, PASS, Finding, Thresholds

if TYPE_CHECKING:
    from pilotrun.report.summarize import Summary


def train_events(summary: Summary) -> list[dict[str, Any]]:
    """The kept history's train windows, in order."""
    return [e for e in summary.kept_events if e["event"] == "train"]


def window_of(event: dict[str, Any]) -> dict[str, Any]:
    """A train event's window counters ({} where the event has none)."""
    window = event.get("window")
    return window if isinstance(window, dict) else {}


def recipe_value(summary: Summary, dotted: str) -> Any:
    """A value of run.json's recipe, or None where the record lacks it (never a default)."""
    node: Any = summary.run.get("recipe")
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def lacks(dotted: str, threshold: str) -> Finding:
    """The FAIL of a rule whose recipe value the record lacks."""
    return Finding(FAIL, f"run.json's recipe lacks {dotted}: this rule cannot be judged", threshold,
                   "run.json recipe")


def judge_record_valid(summary: Summary, t: Thresholds) -> Finding:
    figure = "valid" if summary.valid else f"{len(summary.reasons)} problem(s); first: {summary.reasons[0]}"
    return Finding(PASS if summary.valid else FAIL, figure, "summarize finds no problem",
                   "run.json + metrics.jsonl, every session")
