"""Evaluations on the record, reconciled: does each claim still stand on the checkpoint it names?

`pilotrun evaluate` (commands/evaluate.py) scores a committed checkpoint and appends an `evaluation` event to
metrics.jsonl, outside any training session: the checkpoint's step and counters, the sha256 of its
COMMITTED.json marker (which lists every file's sha256, so it names the weights), its run_id, the harness and
its version, and the results file it wrote under RUN/evals/ with that file's sha256. The event is on the hash
chain, so the claim cannot be edited in the log without showing; this module checks the rest:

- the checkpoint is still committed at that step: otherwise the claim no longer stands, a note (keeping the
  newest checkpoints prunes older ones, which is no fault of the record);
- its marker is the one evaluated (same sha256, this run's run_id): otherwise the checkpoint was replaced
  (another run's copied in, or a later commit at the same step after a rollback), a reason;
- every file of the checkpoint still matches its marker: otherwise it is damaged, a reason;
- the results file is there with the sha256 the event recorded: otherwise it was edited or removed, a reason.

`--require-eval TASK,...` (with summarize's final checkpoint: the `--require-step` step, else the kept
history's last step) holds completion to an evaluation of each task on that checkpoint that stands.

In-loop `downstream` events belong to their sessions and are reconciled with them; only `evaluation` events,
which no session wrote, are left out of the session checks and judged here.
"""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path
from typing import Any

from pilotrun.common.errors import PilotrunError
from pilotrun.common.files import sha256_of_file
from pilotrun.common.parsing import read_json_file
from pilotrun.data.choice_tasks import TASK_SUFFIX
from pilotrun.run.marker import MARKER_NAME, marker_run_id, step_folder
from pilotrun.run.run_folder import RunFolder

EVALUATION_EVENT = "evaluation"
EVALS_DIR = "evals"
STANDS = "stands"


def is_evaluation(event: dict[str, Any]) -> bool:
    return event.get("event") == EVALUATION_EVENT


def marker_sha256(run_dir: str | Path, step: int) -> str | None:
    """sha256 of the bytes of the checkpoint's COMMITTED.json at `step`, or None when there is none."""
    path = step_folder(run_dir, step) / MARKER_NAME
    if path.is_symlink() or not path.is_file():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _where(event: dict[str, Any]) -> str:
    return f"metrics.jsonl line {event.get('_line')} (evaluation of step {event.get('step')})"


def _judge(folder: RunFolder, event: dict[str, Any], damaged: dict[int, list[str]]) -> tuple[str, str | None]:
    """(status, the problem in words or None) of one evaluation event."""
    checkpoint, results = event.get("checkpoint"), event.get("results")
    if not (isinstance(checkpoint, dict) and isinstance(checkpoint.get("step"), int)
            and isinstance(checkpoint.get("marker_sha256"), str) and isinstance(results, dict)
            and isinstance(results.get("path"), str) and isinstance(results.get("sha256"), str)):
        return "malformed", "names no checkpoint (step, marker_sha256) or no results file (path, sha256)"
    step = checkpoint["step"]
    if step not in folder.committed_steps():
        return "checkpoint gone", (
            f"its checkpoint at step {step} is no longer committed in the run (pruned or "
            "removed): the claim cannot be checked against the weights any more"
        )
    marker, problem = folder.marker(step)
    owner = marker_run_id(marker) if marker is not None else None
    if marker is None:
        return "checkpoint damaged", f"its checkpoint at step {step}: {problem}"
    if isinstance(owner, str) and owner != folder.run_id:
        return "checkpoint replaced", (f"its checkpoint at step {step} is now another run's (marker run_id "
                                       f"{owner}): not the weights that were evaluated")
    if marker_sha256(folder.path, step) != checkpoint["marker_sha256"]:
        return "checkpoint replaced", (
            f"its checkpoint at step {step} was replaced: the marker's sha256 differs "
            "from the one evaluated (another commit at that step)"
        )
    if step not in damaged:
        damaged[step] = folder.checkpoint_problems(step)[0]
    if damaged[step]:
        return "checkpoint damaged", f"its checkpoint at step {step} is damaged: {damaged[step][0]}"
    path = Path(results["path"])
    if path.is_absolute() or ".." in path.parts or path.parts[:1] != (EVALS_DIR,):
        return "malformed", f"its results path {results['path']!r} is not a file under {EVALS_DIR}/"
    full = folder.path / path
    if full.is_symlink() or not full.is_file():
        return "results missing", f"its results file {path} is missing"
    if sha256_of_file(full) != results["sha256"]:
        return "results edited", f"its results file {path} was edited after the evaluation (sha256 differs)"
    differs = figures_against_results(event.get("tasks"), full)
    if differs is not None:
        return "figures differ", f"its figures are not its results file's ({path}): {differs}"
    return STANDS, None


def figures_against_results(tasks: Any, results: Path) -> str | None:
    """Where the event's figures (each task's acc, acc_norm, examples) differ from the results file it names,
    or None. The file's sha256 holds the file; only this comparison holds the event to it: an event re-chained
    with other figures beside an untouched file would otherwise stand."""
    try:
        written = read_json_file(results).get("tasks")
    except (PilotrunError, AttributeError):
        return "the results file is not the JSON an evaluation writes"
    if not isinstance(tasks, dict) or not isinstance(written, dict) or set(tasks) != set(written):
        return f"tasks {sorted(tasks) if isinstance(tasks, dict) else tasks!r} against the file's " \
               f"{sorted(written) if isinstance(written, dict) else written!r}"
    for name, figures in sorted(tasks.items()):
        theirs = written[name] if isinstance(written[name], dict) else {}
        for key in ("acc", "acc_norm", "examples"):
            mine = figures.get(key) if isinstance(figures, dict) else None
            if mine != theirs.get(key):
                return f"task {name} {key} {mine!r} in the event, {theirs.get(key)!r} in the file"
    return None


def reconcile_evaluations(folder: RunFolder, reasons: list[str], notes: list[str]) -> list[dict[str, Any]]:
    """One entry per `evaluation` event (module docstring), in file order; what fails is appended to `reasons`
    (replaced, damaged, edited, missing, malformed) or `notes` (a pruned checkpoint)."""
    entries, damaged = [], {}
    for event in folder.metrics.events:
        if not is_evaluation(event):
            continue
        status, problem = _judge(folder, event, damaged)
        checkpoint = event.get("checkpoint") if isinstance(event.get("checkpoint"), dict) else {}
        tasks = event.get("tasks") if isinstance(event.get("tasks"), dict) else {}
        entries.append(
            {
                "line": event.get("_line"),
                "step": checkpoint.get("step"),
                "marker_sha256": checkpoint.get("marker_sha256"),
                "harness": event.get("harness"),
                "harness_version": event.get("harness_version"),
                "results": (event.get("results") or {}).get("path")
                if isinstance(event.get("results"), dict)
                else None,
                "tasks": {
                    name: {k: v for k, v in figures.items() if k in ("acc", "acc_norm", "examples", "chance")}
                    for name, figures in tasks.items()
                    if isinstance(figures, dict)
                },
                "status": status,
            }
        )
        if problem is not None:
            (notes if status == "checkpoint gone" else reasons).append(f"{_where(event)}: {problem}")
    return entries


def require_evaluations(
    entries: list[dict[str, Any]],
    step: int,
    tasks: list[str],
    reasons: list[str],
    run_dir: str | Path = "RUN",
    task_files: list[str] | tuple[str, ...] = (),
) -> None:
    """`--require-eval`: each task evaluated on the final checkpoint (`step`) by an evaluation that stands.
    A task file given by its path is required by its stem (the name evaluate records); the suggested
    command names the run folder (`run_dir`), a missing task file by its path (given, or among `task_files`,
    the recipe's downstream tasks), and `--harness lm-eval` when a task is no file but the harness's name."""
    standing = {name for e in entries if e["step"] == step and e["status"] == STANDS for name in e["tasks"]}
    paths = {Path(path).stem: path for path in task_files}
    named: dict[str, str] = {}  # the name evaluate records -> what its --tasks takes
    stems = []
    for task in tasks:
        if task.endswith(TASK_SUFFIX) or "/" in task or "\\" in task:
            named[Path(task).stem] = task
            stems.append(f"{task} as {Path(task).stem}")
        else:
            named[task] = paths.get(task, task)
    missing = [name for name in named if name not in standing]
    if not missing:
        return
    found = sorted({name for e in entries if e["step"] == step for name in e["tasks"]} - standing)
    specs = [named[name] for name in missing]
    # a name that is no task file is the evaluation harness's own task, which only lm-eval scores
    harness = " --harness lm-eval" if any(named[name] == name for name in missing) else ""
    reasons.append(
        f"--require-eval: no standing evaluation of {', '.join(missing)} on the final checkpoint "
        f"(step {step})"
        + (f" (a task file is named by its stem: {', '.join(stems)})" if stems else "")
        + (
            f"; {', '.join(found)} evaluated there but not standing"
            if found
            else f"; run `pilotrun evaluate {shlex.quote(str(run_dir))} --step {step} "
            f"--tasks {shlex.quote(','.join(specs))}{harness}`"
        )
    )


def format_evaluations(entries: list[dict[str, Any]]) -> list[str]:
    """The summary's lines: each evaluation with its checkpoint and whether it stands."""
    lines = []
    for e in entries:
        figures = ", ".join(filter(None, (_task_figure(name, f) for name, f in e["tasks"].items())))
        marker = (e.get("marker_sha256") or "")[:12]
        lines.append(f"evaluation at step {e['step']} (checkpoint marker {marker}..., {e['harness']} "
                     f"{e['harness_version']}): {figures or 'no figures'}; {e['status']}")
    return lines


def _task_figure(name: str, figures: Any) -> str | None:
    """One task's part of the summary line; an accuracy that was not a finite number is recorded as null
    (commands/evaluate.py) and said so; a task without an accuracy is left out."""
    if not isinstance(figures, dict) or "acc" not in figures:
        return None
    acc = figures["acc"]
    if acc is None:
        return f"{name} acc null (not a finite number) ({figures.get('examples')} examples)"
    if not isinstance(acc, int | float):
        return None
    return f"{name} acc {acc:.3f} ({figures.get('examples')} examples)"
