"""The tracker commands of the command line: `tensorboard` (a finished run as TensorBoard scalars) and
`export-metrics` (a finished run into W&B, MLflow, trackio or TensorBoard); the work is in pilotrun/run/sinks.py."""

from __future__ import annotations

import argparse


# ---------------------------------------------------------------------------------------------- tensorboard
def add_tensorboard(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tensorboard", help="convert a run's metrics.jsonl into TensorBoard event files",
                       description="Write the kept train, val, checkpoint and overflow events of R/metrics.jsonl "
                       "(each step once) as classic TensorBoard scalars (tag EVENT/FIELD, x = step, float32), and "
                       "the verdict's figures where one was made. A folder holding only event files is "
                       "overwritten. Needs the [tensorboard] extra. Exit 0 written, 2 bad input.")
    p.add_argument("run_dir", help="run folder")
    p.add_argument("--out", default=None, help="event folder (default: R/tensorboard)")
    p.add_argument("--force", action="store_true", help="replace the event files of a folder that also holds "
                   "other files (those are left alone)")
    p.set_defaults(handler=_run_tensorboard)


def _run_tensorboard(args: argparse.Namespace) -> int:
    from pilotrun.run.tracker_tensorboard import convert_run_to_tensorboard

    out, count = convert_run_to_tensorboard(args.run_dir, args.out, force=args.force)
    print(f"wrote {count} scalars to {out}")
    return 0


# ---------------------------------------------------------------------------------------------- export-metrics
def add_export_metrics(sub: argparse._SubParsersAction) -> None:
    from pilotrun.config import TRACKER_NAMES

    p = sub.add_parser("export-metrics", help="send a finished run to a tracker (tensorboard, wandb, mlflow, trackio)",
                       description="Send a run's kept history (each step once), its identity (run_id, recipe "
                       "and data sha256, git commit), and where a verdict was made its decision, rule figures and "
                       "report files, to each tracker named, configured as that tracker is (WANDB_*, "
                       "MLFLOW_TRACKING_URI, TRACKIO_DIR ...). Needs the tracker's extra. Exit 0 sent, 2 bad input.")
    p.add_argument("run_dir", help="run folder")
    p.add_argument("--to", action="append", required=True, choices=TRACKER_NAMES, metavar="TRACKER",
                   help=f"tracker, repeatable: {', '.join(TRACKER_NAMES)}")
    p.add_argument("--out", default=None, help="tensorboard: event folder (default: R/tensorboard)")
    p.add_argument("--force", action="store_true", help="tensorboard: as `pilotrun tensorboard --force`")
    p.set_defaults(handler=_run_export_metrics)


def _run_export_metrics(args: argparse.Namespace) -> int:
    from pilotrun.run.sinks import check_trackers_available, export_metrics

    check_trackers_available(args.to)  # every tracker's package before any is written
    for name in dict.fromkeys(args.to):
        done = export_metrics(args.run_dir, name, log_dir=args.out, force=args.force)
        events = f"{done['events']} events, " if done["events"] is not None else ""
        extra = (", the verdict" if done["verdict"] else "") + (f", {done['files']} report files" if done["files"]
                                                                else "")
        print(f"{name}: {events}{done['scalars']} scalars{extra} -> {done['where']}")
    return 0
