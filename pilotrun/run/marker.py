"""A checkpoint's commit marker, read and checked without torch.

Every committed checkpoint folder `checkpoints/step-00000100/` carries COMMITTED.json, written last by the
checkpointer (training/checkpoint/checkpointer.py): the step, every file's sha256 and byte count, and the
caller's meta. A folder without it was never committed. This module holds the marker's names and the rules for
trusting one, so that the checkpointer (which loads), and summarize and the verdict (which only need to know
whether the run can be continued from a step) apply the same rules; the readers here import no torch.

A marker's file names must be plain names inside the step folder: a name with a separator or `..` would make a
reader open and hash a file outside the run. A step folder, marker or file that is a symbolic link is refused
for the same reason (a link can point into another run).

A marker names the run that wrote it (`run_id`, also in its meta): a checkpoint copied in from a sibling run
(another seed, the same recipe) has valid files and a valid marker, and only its run_id tells it apart. A
marker written before markers carried one has none; it is accepted as the folder's own, with a note, since
nothing in it can prove otherwise and refusing would strand every older run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pilotrun.common.errors import PilotrunError
from pilotrun.common.files import sha256_of_file
from pilotrun.common.parsing import read_json_file
from pilotrun.run.record import CHECKPOINTS_DIR, METRICS_JSONL, RUN_JSON

MARKER_NAME = "COMMITTED.json"


def step_folder_name(step: int) -> str:
    return f"step-{step:08d}"


def step_folder(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / step_folder_name(step)


def marker_files_problem(files: dict[str, Any]) -> str | None:
    """Why a marker's `files` table cannot be trusted, or None: plain names inside the step folder, each
    entry with its sha256 and byte count."""
    for name, entry in files.items():
        if (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name
                or name == MARKER_NAME):
            return f"lists {name!r}, which is not a plain file name inside the step folder"
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and type(entry.get("bytes")) is int and entry["bytes"] >= 0):
            return f"entry {name!r} lacks a sha256 string and a byte count"
    return None


def marker_step_problem(marker: dict[str, Any], step: int) -> str | None:
    """Why a marker's `step` is not its folder's step, or None. Only a plain integer equal to the folder's
    number counts: JSON's Infinity / NaN (or 1e999, read as infinity), 4.0 or true are not a step an update
    counter could have written, and must not pass as one (4.0 == 4 and True == 1 in Python)."""
    recorded = marker.get("step")
    if not isinstance(recorded, int) or isinstance(recorded, bool):
        return f"records step {recorded!r}, not an integer step"
    if recorded != step:
        return f"records step {recorded}, not its folder's step {step}"
    return None


def marker_run_id(marker: dict[str, Any]) -> str | None:
    """The run a marker says wrote it: its own `run_id`, else its meta's (markers of the first format), else
    None (a marker older than run identity)."""
    run_id = marker.get("run_id")
    meta = marker.get("meta")
    if not isinstance(run_id, str) and isinstance(meta, dict):
        run_id = meta.get("run_id")
    return run_id if isinstance(run_id, str) else None


def foreign_run_problem(marker: dict[str, Any], run_id: Any, where: str | Path) -> str | None:
    """Why the checkpoint whose marker this is belongs to another run than `run_id` (run.json's), or None
    (the same run, or a marker that names no run)."""
    theirs = marker_run_id(marker)
    if theirs is None or not isinstance(run_id, str) or theirs == run_id:
        return None
    return (f"{where}: a checkpoint of another run (its marker's run_id is {theirs!r}, this run folder's "
            f"run.json says {run_id!r})")


def committed_checkpoint_steps(run_dir: str | Path) -> list[int]:
    """Steps of the plain step folders that carry a marker (committed), ascending; nothing is rehashed."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir() or root.is_symlink():
        return []
    steps = []
    for folder in root.glob("step-*"):
        suffix = folder.name[len("step-"):]
        if suffix.isdigit() and not folder.is_symlink() and (folder / MARKER_NAME).is_file():
            steps.append(int(suffix))
    return sorted(steps)


def read_marker(run_dir: str | Path, step: int) -> tuple[dict[str, Any] | None, str | None]:
    """(marker, None) for the committed checkpoint at `step`, or (None, why it cannot be trusted)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    folder = step_folder(run_dir, step)
    marker_path = folder / MARKER_NAME
    for link in (root, folder, marker_path):
        if link.is_symlink():
            return (
                None,
                f"{link}: a symbolic link; refused (checkpoints are plain folders and files in the run)",
            )
    if not folder.is_dir():
        return None, f"{folder}: no checkpoint folder"
    if not marker_path.is_file():
        return None, f"{marker_path}: no marker (the checkpoint was never committed)"
    try:
        marker = read_json_file(marker_path, f"{marker_path}: unreadable:")
    except PilotrunError as exc:
        return None, str(exc)
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or marker_step_problem(marker, step) is not None:
        return None, f"{marker_path}: lacks 'files' or records another step"
    problem = marker_files_problem(files)
    if problem:
        return None, f"{marker_path}: {problem}"
    return marker, None


def checkpoint_problems(run_dir: str | Path, step: int, run_id: Any = None,
                        already_read: tuple[dict[str, Any] | None, str | None] | None = None
                        ) -> tuple[list[str], int, int]:
    """Rehash the checkpoint at `step` against its marker: (problems, files checked, bytes checked).
    `already_read` is what read_marker returned for it, where the caller read it already (run_folder.py).

    A missing folder, a missing, unreadable or untrustworthy marker, a marker for another step, a marker of
    another run than `run_id` (when given), and every missing file or file whose size or sha256 differs from
    the marker is one problem naming the file: exactly what a resume would refuse before loading."""
    marker, problem = already_read if already_read is not None else read_marker(run_dir, step)
    if marker is None:
        return [str(problem)], 0, 0
    foreign = foreign_run_problem(marker, run_id, step_folder(run_dir, step))
    if foreign:
        return [foreign], 0, 0
    folder = step_folder(run_dir, step)
    problems, checked_bytes = [], 0
    for name, expected in sorted(marker["files"].items()):
        path = folder / name
        if path.is_symlink() or not path.is_file():
            problems.append(f"{path}: {'a symbolic link' if path.is_symlink() else 'missing'}")
            continue
        size = path.stat().st_size
        checked_bytes += size
        if size != expected["bytes"]:
            problems.append(f"{path}: {size} bytes, the marker records {expected['bytes']}")
        elif sha256_of_file(path) != expected["sha256"]:
            problems.append(f"{path}: sha256 differs from the marker's")
    return problems, len(marker["files"]), checked_bytes


def resume_problem(run_dir: Path) -> str | None:
    """Why a run folder cannot be resumed for its record, or None: no run.json; or committed checkpoints
    without the metrics.jsonl every judge reads, where neither "nothing to do" (the checkpoints may say
    complete) nor a session on a new chain would leave a run anyone could check. Without a committed
    checkpoint (a first start killed between run.json and its first line) nothing is lost: the run starts at
    step 0 again."""
    if not (run_dir / RUN_JSON).is_file():
        return f"--resume: {run_dir / RUN_JSON} not found; nothing to resume (start without --resume)"
    if (run_dir / METRICS_JSONL).exists() or not any((run_dir / CHECKPOINTS_DIR).glob(f"*/{MARKER_NAME}")):
        return None
    return (
        f"--resume: {run_dir / METRICS_JSONL} not found beside its {RUN_JSON}: the run's record is lost; "
        "restore it from a copy (resuming or calling the run complete without it would leave nothing to "
        "check "
        "the run against)"
    )
