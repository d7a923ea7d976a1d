"""One branch of a pilot's checks (commands/tune.py): a resume of the pilot from one of its committed
checkpoints into a folder of its own, with a change the resume allows, for a fixed number of updates.

A branch folder is a run folder: the pilot's run.json and metrics.jsonl (so its record names the pilot's
run_id, sessions and the chain up to the checkpoint: its lineage) and the one checkpoint it starts from
(hard links where the file system allows, else copies; a checkpoint's files are never written again once
committed). It is assembled under a temporary name and renamed into place, so a folder of that name is
always whole. `pilotrun train --resume --from-step N` then rolls the copied record back to N, exactly as a
rollback in the pilot's own folder would, and trains the branch as a new session with its change recorded in
run.json's `allowed_changes`: `summarize` and `verdict` read a branch like any run. The pilot's own folder is
only read.

A branch is complete when its own session (one the pilot's run.json does not name) logged a `val` event at
the branch's last update and ended `completed`; anything else found under its name is a branch that was
interrupted, removed and run again.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pilotrun.common.files import fsync_directory
from pilotrun.run.marker import step_folder
from pilotrun.run.record import CHECKPOINTS_DIR, METRICS_JSONL, RUN_JSON, read_metrics_tolerant, read_run_json


@dataclass
class Branch:
    kind: str  # "lr" or "batch"
    value: float  # the LR factor or the batch multiple
    from_step: int
    updates: int  # applied updates of this branch (the same tokens for every batch multiple)
    overrides: list[str] = field(default_factory=list)  # --set KEY=VALUE
    allow: list[str] = field(default_factory=list)  # --allow-change KEY

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.value:.4g}x-from-{self.from_step}"

    @property
    def last_step(self) -> int:
        return self.from_step + self.updates


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def make_branch_folder(pilot_dir: Path, branch_dir: Path, step: int) -> None:
    """The pilot's record and its checkpoint at `step`, assembled beside `branch_dir`, renamed into place."""
    temp = branch_dir.with_name(f".{branch_dir.name}.partial")
    if temp.exists():
        shutil.rmtree(temp)
    (temp / CHECKPOINTS_DIR).mkdir(parents=True)
    for name in (RUN_JSON, METRICS_JSONL):
        shutil.copy2(pilot_dir / name, temp / name)
    source = step_folder(pilot_dir, step)
    shutil.copytree(source, temp / CHECKPOINTS_DIR / source.name, copy_function=_link_or_copy)
    fsync_directory(temp)
    os.rename(temp, branch_dir)
    fsync_directory(branch_dir.parent)


def own_events(branch_dir: Path, pilot_sessions: set[str]) -> list[dict[str, Any]] | None:
    """The branch's own session's events (not the copied pilot's), from one read of its record; None where
    the folder holds no run.json (never assembled)."""
    if not (branch_dir / RUN_JSON).is_file():
        return None
    return [e for e in read_metrics_tolerant(branch_dir).events
            if str(e.get("session_id")) not in pilot_sessions]


def val_loss_of(own: list[dict[str, Any]] | None, last_step: int) -> float | None:
    """The validation loss at the branch's last update among its own events, or None when it did not finish
    (no `val` there, or no `completed` session_end at that step)."""
    own = own or []
    ended = any(e.get("event") == "session_end" and e.get("reason") == "completed"
                and e.get("step") == last_step for e in own)
    losses = [e.get("loss") for e in own if e.get("event") == "val" and e.get("step") == last_step]
    if not ended or not losses or not isinstance(losses[-1], float):
        return None
    return losses[-1]


def clock_start_of(own: list[dict[str, Any]] | None) -> float | None:
    """When the branch's own session's clock started (its session_end's time less its wall seconds), on the
    record's clock; None where it did not end."""
    for event in own or []:
        wall = (event.get("time_split") or {}).get("wall_seconds")
        if event.get("event") == "session_end" and isinstance(wall, float):
            return float(event["time"]) - wall
    return None


def branch_val_loss(branch_dir: Path, pilot_sessions: set[str], last_step: int) -> float | None:
    """The branch's validation loss at its last update, or None when the branch did not finish."""
    return val_loss_of(own_events(branch_dir, pilot_sessions), last_step)


def branch_train_losses(branch_dir: Path, pilot_sessions: set[str]) -> dict[int, float]:
    """The branch's own train-window losses by step (its session's, not the copied pilot's)."""
    return {int(e["step"]): e["loss"] for e in read_metrics_tolerant(branch_dir).events
            if e.get("event") == "train" and str(e.get("session_id")) not in pilot_sessions
            and isinstance(e.get("loss"), float)}


def pilot_session_ids(pilot_dir: Path) -> set[str]:
    run: dict[str, Any] = read_run_json(pilot_dir)
    return {str(s.get("session_id")) for s in run.get("sessions") or [] if isinstance(s, dict)}


def cadence_overrides(branch: Branch) -> list[str]:
    """Free changes that make the branch evaluate exactly at its last update and save only there."""
    return [f"train.max_steps={branch.last_step}", f"train.eval.every={branch.last_step}",
            f"train.checkpoint.every={branch.last_step}"]
