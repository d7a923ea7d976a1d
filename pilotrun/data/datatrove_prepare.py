"""`pilotrun prepare --engine datatrove`: the same data folder, written by datatrove's readers and executors.

Flow: every refusal `pilotrun prepare` makes of its options, source and tokenizer is made first, here, before
anything is written (datatrove_inputs.py); then the partial folder `OUT.partial` (prepare_state's: locked, its
request recorded in progress.json, a rerun with other inputs refused) gets tokenizer.json and the paths file
(the files in their seeded order), and datatrove runs T tasks of [reader, SplitByTextHash, WriteTaskShards]
(datatrove_steps.py) with its logs, completion marks and stats in the logs folder (`OUT.logs` unless --logs
says otherwise; kept after the run). With the local executor the command runs the tasks (at most --workers at
a time), then the merge (datatrove_finish.py); with the slurm executor it submits the task array and a
one-task merge job that depends on it (afterok) and returns. A rerun of the same command skips the tasks
datatrove marked complete (their folders are reused as they are) and gives the same bytes; each task's output
depends only on its rank and the task count, never on --workers.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any

from pilotrun.common.errors import DataError
from pilotrun.data.datatrove_finish import (
    ENGINE,
    finish_prepare,
    forget_marks_without_output,
    incomplete_line,
    incomplete_tasks,
)
from pilotrun.data.datatrove_inputs import DatatroveInputs, resolve_inputs
from pilotrun.data.hub import HubClient
from pilotrun.data.identity import request_options
from pilotrun.data.prepare import SPLIT_RULE, _check_options, _check_replaceable, _write_text, default_workers
from pilotrun.data.prepare_state import PartialFolder, recover_replaced
from pilotrun.data.shards import TOKENIZER_FILE
from pilotrun.data.tokenizer import resolve_tokenizer

PATHS_FILE = "input_files.txt"
EXECUTORS = ("local", "slurm")


@dataclass
class SlurmOptions:
    """What datatrove's SlurmPipelineExecutor takes of a cluster: the lines a user changes for theirs."""

    partition: str | None = None
    time: str = "24:00:00"
    cpus_per_task: int = 1
    mem_per_cpu_gb: int = 2
    qos: str = "normal"
    job_name: str = "pilotrun-prepare"
    env_command: str | None = None  # e.g. "source /path/to/.venv/bin/activate"
    max_array_size: int = 1001
    sbatch_args: dict[str, str] = field(default_factory=dict)


@dataclass
class Submitted:
    """What the slurm executor submitted (the command returns once the jobs are queued)."""

    tasks: int
    tasks_job: str | None  # None: every task was already complete
    merge_job: str
    logs: str


def datatrove_version() -> str:
    try:
        from importlib.metadata import version

        import datatrove  # noqa: F401
    except ImportError:
        raise DataError("--engine datatrove needs datatrove: pip install 'pilotrun[datatrove]'") from None
    return version("datatrove")


def prepare_with_datatrove(
    out: str | os.PathLike,
    source: str,
    tokenizer: str,
    *,
    eos: str | None = None,
    text_field: str = "text",
    train_tokens: int | None = None,
    val_fraction: float = 0.01,
    shard_tokens: int = 2**24,
    seed: int = 0,
    tasks: int | None = None,
    workers: int = 0,
    executor: str = "local",
    slurm: SlurmOptions | None = None,
    logs: str | None = None,
    force: bool = False,
    hub: HubClient | None = None,
) -> dict[str, Any] | Submitted:
    """Prepare `source` into `out` with datatrove; the manifest (local) or what was submitted (slurm)."""
    version = datatrove_version()
    _check_options(None, val_fraction, shard_tokens, 0, 0, workers)
    _check_engine_options(train_tokens, tokenizer, tasks, executor, slurm)
    out = os.path.normpath(os.fspath(out))
    inputs = resolve_inputs(source, text_field, seed)
    tasks = len(inputs.names) if tasks is None else int(tasks)
    resolved = resolve_tokenizer(tokenizer, eos, None, hub)
    for line in recover_replaced(out, force):
        print(f"pilotrun prepare: {line}", file=sys.stderr)
    if os.path.lexists(out):
        if not force:
            raise DataError(f"{out} already exists: choose another --out or pass --force to replace it")
        _check_replaceable(out)
    logs = os.path.abspath(logs or out + ".logs")
    import tokenizers

    software = {"python": platform.python_version(), "tokenizers": tokenizers.__version__, ENGINE: version}
    options = request_options(
        train_tokens=None,
        val_fraction=val_fraction,
        shard_tokens=int(shard_tokens),
        seed=seed,
        shuffle_buffer=0,
        shuffle_buffer_bytes=0,
        text_field=text_field,
        eos=eos,
    )
    request = {"engine": ENGINE, "source": inputs.identity(), "tokenizer": str(tokenizer).strip(),
               "options": options, "software": software, "tasks": tasks, "order": inputs.order_record(tasks)}
    staging = _open_staging(out, request, resolved, inputs, logs)
    plan = {
        "shard_tokens": int(shard_tokens),
        "dtype": resolved.dtype,
        "eos_id": resolved.eos_id,
        "tokenizer": resolved.identity,
        "options": options,
        "split_rule": SPLIT_RULE,
        "software": software,
        "text_field": text_field,
        "folder": inputs.folder,
        "kind": inputs.kind,
        "ordered_names": inputs.ordered_names(),
    }
    pipeline = _pipeline(inputs, staging, plan, val_fraction)
    if executor == "slurm":
        return _submit(pipeline, tasks, workers, logs, slurm or SlurmOptions(), out, force)
    _run_local(pipeline, tasks, workers, logs, staging)
    return finish_prepare(out, force)


def _check_engine_options(train_tokens: int | None, tokenizer: str, tasks: int | None, executor: str,
                          slurm: SlurmOptions | None) -> None:
    if train_tokens is not None:
        raise DataError(
            "--train-tokens is not taken by --engine datatrove: each task writes all of its files, "
            "and a cap would depend on which task reached it first; choose the input files instead"
        )
    if str(tokenizer).strip().startswith("bpe:"):
        raise DataError(
            f"--tokenizer {tokenizer}: --engine datatrove encodes with a given tokenizer (training "
            "one needs a pass over the whole training split first): train it once with `pilotrun "
            "prepare` and pass its tokenizer.json"
        )
    if tasks is not None and (int(tasks) != tasks or int(tasks) < 1):
        raise DataError(f"--tasks must be a positive whole number, got {tasks}")
    if executor not in EXECUTORS:
        raise DataError(f"--executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    if executor == "slurm" and not (slurm and slurm.partition):
        raise DataError("--executor slurm needs --slurm-partition (the partition the task array runs on)")


def _open_staging(out: str, request: dict[str, Any], resolved, inputs: DatatroveInputs, logs: str) -> str:
    """The partial folder, created with the tokenizer and paths file, or reopened when the request is the
    same."""
    partial = PartialFolder(out)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        recorded = partial.open()
    except OSError as exc:
        raise DataError(f"--out {out}: cannot create the output folder ({exc.strerror or exc})") from None
    try:
        if recorded is not None:
            partial.refuse_changes(recorded["request"], request)
            partial.refuse_changes({"tokenizer": recorded["tokenizer"]}, {"tokenizer": resolved.identity})
        else:
            _write_text(os.path.join(partial.path, TOKENIZER_FILE), resolved.json_text)
            _write_text(
                os.path.join(partial.path, PATHS_FILE), "".join(f"{n}\n" for n in inputs.ordered_names())
            )
        partial.commit({"request": request, "tokenizer": resolved.identity, "state": None, "logs": logs})
        forget_marks_without_output(partial.path, logs, request["tasks"])
    except BaseException:
        partial.put_back_untouched()  # refused before its commit: the staging folder as it found it
        raise
    finally:
        partial.close()
    return partial.path


def _pipeline(inputs: DatatroveInputs, staging: str, plan: dict[str, Any], val_fraction: float) -> list:
    from datatrove.pipeline.readers import JsonlReader, ParquetReader

    from pilotrun.data.datatrove_steps import SplitByTextHash, WriteTaskShards, row_adapter

    common = {"data_folder": inputs.folder, "paths_file": os.path.join(staging, PATHS_FILE),
              "text_key": inputs.text_field, "adapter": row_adapter}
    if inputs.kind == "jsonl":
        reader = JsonlReader(**common)
    else:  # only the text and id columns when every file has an id (FineWeb's), else every column
        reader = ParquetReader(**common, read_metadata=not inputs.has_id)
    return [reader, SplitByTextHash(val_fraction), WriteTaskShards(staging, plan)]


def _run_local(pipeline: list, tasks: int, workers: int, logs: str, staging: str) -> None:
    from datatrove.executor import LocalPipelineExecutor

    workers = min(tasks, int(workers) or default_workers())
    executor = LocalPipelineExecutor(pipeline, tasks=tasks, workers=workers, logging_dir=logs)
    failure = None
    try:
        executor.run()
    except Exception as exc:  # a task's own error, re-raised by datatrove (its log holds the traceback)
        failure = exc
    incomplete = incomplete_tasks(staging, logs, tasks)
    if incomplete:
        why = f" (first error: {' '.join(str(failure).split())[:200]})" if failure is not None else ""
        raise DataError(f"{incomplete_line(logs, incomplete, tasks)}{why}; the completed tasks are kept: run "
                        "the same command again to redo the others")
    if failure is not None:
        raise failure


def _submit(pipeline: list, tasks: int, workers: int, logs: str, slurm: SlurmOptions, out: str,
            force: bool) -> Submitted:
    from datatrove.executor import SlurmPipelineExecutor

    from pilotrun.data.datatrove_steps import FinishPrepare

    common = {
        "time": slurm.time,
        "partition": slurm.partition,
        "qos": slurm.qos,
        "env_command": slurm.env_command,
        "sbatch_args": dict(slurm.sbatch_args),
        "mem_per_cpu_gb": slurm.mem_per_cpu_gb,
        "slurm_logs_folder": os.path.join(logs, "slurm_logs"),
    }
    task_jobs = SlurmPipelineExecutor(
        pipeline,
        tasks=tasks,
        workers=int(workers) or -1,
        job_name=slurm.job_name,
        cpus_per_task=slurm.cpus_per_task,
        max_array_size=slurm.max_array_size,
        logging_dir=logs,
        **common,
    )
    merge_job = SlurmPipelineExecutor(
        [FinishPrepare(out, force)],
        tasks=1,
        job_name=f"{slurm.job_name}-merge",
        logging_dir=os.path.join(logs, "merge"),
        depends=task_jobs,
        **common,
    )
    merge_job.run()
    tasks_job = None if task_jobs.job_id in (None, -1) else str(task_jobs.job_id)
    return Submitted(tasks=tasks, tasks_job=tasks_job, merge_job=str(merge_job.job_id), logs=logs)


def submitted_line(out: str, submitted: Submitted) -> str:
    tasks = (f"{submitted.tasks} tasks as SLURM job array {submitted.tasks_job}" if submitted.tasks_job else
             f"no task (all {submitted.tasks} were complete)")
    return (
        f"submitted {tasks}, and the merge as job {submitted.merge_job} after them (afterok): {out} appears "
        f"when it ends; logs in {submitted.logs} (slurm_logs/, logs/task_NNNNN.log); if a task fails, run "
        "the same command again: completed tasks are skipped"
    )
