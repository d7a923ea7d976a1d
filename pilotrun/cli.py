"""Command line: argument parsing only. Every command is a thin call into the package folders.

Exit codes (DESIGN.md): 0 success; 1 a negative result (damaged data, invalid record, NO-GO);
2 bad input, reported as one line without a traceback. Each command has one `_add_*` parser function
and one `_run_*` handler; keep them small and put the work in the package.
"""

from __future__ import annotations

import argparse
import math
import sys

from pilotrun import __version__
from pilotrun.errors import PilotrunError


# ---------------------------------------------------------------------------------------------- prepare
def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="turn a text source into token shards + metadata.json",
        description="Prepare an identifiable token stream: read a source, shuffle in a bounded seeded buffer, "
        "split train/val by a hash of each document's text, tokenize (EOS after every document) and write "
        ".npy shards with a metadata.json manifest. The same inputs give byte-identical output.",
    )
    p.add_argument("--out", required=True, help="output folder (refused if it exists, unless --force)")
    p.add_argument("--source", default="builtin",
                   help="builtin | fineweb-edu[:CONFIG][@REVISION] | local .parquet/.jsonl/.txt files or a glob "
                   "(default: builtin)")
    p.add_argument("--tokenizer", default="bpe:4096",
                   help="bpe:VOCAB (train a byte-level BPE on the train split) | hub:NAME[@REVISION] | "
                   "path/to/tokenizer.json (default: bpe:4096)")
    p.add_argument("--eos", default=None, help="name the end-of-document token (default: found in the tokenizer)")
    p.add_argument("--text-field", default="text", help="column/field holding the text (parquet, jsonl)")
    p.add_argument("--train-tokens", type=float, default=None,
                   help="stop after the complete document that reaches at least N training tokens")
    p.add_argument("--val-fraction", type=float, default=0.01, help="fraction of documents sent to val")
    p.add_argument("--shard-tokens", type=float, default=2**24, help="tokens per shard file")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed")
    p.add_argument("--shuffle-buffer", type=int, default=10000, help="documents held by the shuffle buffer")
    p.add_argument("--workers", type=int, default=0,
                   help="tokenizing threads, one core each (0: all cores); the output does not depend on it")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.set_defaults(handler=_run_prepare)


def _run_prepare(args: argparse.Namespace) -> int:
    from pilotrun.data.prepare import prepare_corpus
    from pilotrun.data.shards import metadata_sha256

    def whole(value: float | None, flag: str) -> int | None:
        if value is None:
            return None
        if not math.isfinite(value) or value != int(value) or value < 1:
            raise PilotrunError(f"{flag} must be a positive whole number, got {value}")
        return int(value)

    manifest = prepare_corpus(
        args.out, source=args.source, tokenizer=args.tokenizer, eos=args.eos, text_field=args.text_field,
        train_tokens=whole(args.train_tokens, "--train-tokens"), val_fraction=args.val_fraction,
        shard_tokens=whole(args.shard_tokens, "--shard-tokens"), seed=args.seed, shuffle_buffer=args.shuffle_buffer,
        workers=args.workers, force=args.force, progress=True,
    )
    splits = manifest["splits"]
    print(f"prepared {args.out}: train {splits['train']['tokens']} tokens in {splits['train']['documents']} documents, "
          f"val {splits['val']['tokens']} tokens in {splits['val']['documents']} documents, "
          f"vocab {manifest['tokenizer']['vocab_size']} ({manifest['dtype']}), "
          f"metadata_sha256 {metadata_sha256(manifest)}")
    return 0


# ---------------------------------------------------------------------------------------------- data verify
def _add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="inspect a prepared data folder",
                       description="Tools for a prepared data folder.")
    data_sub = p.add_subparsers(dest="data_command", required=True, metavar="{verify}")
    v = data_sub.add_parser("verify", help="rehash every shard against metadata.json",
                            description="Rehash every shard against metadata.json and check shapes, dtypes and "
                            "totals. Exit 0 when intact, 1 when damaged (each bad file named).")
    v.add_argument("dir", help="data folder written by `pilotrun prepare`")
    v.set_defaults(handler=_run_data_verify)


def _run_data_verify(args: argparse.Namespace) -> int:
    from pilotrun.data.shards import load_manifest, metadata_sha256
    from pilotrun.data.verify import verify_data

    problems = verify_data(args.dir)
    for problem in problems:
        print(f"damaged: {problem}")
    if problems:
        print(f"{args.dir}: {len(problems)} problem(s)")
        return 1
    manifest = load_manifest(args.dir)
    shards = sum(len(manifest["splits"][s]["shards"]) for s in manifest["splits"])
    print(f"intact: {args.dir} ({shards} shards rehashed, metadata_sha256 {metadata_sha256(manifest)})")
    return 0


# ---------------------------------------------------------------------------------------------- train
def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train from a recipe; --resume continues exactly",
        description="Train a model from a YAML recipe on a prepared data folder, writing run.json, metrics.jsonl "
        "and checkpoints into the run folder. An existing run folder is refused without --resume. "
        "Under torchrun it runs data-parallel. Exit 0 when max_steps is reached, 2 for bad input or an "
        "incompatible resume, 1 when it stopped itself (train.max_consecutive_skips skipped updates in a row), "
        "130 after SIGINT and 143 after SIGTERM: the current update is finished, a checkpoint is saved and "
        "session_end records reason 'interrupted' before exiting. It prints tokens_per_update and the planned "
        "tokens before it starts, and a progress line (step, loss, training-only tokens/s, ETA) on stderr.",
    )
    p.add_argument("--config", required=True, help="YAML recipe (see configs/)")
    p.add_argument("--data", required=True, help="data folder written by `pilotrun prepare`")
    p.add_argument("--run-dir", required=True, help="run folder (run.json, metrics.jsonl, checkpoints/)")
    p.add_argument("--resume", action="store_true", help="continue from the newest committed checkpoint")
    p.add_argument("--from-step", type=int, default=None, help="with --resume: continue from this checkpoint step")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.max_steps=200 (repeatable)")
    p.add_argument("--allow-change", action="append", default=[], metavar="KEY",
                   help="with --resume: accept a named recipe difference and record it in run.json (repeatable)")
    p.set_defaults(handler=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from pilotrun.config import load_run_config
    from pilotrun.train.trainer import train_from_cli

    config = load_run_config(args.config, args.overrides)
    return train_from_cli(config, args.data, args.run_dir, resume=args.resume, from_step=args.from_step,
                          allow_changes=args.allow_change, command=list(sys.argv))


# ---------------------------------------------------------------------------------------------- inspect-batch
def _add_inspect_batch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect-batch", help="show which tokens an update read (spike forensics)",
                       description="Print the shard offsets that update N read and their decoded text, "
                       "reconstructed from the recorded data cursors.")
    p.add_argument("run_dir", help="run folder")
    p.add_argument("--step", type=int, required=True, help="the applied-update number to inspect")
    p.add_argument("--max-chars", type=int, default=400, help="decoded characters shown per sequence")
    p.set_defaults(handler=_run_inspect_batch)


def _run_inspect_batch(args: argparse.Namespace) -> int:
    from pilotrun.train.inspect import inspect_batch

    print(inspect_batch(args.run_dir, args.step, max_chars=args.max_chars))
    return 0


# ---------------------------------------------------------------------------------------------- summarize
def _add_summarize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("summarize", help="validate and reconcile a run record",
                       description="Validate metrics.jsonl against run.json across every session and report "
                       "updates, tokens, passes and time. Exit 0 when valid, 1 with every reason listed.")
    p.add_argument("run_dir", help="run folder")
    p.add_argument("--require-step", type=int, default=None, help="demand a session_end at this step")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=_run_summarize)


def _run_summarize(args: argparse.Namespace) -> int:
    from pilotrun.report.summarize import format_summary, summarize_run, summary_json

    summary = summarize_run(args.run_dir, require_step=args.require_step)
    print(summary_json(summary) if args.json else format_summary(summary))
    return 0 if summary.valid else 1


# ---------------------------------------------------------------------------------------------- verdict
def _add_verdict(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verdict", help="GO / NO-GO for the pilot, with a drawn report",
                       description="Apply the documented pilot rules to a run and write R/report/ (summary.json, "
                       "plots, report.html). Exit 0 for GO, 1 for NO-GO.")
    p.add_argument("run_dir", help="run folder")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    p.add_argument("--no-resume-required", action="store_true",
                   help="waive the rule that the pilot must have come through a resume")
    p.add_argument("--threshold", action="append", default=[], metavar="NAME=VALUE",
                   help="override a rule threshold (repeatable); names and defaults: " + _threshold_defaults())
    p.set_defaults(handler=_run_verdict)


def _threshold_defaults() -> str:
    import dataclasses

    from pilotrun.report.verdict import Thresholds

    return ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(Thresholds) if f.name != "resume_required")


def _run_verdict(args: argparse.Namespace) -> int:
    from pilotrun.report.html import write_report
    from pilotrun.report.verdict import Thresholds, format_verdict, judge, parse_thresholds, verdict_json

    thresholds = parse_thresholds(args.threshold, Thresholds(resume_required=not args.no_resume_required))
    verdict = judge(args.run_dir, thresholds)
    report = write_report(verdict)
    if args.json:
        print(verdict_json(verdict))
    else:
        print(format_verdict(verdict))
        print(f"report: {report / 'report.html'}")
    return 0 if verdict.decision == "GO" else 1


# ---------------------------------------------------------------------------------------------- pilot
def _add_pilot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pilot", help="the whole rehearsal on the built-in corpus, on a CPU, in minutes",
                       description="Prepare the built-in corpus, run the CPU stability recipe, kill it halfway, "
                       "resume it, summarize and print the verdict with the report's path. Exit 0 GO, 1 NO-GO.")
    p.add_argument("--workdir", default="pilot-work", help="folder for the data and the run (default: pilot-work)")
    p.add_argument("--config", default=None, help="recipe (default: the packaged CPU stability recipe)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable)")
    p.set_defaults(handler=_run_pilot)


def _run_pilot(args: argparse.Namespace) -> int:
    from pilotrun.report.pilot import run_pilot

    return run_pilot(args.workdir, config=args.config, overrides=args.overrides).exit_code


class OneLineArgumentParser(argparse.ArgumentParser):
    """Bad arguments are bad input like any other: one line naming the problem, exit 2 (argparse's default
    prints the whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="pilotrun",
        description="A pilot before a long pretraining run: does the recipe learn, is the run honestly "
        "accounted for, and does it resume exactly? Data -> train -> summarize -> verdict.",
    )
    parser.add_argument("--version", action="version", version=f"pilotrun {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineArgumentParser)
    for add in (_add_prepare, _add_data, _add_train, _add_inspect_batch, _add_summarize, _add_verdict, _add_pilot):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) or bad arguments (2, one line): a code, not an exception
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.handler(args) or 0)
    except PilotrunError as exc:
        print(f"pilotrun: error: {_one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        # The file system refused (a read-only or full disk, a path through a file, a folder where a file was
        # expected): bad input or a bad environment, named by the path; each writer has already cleaned up.
        print(f"pilotrun: error: {_os_error_line(exc)}", file=sys.stderr)
        return 2


def _one_line(text: str) -> str:
    return " ".join(text.split()) if "\n" in text else text


def _os_error_line(exc: OSError) -> str:
    what = exc.strerror or type(exc).__name__
    where = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    return f"{what}: {where}" if where else f"{what} ({exc})"


if __name__ == "__main__":
    sys.exit(main())
