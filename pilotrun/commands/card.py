"""The run's report card (report_card.py) for the commands that write it: `summarize`, and `evaluate` after
its evaluation."""

from __future__ import annotations

import sys
from typing import Any

from pilotrun.common.errors import PilotrunError
from pilotrun.common.parsing import terminal_safe

NOT_WRITTEN_INVALID = ("report card: not written: the record is invalid (its problems above), and a "
                       "damaged record is left as it was found; a report card there is an earlier one")


def write_card(summary: Any, written_by: str) -> str | None:
    """The report card of the summary just made (report/record_check/report_card.py), or None: for a valid
    record only (an invalid one is evidence, left untouched: the caller says so); a folder that cannot take
    it (read-only, a link where the card goes) is one line on stderr; the command's outcome stands."""
    from pilotrun.report.record_check.report_card import write_report_card

    if not summary.valid:
        return None
    try:
        return str(write_report_card(summary, written_by))
    except (OSError, PilotrunError) as exc:
        print(terminal_safe(f"report card not written: {exc}"), file=sys.stderr)
        return None


def refresh_card(run_dir: str, written_by: str) -> str | None:
    """The card written again from a fresh summary of `run_dir` (after `evaluate` added to the record); a
    record that cannot be summarized is one line on stderr, as above."""
    from pilotrun.report.record_check.summarize import summarize_run

    try:
        summary = summarize_run(run_dir)
    except PilotrunError as exc:
        print(terminal_safe(f"report card not written: {exc}"), file=sys.stderr)
        return None
    return write_card(summary, written_by)
