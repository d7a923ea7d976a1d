"""The tracker command of the command line: `export-metrics` (a finished run into TensorBoard, W&B, MLflow or
trackio), and `tensorboard`, its documented alias for `--to tensorboard`, which parses into exactly the same
arguments and handler and has no code of its own; the work is in pilotrun/run/sinks.py."""

from __future__ import annotations

import argparse


def _add_run_and_event_folder(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run folder")
    p.add_argument("--out", default=None, help="tensorboard: event folder (default: R/tensorboard)")
    p.add_argument(
        "--force",
        action="store_true",
        help="tensorboard: replace the event files of a folder that "
        "also holds other files (those are left alone)",
    )


# ----------------------------------------------------------------------------------------------
# export-metrics
def add_export_metrics(sub: argparse._SubParsersAction) -> None:
    from pilotrun.run.trackers import TRACKERS

    names = ", ".join(TRACKERS)
    p = sub.add_parser(
        "export-metrics",
        help=f"send a finished run to a tracker ({names})",
        description="Send a run's kept history (each step once), its identity (run_id, recipe "
        "and data sha256, git commit), and where a verdict was made its decision, rule figures and "
        "report files, to each tracker named, configured as that tracker is (WANDB_*, "
        "MLFLOW_TRACKING_URI, TRACKIO_DIR ...). TensorBoard gets classic scalars (tag EVENT/FIELD, "
        "x = step, float32) in an event folder; a folder holding only event files is overwritten. "
        "Needs the tracker's extra. Exit 0 sent, 2 bad input.",
    )
    _add_run_and_event_folder(p)
    p.add_argument("--to", action="append", required=True, choices=tuple(TRACKERS), metavar="TRACKER",
                   help="tracker, repeatable: " + "; ".join(f"{t.name} ({t.description})"
                                                            for t in TRACKERS.values()))
    p.set_defaults(handler=_run_export_metrics)


# ---------------------------------------------------------------------------------------------- tensorboard
def add_tensorboard(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tensorboard",
        help="alias of `export-metrics R --to tensorboard`",
        description="An alias: `pilotrun tensorboard R [--out DIR] [--force]` is `pilotrun "
        "export-metrics R --to tensorboard [--out DIR] [--force]` (see `pilotrun export-metrics "
        "--help`), kept for the commands already written with it.",
    )
    _add_run_and_event_folder(p)
    # The parse of the alias is the parse of export-metrics: the same command name, tracker and handler.
    p.set_defaults(command="export-metrics", to=["tensorboard"], handler=_run_export_metrics)


def _run_export_metrics(args: argparse.Namespace) -> int:
    from pilotrun.run.sinks import check_trackers_available, export_metrics

    check_trackers_available(args.to)  # every tracker's package before any is written
    for name in dict.fromkeys(args.to):
        done = export_metrics(args.run_dir, name, log_dir=args.out, force=args.force)
        events = f"{done['events']} events, " if done["events"] is not None else ""
        extra = (", the verdict" if done["verdict"] else "") + (
            f", {done['files']} report files" if done["files"] else ""
        )
        print(f"{name}: {events}{done['scalars']} scalars{extra} -> {done['where']}")
    return 0
