"""Recipe changes in a run's history: what `--allow-change` accepted on resume, and from which update, and the
free changes (a resume-free key such as the evaluation or checkpoint cadence) recorded the same way. A key
recorded under its earlier flat name is read in today's (config/renames.py).

A change accepted on resume is recorded in run.json's `allowed_changes` with the session that made it; it
takes effect from that session's first update, so the evidence for the recipe in force at the end of a run is
only the updates applied after its last change. The verdict, the frozen lock and the report read changes here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pilotrun.config import current_key


@dataclass
class RecipeChange:
    key: str
    old: Any
    new: Any
    session_id: str
    from_update: int  # the first applied update that used the new value

    def describe(self) -> str:
        return f"{self.key} {_short(self.old)} -> {_short(self.new)} from update {self.from_update}"


def recipe_changes_in_history(
    run: dict[str, Any], lineage: list[str], kind: str = "allowed"
) -> list[RecipeChange]:
    """The allowed changes (`kind` "allowed") or the free ones ("free": keys of config.RESUME_FREE_KEYS, which
    need no --allow-change) of the sessions in the kept history, in order, each with the update it started
    at."""
    starts = {
        str(s.get("session_id")): s.get("start_step")
        for s in run.get("sessions") or []
        if isinstance(s, dict)
    }
    changes = []
    for entry in run.get(f"{kind}_changes") or []:
        sid = str(entry.get("session_id")) if isinstance(entry, dict) else None
        if sid not in lineage or not isinstance(starts.get(sid), int):
            continue
        changes.append(
            RecipeChange(
                key=current_key(str(entry.get("key"))),
                old=entry.get("old"),
                new=entry.get("new"),
                session_id=sid,
                from_update=int(starts[sid]) + 1,
            )
        )
    return changes


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."
