"""What a run folder says about continuing the run: its final checkpoint, its resumes and its recipe changes.

These are the facts behind the verdict's "can it continue" rules, read without torch: the checkpoint's
COMMITTED.json marker (written last by the checkpointer) lists every file with its sha256 and size, so the
final checkpoint is checked by rehashing its files against the marker, exactly what a resume would do
before loading them.

A recipe change accepted on resume (`--allow-change`) is recorded in run.json's `allowed_changes` with the
session that made it; the change takes effect from that session's first update, so the evidence for the
recipe in force at the end is only the updates applied after the last change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pilotrun.files import sha256_of_file

# The checkpointer's names (pilotrun.train.checkpoint.MARKER_NAME and step_folder_name), kept here so that
# the report stays free of torch.
MARKER_NAME = "COMMITTED.json"


def step_folder(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def committed_checkpoint_steps(run_dir: str | Path) -> list[int]:
    """Steps of the folders that carry a marker (committed), ascending; nothing is rehashed."""
    root = Path(run_dir) / "checkpoints"
    steps = []
    for folder in root.glob("step-*") if root.is_dir() else []:
        suffix = folder.name[len("step-"):]
        if suffix.isdigit() and (folder / MARKER_NAME).is_file():
            steps.append(int(suffix))
    return sorted(steps)


def checkpoint_problems(run_dir: str | Path, step: int) -> tuple[list[str], int, int]:
    """Rehash the checkpoint at `step` against its marker: (problems, files checked, bytes checked).

    A missing folder, a missing or unreadable marker, a marker for another step, and every missing file or
    file whose size or sha256 differs from the marker is one problem naming the file."""
    folder = step_folder(run_dir, step)
    marker_path = folder / MARKER_NAME
    if not folder.is_dir():
        return [f"{folder}: no checkpoint folder"], 0, 0
    if not marker_path.is_file():
        return [f"{marker_path}: no marker (the checkpoint was never committed)"], 0, 0
    try:
        marker = json.loads(marker_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [f"{marker_path}: unreadable ({exc})"], 0, 0
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or marker.get("step") != step:
        return [f"{marker_path}: lacks 'files' or records another step ({marker.get('step')!r})"], 0, 0
    problems, checked_bytes = [], 0
    for name, expected in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        size = path.stat().st_size
        checked_bytes += size
        if isinstance(expected, dict) and expected.get("bytes") not in (None, size):
            problems.append(f"{path}: {size} bytes, the marker records {expected.get('bytes')}")
        elif not isinstance(expected, dict) or sha256_of_file(path) != expected.get("sha256"):
            problems.append(f"{path}: sha256 differs from the marker's")
    return problems, len(files), checked_bytes


@dataclass
class RecipeChange:
    key: str
    old: Any
    new: Any
    session_id: str
    from_update: int  # the first applied update that used the new value

    def describe(self) -> str:
        return f"{self.key} {_short(self.old)} -> {_short(self.new)} from update {self.from_update}"


def recipe_changes_in_history(run: dict[str, Any], lineage: list[str]) -> list[RecipeChange]:
    """The allowed changes of the sessions in the kept history, in order, each with the update it started at."""
    starts = {str(s.get("session_id")): s.get("start_step") for s in run.get("sessions") or [] if isinstance(s, dict)}
    changes = []
    for entry in run.get("allowed_changes") or []:
        sid = str(entry.get("session_id")) if isinstance(entry, dict) else None
        if sid not in lineage or not isinstance(starts.get(sid), int):
            continue
        changes.append(RecipeChange(key=str(entry.get("key")), old=entry.get("old"), new=entry.get("new"),
                                    session_id=sid, from_update=int(starts[sid]) + 1))
    return changes


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."
