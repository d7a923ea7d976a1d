"""The data commands of the command line: `prepare`, `data verify` and `data merge` (parsing only; the work is
in pilotrun/data/). Kept apart from cli.py so that each file stays one screenful of commands."""

from __future__ import annotations

import argparse
import math
import sys

from pilotrun.common.errors import PilotrunError


# ---------------------------------------------------------------------------------------------- prepare
def add_prepare(sub: argparse._SubParsersAction) -> None:
    from pilotrun.data.sources import source_help

    p = sub.add_parser(
        "prepare",
        help="turn a text source into token shards + metadata.json",
        description="Prepare an identifiable token stream: read a source, shuffle in a bounded seeded "
                    "buffer, "
        "split train/val by a hash of each document's text, tokenize (EOS after every document) and write "
        ".npy shards with a metadata.json manifest. The same inputs give byte-identical output.",
    )
    p.add_argument(
        "--out",
        required=True,
        help="output folder (refused if it exists, unless --force); built as "
        "OUT.partial, which the same command continues after an interruption",
    )
    p.add_argument("--source", default="builtin", help=source_help())
    p.add_argument("--tokenizer", default="bpe:4096",
                   help="bpe:VOCAB (train a byte-level BPE on the train split) | hub:NAME[@REVISION] | "
                   "path/to/tokenizer.json")
    p.add_argument(
        "--eos", default=None, help="name the end-of-document token (none: found in the tokenizer)"
    )
    p.add_argument("--text-field", default="text", help="column/field holding the text (parquet, jsonl)")
    p.add_argument(
        "--train-tokens",
        type=float,
        default=None,
        help="stop after the complete document that reaches at least N training tokens (none: the whole "
        "source)",
    )
    p.add_argument("--val-fraction", type=float, default=0.01, help="fraction of documents sent to val")
    p.add_argument("--shard-tokens", type=float, default=2**24, help="tokens per shard file")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed")
    p.add_argument(
        "--shuffle-buffer", type=int, default=10000, help="most documents the shuffle buffer holds"
    )
    p.add_argument("--shuffle-buffer-bytes", type=float, default=64 << 20,
                   help="most bytes of text the shuffle buffer holds (long documents count for their size)")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="0: tokenizing threads on all cores, 1: no thread, N >= 2: N tokenizing processes; same output",
    )
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--progress", choices=("auto", "bar", "plain", "none"), default="auto",
                   help="auto: a redrawn bar when stderr is a terminal, else plain (one line every 10 s)")
    _add_engine_options(p)
    p.set_defaults(handler=_run_prepare)


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "engine", "--engine datatrove: the same folder written by datatrove's readers and executors (the "
        "[datatrove] extra), for local .parquet or .jsonl files and a given tokenizer; same bytes for any "
        "--workers; --workers there is how many tasks run at once (0: as many as cores; slurm: no limit)")
    g.add_argument("--engine", choices=("pilotrun", "datatrove"), default="pilotrun",
                   help="pilotrun: this process (threads or --workers processes); datatrove: datatrove tasks")
    g.add_argument(
        "--tasks",
        type=int,
        default=None,
        help="datatrove: how many tasks the files are dealt to (default: one per file); part of the "
        "data's identity: the order within a split depends on it",
    )
    g.add_argument("--executor", choices=("local", "slurm"), default="local",
                   help="datatrove: local processes on this machine, or a SLURM job array plus a merge job")
    g.add_argument("--logs", default=None, help="datatrove: its logging folder: task logs, completion marks, "
                   "stats, slurm logs (default: OUT.logs)")
    s = p.add_argument_group("slurm", "--executor slurm: what datatrove's SlurmPipelineExecutor submits")
    s.add_argument("--slurm-partition", default=None, help="partition of the task array and the merge job")
    s.add_argument("--slurm-time", default="24:00:00", help="time limit of each job")
    s.add_argument("--slurm-cpus-per-task", type=int, default=1, help="CPUs per task")
    s.add_argument("--slurm-mem-per-cpu-gb", type=int, default=2, help="memory per CPU, in GB")
    s.add_argument("--slurm-qos", default="normal", help="quality of service")
    s.add_argument("--slurm-job-name", default="pilotrun-prepare", help="job name (the merge: NAME-merge)")
    s.add_argument("--slurm-env-command", default=None,
                   help="shell line run before each job, e.g. 'source /path/to/.venv/bin/activate'")
    s.add_argument("--slurm-max-array-size", type=int, default=1001, help="the cluster's MaxArraySize")
    s.add_argument("--slurm-sbatch-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="another #SBATCH --KEY=VALUE line (repeatable), e.g. account=myproject")


# Options of the pilotrun engine that datatrove's route has no use for: each task keeps its files' order (no
# shuffle buffer) and datatrove writes its own logs (no progress line), so a value other than the default
# would be silently ignored.
PILOTRUN_ENGINE_DEFAULTS = {"shuffle_buffer": 10000, "shuffle_buffer_bytes": 64 << 20, "progress": "auto"}


def _refuse_pilotrun_engine_options(args: argparse.Namespace) -> None:
    for name, default in PILOTRUN_ENGINE_DEFAULTS.items():
        if getattr(args, name) != default:
            flag = "--" + name.replace("_", "-")
            raise PilotrunError(f"{flag} has no effect with --engine datatrove (each task keeps its "
                                "files' order and datatrove writes its own logs: docs/DATA_AT_SCALE.md); "
                                "leave it out")


def _run_datatrove(args: argparse.Namespace, whole) -> int:
    from pilotrun.data.datatrove_finish import finished_line
    from pilotrun.data.datatrove_prepare import (
        SlurmOptions,
        Submitted,
        prepare_with_datatrove,
        submitted_line,
    )

    sbatch = {}
    for item in args.slurm_sbatch_arg:
        key, equals, value = item.partition("=")
        if not key or not equals:
            raise PilotrunError(f"--slurm-sbatch-arg expects KEY=VALUE, got {item!r}")
        sbatch[key.lstrip("-")] = value
    slurm = SlurmOptions(
        partition=args.slurm_partition,
        time=args.slurm_time,
        cpus_per_task=args.slurm_cpus_per_task,
        mem_per_cpu_gb=args.slurm_mem_per_cpu_gb,
        qos=args.slurm_qos,
        job_name=args.slurm_job_name,
        env_command=args.slurm_env_command,
        max_array_size=args.slurm_max_array_size,
        sbatch_args=sbatch,
    )
    result = prepare_with_datatrove(
        args.out, args.source, args.tokenizer, eos=args.eos, text_field=args.text_field,
        train_tokens=whole(args.train_tokens, "--train-tokens"), val_fraction=args.val_fraction,
        shard_tokens=whole(args.shard_tokens, "--shard-tokens"), seed=args.seed, tasks=args.tasks,
        workers=args.workers, executor=args.executor, slurm=slurm, logs=args.logs, force=args.force)
    print(
        submitted_line(args.out, result) if isinstance(result, Submitted) else finished_line(args.out, result)
    )
    return 0


def _run_prepare(args: argparse.Namespace) -> int:
    from pilotrun.data.prepare import prepare_corpus, prepared_line
    from pilotrun.data.prepare_state import PrepareInterrupted

    def whole(value: float | None, flag: str) -> int | None:
        if value is None:
            return None
        if not math.isfinite(value) or value != int(value) or value < 1:
            raise PilotrunError(f"{flag} must be a positive whole number, got {value}")
        return int(value)

    if args.engine == "datatrove":
        _refuse_pilotrun_engine_options(args)
        return _run_datatrove(args, whole)
    for flag, value in (
        ("--tasks", args.tasks),
        ("--logs", args.logs),
        ("--slurm-partition", args.slurm_partition),
    ):
        if value is not None:
            raise PilotrunError(f"{flag} is an option of --engine datatrove")
    if args.executor != "local":
        raise PilotrunError("--executor is an option of --engine datatrove")
    try:
        manifest = prepare_corpus(
            args.out,
            source=args.source,
            tokenizer=args.tokenizer,
            eos=args.eos,
            text_field=args.text_field,
            train_tokens=whole(args.train_tokens, "--train-tokens"),
            val_fraction=args.val_fraction,
            shard_tokens=whole(args.shard_tokens, "--shard-tokens"),
            seed=args.seed,
            shuffle_buffer=args.shuffle_buffer,
            shuffle_buffer_bytes=whole(args.shuffle_buffer_bytes, "--shuffle-buffer-bytes"),
            workers=args.workers,
            force=args.force,
            progress=args.progress,
        )
    # committed in OUT.partial: one line saying how to continue, no traceback
    except PrepareInterrupted as exc:
        print(f"pilotrun prepare: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C: the last committed state is still there
        print(
            f"pilotrun prepare: interrupted; {args.out}.partial keeps the shards committed so far: run the "
            "same "
            "command again to continue",
            file=sys.stderr,
        )
        return 130
    print(prepared_line(args.out, manifest))
    return 0


# ---------------------------------------------------------------------------------------------- data verify
def add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="verify or merge prepared data folders",
                       description="Tools for prepared data folders.")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="{verify,merge}")
    v = data_sub.add_parser(
        "verify",
        help="rehash every shard against metadata.json",
        description="Rehash every shard against metadata.json and check shapes, dtypes and "
        "totals. Exit 0 when intact, 1 when damaged (each bad file named).",
    )
    v.add_argument("dir", help="data folder written by `pilotrun prepare`")
    v.set_defaults(handler=_run_data_verify)
    m = data_sub.add_parser(
        "merge",
        help="one data folder from folders prepared separately",
        description="Merge folders prepared with the same tokenizer.json and options: shards "
        "hard-linked (or copied), rehashed, renamed into one sequence; splits concatenated in the "
        "order given. Exit 0 merged, 2 refused (one line naming the difference, nothing written).",
    )
    m.add_argument("--out", required=True, help="the merged data folder (must not exist)")
    m.add_argument("--copy", action="store_true", help="copy shards instead of hard-linking them")
    m.add_argument(
        "parts", nargs="+", metavar="PART", help="data folders, in the order their tokens are read"
    )
    m.set_defaults(handler=_run_data_merge)


def _run_data_verify(args: argparse.Namespace) -> int:
    from pilotrun.data.verify import report_verification

    return report_verification(args.dir)


def _run_data_merge(args: argparse.Namespace) -> int:
    from pilotrun.data.merge import merge_data, merged_line

    placed: dict[str, int] = {}
    print(merged_line(args.out, merge_data(args.out, args.parts, copy=args.copy, placed=placed), placed))
    return 0
