"""`pilotrun evaluate RUN [--step N] --tasks T,...`: score a committed checkpoint, bound to its hashes, on the
chain.

Tasks are local multiple-choice task files (data/choice_tasks.py) or, with `--harness lm-eval`, the evaluation
harness's own task names too (commands/lm_eval_model.py). `--harness pilotrun` (the default) scores task files
in-process with the scoring the in-loop callback uses (training/multiple_choice.py), so `evaluate` on the
checkpoint of step N gives the `downstream` figures the loop logged at step N, bit for bit.

What it writes, and only once everything is measured:
- RUN/evals/step-0000000N/<evaluation id>.json: the identity (run_id; the checkpoint's step, counters and the
  sha256 of its COMMITTED.json marker, which lists every file's sha256; the harness and its version; each
  task's version and data sha256; shots, limit, seed, precision, device) and the results;
- an `evaluation` event appended to metrics.jsonl (the same identity, the figures, the results file's path and
  sha256), in an evaluation's own session id: the claim joins the run's hash chain. summarize reconciles it
  with the checkpoint and the file (report/record_check/evaluations.py).
A figure that is not a finite number (an accuracy over no example, a harness's NaN) is null in both, so that
the event and its file still match; the file is strict JSON (common/strict_json.py): no bare NaN or Infinity.

It reads the checkpoint and never writes into it. It never takes the run folder's lock from a trainer: a run
held by a live session is refused before anything is read, and the lock is taken only for the append (a
session that started meanwhile makes it refuse, with nothing written). Bad input (an unknown task, a malformed
task file, a step with no committed checkpoint, a missing extra, a checkpoint of another run) is one line and
exit 2, before anything is written.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

from pilotrun.common.errors import CheckpointError, ConfigError, PilotrunError
from pilotrun.common.files import sha256_of_file, write_text_atomic
from pilotrun.common.strict_json import strict_dumps
from pilotrun.data.choice_tasks import TASK_SUFFIX, ChoiceTask, read_choice_task
from pilotrun.report.record_check.evaluations import EVALS_DIR, marker_sha256
from pilotrun.run.folder_lock import RunFolderLock, describe_holder, live_holder
from pilotrun.run.marker import foreign_run_problem, step_folder_name
from pilotrun.run.record import Counters, read_run_json
from pilotrun.version import __version__

HARNESSES = ("pilotrun", "lm-eval")


def parse_tasks(spec: str, harness: str) -> tuple[list[ChoiceTask], list[str]]:
    """(task files read and checked, harness task names) of `--tasks`; a name is refused unless the harness
    is lm-eval (which checks it against its own list)."""
    files, names = [], []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        if item.endswith(TASK_SUFFIX) or Path(item).exists():
            files.append(read_choice_task(item))
        elif harness == "lm-eval":
            names.append(item)
        else:
            raise PilotrunError(
                f"--tasks: unknown task {item!r}: not a task file ({TASK_SUFFIX}); a task of the "
                "evaluation harness needs --harness lm-eval"
            )
    if not files and not names:
        raise PilotrunError("--tasks: no task named")
    every = [t.name for t in files] + names
    if len(set(every)) != len(every):
        raise PilotrunError(f"--tasks names a task twice: {', '.join(every)}")
    return files, names


def _refuse_live(run_dir: Path) -> None:
    holder = live_holder(run_dir)
    if holder is not None:
        raise PilotrunError(
            f"run folder {run_dir} is held by a live session ({describe_holder(holder)}): evaluate "
            "never writes into a running run; evaluate once the session has ended"
        )


def evaluate_checkpoint(
    run_dir: str | Path,
    tasks: str,
    *,
    step: int | None = None,
    harness: str = "pilotrun",
    data_dir: str | Path | None = None,
    limit: int = 0,
    shots: int = 0,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    """The whole command (module docstring); returns the event's fields and where the results were written."""
    run_dir = Path(run_dir)
    if harness not in HARNESSES:
        raise ConfigError(f"--harness {harness!r}: one of {', '.join(HARNESSES)}")
    if limit < 0 or shots < 0:
        raise ConfigError("--limit and --shots must be >= 0")
    if shots and harness == "pilotrun":
        raise ConfigError(
            "--shots: pilotrun's own scoring is zero-shot; few-shot prompts need --harness lm-eval"
        )
    check_device(device)
    files, names = parse_tasks(tasks, harness)
    if harness == "lm-eval":
        from pilotrun.commands.lm_eval_model import harness_version, import_lm_eval

        import_lm_eval()  # a missing extra is refused before the checkpoint is read
        version = harness_version()
    else:
        version = __version__
    run = read_run_json(run_dir)
    _refuse_live(run_dir)
    scorer, found_step, marker = _scorer(run_dir, step, data_dir, device)
    foreign = foreign_run_problem(marker, run.get("run_id"), run_dir)
    if foreign:
        raise CheckpointError(foreign)
    from pilotrun.training.multiple_choice import choice_beyond_window

    beyond = choice_beyond_window(scorer.encode, files, scorer.max_seq_len, limit)
    if beyond is not None:  # before any scoring: one line, not a traceback from the forward pass
        raise ConfigError(beyond)
    marker_digest = marker_sha256(run_dir, found_step)
    if harness == "pilotrun":
        from pilotrun.training.multiple_choice import score_task

        figures = {}
        for task in files:
            result = score_task(scorer, task, limit)
            figures[result.pop("task")] = {**result, "version": None, "shots": 0}
        output: dict[str, Any] = {}
    else:
        from pilotrun.commands.lm_eval_model import run_harness

        ran = run_harness(scorer, names, files, shots=shots, limit=limit, seed=seed)
        figures, output = ran["tasks"], ran["output"]
    counters = Counters(**(marker.get("meta", {}).get("counters") or {"step": found_step}))
    evaluation_id = uuid.uuid4().hex[:12]
    identity = {"run_id": run.get("run_id"), "evaluation_id": evaluation_id,
                "checkpoint": {"step": found_step, "marker_sha256": marker_digest, **counters.as_dict()},
                "harness": harness, "harness_version": version, "pilotrun_version": __version__,
                "shots": shots, "limit": limit, "seed": seed, "precision": scorer.precision, "device": device,
                "task_sources": {t.name: t.path for t in files} | {n: "harness" for n in names}}
    relative = Path(EVALS_DIR) / step_folder_name(found_step) / f"{evaluation_id}.json"
    return _record(run_dir, run, relative, identity, figures, output, counters)


def check_device(device: str) -> None:
    """`--device` names the CPU or a CUDA device this machine has: anything else is bad input, said in one
    line before the checkpoint is read (torch's own answer is a traceback)."""
    import torch

    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"--device {device!r}: not a device name (cpu, cuda or cuda:N)") from None
    if target.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: pilotrun evaluates on cpu or cuda[:N]")
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device!r}: CUDA is not available on this machine")
    if target.type == "cuda" and target.index is not None and target.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _scorer(run_dir: Path, step: int | None, data_dir: str | Path | None, device: str):
    """The checkpoint's model (rehashed against its marker first) and its data's tokenizer as a Scorer."""
    import torch

    from pilotrun.commands.export import _tokenizer_files, load_checkpoint_model
    from pilotrun.data.tokenizer import plain
    from pilotrun.training.multiple_choice import Scorer

    model, config, meta, found_step, marker = load_checkpoint_model(run_dir, step)
    data = meta.get("data", {})
    source = Path(data_dir) if data_dir is not None else Path(data.get("dir", ""))
    tokenizer_path, eos_id, _ = _tokenizer_files(source, data.get("metadata_sha256"))
    from tokenizers import Tokenizer

    target = torch.device(device)
    model.to(target)
    scorer = Scorer(model, plain(Tokenizer.from_file(str(tokenizer_path))), eos_id, config.model.max_seq_len,
                    config.train.precision, target)
    return scorer, found_step, marker


def _record(run_dir: Path, run: dict[str, Any], relative: Path, identity: dict[str, Any],
            figures: dict[str, Any], output: dict[str, Any], counters: Counters) -> dict[str, Any]:
    """Write the results file and append the event, under the run folder's lock (module docstring)."""
    from pilotrun.run.writer import MetricsWriter

    figures = finite_or_null(figures)  # the event and the file carry the same figures
    lock = RunFolderLock.acquire(run_dir)  # a session started meanwhile: RunFolderBusy, nothing written
    try:
        path = run_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        results = {"identity": identity, "tasks": figures, "harness_output": output}
        write_text_atomic(path, strict_dumps(results, indent=2, sort_keys=True, default=str) + "\n")
        event = {"checkpoint": {"step": identity["checkpoint"]["step"],
                                "marker_sha256": identity["checkpoint"]["marker_sha256"]},
                 "harness": identity["harness"], "harness_version": identity["harness_version"],
                 "shots": identity["shots"], "limit": identity["limit"], "seed": identity["seed"],
                 "tasks": figures, "results": {"path": str(relative), "sha256": sha256_of_file(path)}}
        writer = MetricsWriter(
            run_dir, f"evaluate-{identity['evaluation_id']}", run_id=str(run.get("run_id"))
        )
        try:
            writer.log("evaluation", counters, **event)
        finally:
            writer.close()
    finally:
        lock.release()
    return {**event, "step": identity["checkpoint"]["step"], "written": str(path)}


def finite_or_null(value: Any) -> Any:
    """The figures with every float that is not finite as None (recursively): an accuracy that could not be
    measured is recorded as null, in the event and in its results file alike. Written as strict JSON's
    "NaN" string instead, the event (whose reader turns the string back into a float) would hold NaN, which
    equals nothing, and never match its own file."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(v) for v in value]
    return value
