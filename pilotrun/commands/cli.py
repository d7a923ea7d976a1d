"""Command line: argument parsing only. Every command is a thin call into the package folders.

Exit codes: 0 success; 1 a negative result (damaged data, invalid record, NO-GO);
2 bad input, reported as one line without a traceback. Each command has one `_add_*` parser function
and one `_run_*` handler; keep them small and put the work in the package.

Building the parser imports no module that imports torch or numpy (tests/commands/test_cli.py runs every
command's --help where importing either fails): `--help` answers on a machine without the training stack and
in a fraction of a second. So a `_run_*` handler imports what its command needs, and a `_add_*` function reads
only torch-free modules (commands/pilot.py and pilot_process.py are, for `pilot`'s arguments).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from pilotrun.commands.cli_data import add_data, add_prepare
from pilotrun.commands.cli_evaluate import add_evaluate
from pilotrun.commands.cli_paths import check_path_arguments
from pilotrun.commands.cli_trackers import add_export_metrics, add_tensorboard
from pilotrun.commands.cli_tune import add_tune
from pilotrun.common import stop_signals
from pilotrun.common.errors import PilotrunError
from pilotrun.common.parsing import terminal_safe
from pilotrun.common.strict_json import strict_dumps
from pilotrun.version import __version__


# ---------------------------------------------------------------------------------------------- train
def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train from a recipe; --resume continues exactly",
        description="Train a model from a YAML recipe on a prepared data folder, writing run.json, "
                    "metrics.jsonl "
        "and checkpoints into the run folder. An existing run folder is refused without --resume. "
        "Under torchrun it runs data-parallel. Exit 0 when max_steps is reached, 2 for bad input or an "
        "incompatible resume, 1 when it stopped itself (train.max_consecutive_skips skipped updates in a "
        "row), "
        "128 + the signal's number after a stop signal (130 SIGINT, 143 SIGTERM, 129 SIGHUP, 138 SIGUSR1, "
        "140 SIGUSR2): "
        "the current update is finished, a checkpoint is saved and session_end records reason 'interrupted' "
        "before "
        "exiting; 75 when it stopped, likewise saved, before the --stop-by deadline (reason 'deadline'). "
        "Every one "
        "of those is resumable: `--resume auto` continues. It prints tokens_per_update and the planned "
        "tokens before it starts, and progress on stderr: a redrawn bar on a terminal, else one line per log "
        "window (step, loss, training-only tokens/s, ETA at this session's wall-clock rate). A data pass "
        "boundary, a spike, a rollback and a recipe change at resume are each a line when they happen.",
    )
    # In the order --help lists them.
    _add_train_recipe_and_data(p)
    _add_train_run_folder(p)
    _add_train_stops(p)
    _add_train_changes(p)
    _add_train_console(p)
    p.set_defaults(handler=_run_train)


def _add_train_recipe_and_data(p: argparse.ArgumentParser) -> None:
    """Where the recipe comes from (a YAML file or a recipe lock) and the data it trains on."""
    p.add_argument(
        "--config",
        default=None,
        help="YAML recipe: a path, or a packaged recipe by name (stability, acceptance, overfit, smoke, "
        "gpu/...); `pilotrun config --config F` lists every key with its value, default and meaning. "
        "Required unless --frozen gives the recipe",
    )
    p.add_argument(
        "--frozen",
        default=None,
        metavar="LOCK",
        help="take the recipe from a recipe lock written by `pilotrun freeze`: any difference from the "
        "lock (config keys after --set, the data's metadata_sha256) not named with --allow-change is "
        "refused with the list; run.json records the lock's sha256 and the accepted differences",
    )
    p.add_argument(
        "--data",
        required=True,
        help="data folder written by `pilotrun prepare`, or a mixture file "
        "(YAML `mixture: [{path: DIR, weight: W}, ...]`, optional `seed`) of several",
    )


def _add_train_run_folder(p: argparse.ArgumentParser) -> None:
    """The run folder, and whether this session starts it or continues it from a checkpoint."""
    p.add_argument("--run-dir", required=True, help="run folder (run.json, metrics.jsonl, checkpoints/)")
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        type=_resume_mode,
        metavar="auto",
        help="continue from the newest committed checkpoint; `--resume auto`: the same command for every "
        "start (a scheduler's requeue, torchrun's restarts): starts the run where the folder holds none, "
        "resumes from the newest checkpoint that verifies (naming any newer one passed over; none "
        "verifying is refused), exits 0 with 'nothing to do' when the run is complete",
    )


def _add_train_stops(p: argparse.ArgumentParser) -> None:
    """What ends a session with a committed checkpoint: a deadline, a stop signal, a hung rank."""
    p.add_argument(
        "--stop-by",
        default=None,
        metavar="TIME|DURATION",
        help="end the session with a committed checkpoint before this deadline (exit 75): a time "
        "(2026-12-04T06:00, @EPOCH), a duration from now (90m, 2h30m) or none; default: "
        "SLURM_JOB_END_TIME when set. The margin kept is measured in the session (twice the slowest recent "
        "update and round of logging and evaluation, plus the last save). A resumed run's start that cannot "
        "keep it (the record's set-up, one update and a save) is refused, exit 79: not in this allocation "
        "(a complete run is not: it exits 0)",
    )
    p.add_argument(
        "--stop-signals",
        default=None,
        metavar="SIG,...",
        help="the signals that stop the session with a checkpoint (exit 128 + the signal's number); "
        "default SIGINT,SIGTERM,SIGHUP,SIGUSR1,SIGUSR2 (SIGUSR1/2: a scheduler's pre-emption warning); "
        "a machine setting, free to change on any resume",
    )
    p.add_argument(
        "--hang-timeout",
        default="auto",
        metavar="auto|off|STEADY[,STARTUP]",
        help="the hang watchdog: a rank without progress past its bound writes every thread's stack to "
        "RUN/hangs/, ends the session 'hung' and exits 124; auto (default): 10x this session's slowest "
        "update, evaluation or save, 5 min to 30 min, the set-up and each first one 30 min; or fixed "
        "seconds/durations (10m or 10m,1h; refused below the run's recorded update and set-up, or with none "
        "recorded below 1 s and a 60 s start-up); off. Sets the process group's timeout; free to change on "
        "resume",
    )


def _add_train_changes(p: argparse.ArgumentParser) -> None:
    """Which checkpoint a resume starts from; the recipe's differences from its file, its run or its lock."""
    p.add_argument(
        "--from-step", type=int, default=None, help="with --resume: continue from this checkpoint step"
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.max_steps=200 (repeatable; to shorten a run "
                   "set optim.schedule.horizon too, or the LR never decays); keys: `pilotrun config`")
    p.add_argument("--allow-change", action="append", default=[], metavar="KEY",
                   help="with --resume: accept a named recipe difference and record it in run.json; with "
                   "--frozen: accept a named difference from the lock (repeatable)")


def _add_train_console(p: argparse.ArgumentParser) -> None:
    """The pilot's kill point (hidden) and how progress is shown."""
    # The pilot's kill point (training/callbacks/kill_point.py): `pilotrun pilot` hands it to its first
    # training process; not for users, so not listed.
    p.add_argument("--stop-past-step", type=int, default=None, metavar="N", help=argparse.SUPPRESS)
    p.add_argument("--progress", choices=("auto", "bar", "plain", "none"), default="auto",
                   help="auto: a redrawn bar when stderr is a terminal, else plain (one line per log window, "
                   "train.log.every, with an ETA)")


def _resume_mode(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"--resume takes no value or 'auto', not {text!r}")
    return text


def _run_train(args: argparse.Namespace) -> int:
    import time

    from pilotrun.training.signals import StopSignals

    started_at = time.time()  # the deadline's budget counts the set-up too
    # Heard before any import that takes time (torch's, seconds): a stop signal in the set-up is a request to
    # stop with a checkpoint, not a death with nothing on the record. torchrun forwards its own copy
    # (signals.py).
    launcher = all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    signals = StopSignals(
        signums=_unattended_settings(args, started_at, signals_only=True)[1], launcher=launcher
    )
    with signals.installed():
        # a signal heard since the launch is this session's request
        stop_signals.release_early(signals.handle, signals.signums)
        try:
            code = _train_with(args, signals, started_at)
        except KeyboardInterrupt:  # Ctrl-C outside --stop-signals before the loop (the loop's own is ended)
            print("pilotrun train: SIGINT (Ctrl-C), not one of --stop-signals, during the set-up: stopped at "
                  "once, nothing trained in this session", file=sys.stderr, flush=True)
            return 128 + signal.SIGINT
    if (code == 75 or code > 128) and args.stop_past_step is None and os.environ.get("RANK", "0") == "0":
        from pilotrun.commands.next_commands import resume_command

        launcher_words = " under the same launcher" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        saved = "stopped with a committed checkpoint" if signals.count < 2 else \
            "stopped at once by a second signal, without saving the work since the last checkpoint"
        if signals.received is None and code == 128 + signal.SIGINT:  # Python's own Ctrl-C: no stop signal
            saved = ("stopped at once by SIGINT (Ctrl-C), not one of --stop-signals, without saving the work "
                     "since the last checkpoint")
        print(f"pilotrun train: {saved}; continue the run{launcher_words} with `{resume_command(args)}`",
              file=sys.stderr, flush=True)
    return code


def _train_with(args: argparse.Namespace, signals, started_at: float) -> int:
    from pilotrun.common.errors import ConfigError
    from pilotrun.config import check_allow_change_keys, config_to_dict, load_run_config

    if (args.config is None) == (args.frozen is None):
        raise ConfigError("train needs exactly one of --config RECIPE and --frozen LOCK")
    from pilotrun.run import start_costs

    # the record, read once where a check needs it (a long run's metrics.jsonl takes seconds to parse), and
    # that read handed to the session's start, which reads the record only where this did not or it changed
    record_read = start_costs.ReadHandover(args.run_dir)
    recorded = record_read.start_costs
    stop_by, _signums = _unattended_settings(args, started_at)
    hang_bounds = _hang_bounds(args.hang_timeout, recorded)
    from pilotrun.run.recipe_lock import allow_changes_beyond_the_lock
    from pilotrun.training.trainer import train_from_cli

    run_facts, allow_changes = None, args.allow_change
    if args.frozen is not None:
        # before the lock is compared: a typo'd key would leave its difference refused, unnamed
        check_allow_change_keys(args.allow_change)
        # On --resume the lock is checked again but run.json keeps the facts its first session recorded
        # (train_from_cli records them only where this session starts the run).
        config, run_facts = _frozen_config(args)
        allow_changes = allow_changes_beyond_the_lock(
            args.allow_change, args.run_dir if args.resume else None, args.data, config_to_dict(config),
            run_facts["frozen"]["differences"])
    else:
        if args.resume:
            from pilotrun.run.recipe_lock import check_resumed_recipe

            check_resumed_recipe(args.config, args.run_dir)  # a frozen run resumed without its lock: asked
        config = load_run_config(args.config, args.overrides)
    # after the recipe, whose max_steps says whether the run is already complete
    _check_deadline_room(args, stop_by, started_at, recorded, config.train.max_steps)
    return train_from_cli(config, args.data, args.run_dir, resume=args.resume, from_step=args.from_step,
                          allow_changes=allow_changes, command=args.invocation, run_facts=run_facts,
                          stop_past_step=args.stop_past_step, progress=args.progress, signals=signals,
                          stop_by=stop_by, started_at=started_at, hang_bounds=hang_bounds,
                          record_read=record_read)


def _unattended_settings(args: argparse.Namespace, now: float, signals_only: bool = False
                         ) -> tuple[float | None, tuple[int, ...] | None]:
    """`--stop-by` (or SLURM_JOB_END_TIME) as epoch seconds and `--stop-signals` as numbers; bad input is one
    line, exit 2, before anything is written. `signals_only`: the signals alone (no deadline). Whether the
    deadline leaves a resumed run room to start is `_check_deadline_room`'s, once the recipe is read."""
    from pilotrun.common import deadline, stop_signals
    from pilotrun.common.errors import ConfigError

    try:
        signums = (
            stop_signals.parse_signal_names(args.stop_signals) if args.stop_signals is not None else None
        )
        if signals_only:
            return None, signums
        stop_by = deadline.resolve_stop_by(args.stop_by, now, os.environ)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return stop_by, signums


def _check_deadline_room(args: argparse.Namespace, stop_by: float | None, now: float, recorded,
                         max_steps: int) -> None:
    """Refuses, before any set-up and in one line with its own code (deadline.TooLateToStart, 79), a resumed
    run's start whose deadline is closer than its record, `recorded()` (run/start_costs.py), says a session
    needs to keep it (its fastest set-up and update, the last save). A start from a checkpoint at
    `max_steps` (`--from-step`, else the newest committed one) is not held to it: it trains nothing, so it
    completes or says "nothing to do" and exits 0 (as it does without a deadline) rather than 79, which
    would keep a scheduler from marking it done."""
    from pilotrun.common import deadline
    from pilotrun.run.marker import committed_checkpoint_steps

    if stop_by is None or not args.resume:
        return
    # the step the session would start from: the one named, else the newest committed checkpoint
    newest = (committed_checkpoint_steps(args.run_dir) or [-1])[-1]
    start = args.from_step if args.from_step is not None else newest
    if start >= max_steps:
        return  # complete: the session's start says so before it would train (its checkpoint verified there)
    costs = recorded()
    deadline.check_room(stop_by, now, min(costs.seconds_per_update, default=None),
                        setup_seconds=min(costs.setup_seconds, default=None), save_seconds=costs.last_save)


def _hang_bounds(text: str, recorded):
    """`--hang-timeout` as the watchdog's bounds (None: off); bad input (a bound below what the run's record,
    `recorded()`, says a healthy session takes included) is one line, exit 2."""
    from pilotrun.common.errors import ConfigError
    from pilotrun.training.callbacks.hang_watchdog import check_bounds_fit, parse_hang_timeout

    try:
        bounds = parse_hang_timeout(text)
        if bounds is not None and bounds.steady is not None:  # auto derives its bounds from the session
            check_bounds_fit(bounds, recorded())
        return bounds
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _frozen_config(args: argparse.Namespace):
    """The recipe of a lock after --set, and run.json's `frozen` section; refuses unlisted differences."""
    from pilotrun.config import apply_overrides, config_to_dict, loaded_recipe_from
    from pilotrun.data.mixed_reader import data_identity
    from pilotrun.run.recipe_lock import check_resumed_lock, frozen_run_facts, load_lock
    from pilotrun.training.environment import git_state

    lock = load_lock(args.frozen)
    if args.resume:  # the wrong folder or lock is asked about before the lock's differences are listed
        check_resumed_lock(lock, args.frozen, args.run_dir)
    config = loaded_recipe_from(
        apply_overrides(lock["recipe"], args.overrides), args.overrides, f"--frozen {args.frozen}"
    )
    data_sha256, mixture = data_identity(args.data)
    facts = frozen_run_facts(lock, args.frozen, config_to_dict(config), data_sha256, args.allow_change,
                             code=git_state(), mixture=mixture)
    return config, {"frozen": facts}


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
    from pilotrun.commands.inspect_batch import inspect_batch

    print(inspect_batch(args.run_dir, args.step, max_chars=args.max_chars))
    return 0


# ---------------------------------------------------------------------------------------------- summarize
def _add_summarize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("summarize", help="validate and reconcile a run record",
                       description="Validate metrics.jsonl against run.json across every session and report "
                       "updates, tokens, passes and time; a valid record's report card goes to "
                       "RUN/report.md. Exit 0 when valid, 1 with every reason listed.")
    p.add_argument("run_dir", help="run folder")
    p.add_argument("--require-step", type=int, default=None, help="demand a session_end at this step")
    p.add_argument(
        "--require-eval",
        default="",
        metavar="TASK,...",
        help="demand an evaluation (`pilotrun evaluate`) of each task on the final checkpoint (the "
        "--require-step step, else the last kept step) whose checkpoint and results still match",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON (and write no report card)")
    p.set_defaults(handler=_run_summarize)


def _run_summarize(args: argparse.Namespace) -> int:
    from pilotrun.commands.card import NOT_WRITTEN_INVALID, write_card
    from pilotrun.report.record_check.summarize import format_summary, summarize_run, summary_json

    required = [task.strip() for task in args.require_eval.split(",") if task.strip()]
    summary = summarize_run(args.run_dir, require_step=args.require_step, require_eval=required)
    print(summary_json(summary) if args.json else terminal_safe(format_summary(summary)))
    if not args.json:  # --json is the scripts' reading: one JSON document, nothing written
        card = write_card(summary, "pilotrun summarize")
        if card is not None:
            print(terminal_safe(f"report card: {card}"))
        elif not summary.valid:
            print(NOT_WRITTEN_INVALID)
    return 0 if summary.valid else 1


# ---------------------------------------------------------------------------------------------- verdict
def _add_verdict(sub: argparse._SubParsersAction) -> None:
    from pilotrun.report.verdict.rules import rules_help

    p = sub.add_parser(
        "verdict",
        help="GO / NO-GO for the pilot, with a drawn report",
        formatter_class=_RawDescriptionDefaultsHelpFormatter,
        description="Apply the documented pilot rules to the run folder R (the --run-dir given to "
        "`pilotrun train`) and write R/report/ (summary.json, plots, report.html). "
        "Exit 0 for GO, 1 for NO-GO.\n\n" + rules_help(),
    )
    p.add_argument("run_dir", metavar="R", help="run folder written by `pilotrun train --run-dir R`")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    p.add_argument("--no-resume-required", action="store_true",
                   help="waive the rule that the pilot must have come through a resume")
    p.add_argument(
        "--threshold",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a rule threshold (repeatable); every NAME, with its default and meaning, is listed "
        "under the rule that reads it above",
    )
    p.set_defaults(handler=_run_verdict)


def _run_verdict(args: argparse.Namespace) -> int:
    from pilotrun.report.drawing.html import write_report
    from pilotrun.report.verdict.thresholds import Thresholds, parse_thresholds
    from pilotrun.report.verdict.verdict import format_verdict, judge, verdict_json

    thresholds = parse_thresholds(args.threshold, Thresholds(resume_required=not args.no_resume_required))
    verdict = judge(args.run_dir, thresholds)
    report = write_report(verdict)
    if args.json:
        print(verdict_json(verdict))
    else:
        print(terminal_safe(format_verdict(verdict)))
        print(f"report: {report / 'report.html'}")
    return 0 if verdict.decision == "GO" else 1


# ---------------------------------------------------------------------------------------------- freeze
def _add_freeze(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "freeze",
        help="freeze a GO pilot's candidate into a recipe lock",
        description="Judge the pilot (as `verdict` does) and write a recipe lock: the recipe in force "
        "at the pilot's end with its changes on resume, the data identity (metadata_sha256), the "
        "code identity (git commit, dirty flag, diff hash) and software of its last session, every "
        "rule's figure, and the sha256 of the canonical JSON of all of it. `pilotrun train --frozen "
        "LOCK` starts the long run from it. Exit 0 written, 1 NO-GO (nothing written) unless "
        "--despite-no-go (then recorded in the lock), 2 bad input (an existing --out included).",
    )
    p.add_argument("run_dir", help="the pilot's run folder")
    p.add_argument("--out", required=True, help="the lock file to write (never overwritten)")
    p.add_argument(
        "--despite-no-go", action="store_true", help="write the lock of a NO-GO pilot, saying so in it"
    )
    p.add_argument("--target-steps", type=int, default=None, metavar="N",
                   help="project a long run of N updates of the recipe on the pilot's hardware into the lock")
    p.add_argument("--mtbf", type=float, default=None, metavar="HOURS",
                   help="mean time between failures: expected redone work and Young's checkpoint interval")
    p.add_argument(
        "--device-hour-cost", type=float, default=None, metavar="X", help="price of one device-hour"
    )
    p.add_argument("--no-resume-required", action="store_true", help="as for verdict")
    p.add_argument("--threshold", action="append", default=[], metavar="NAME=VALUE", help="as for verdict")
    p.set_defaults(handler=_run_freeze)


def _run_freeze(args: argparse.Namespace) -> int:
    from pilotrun.commands.freeze import freeze_run
    from pilotrun.report.verdict.thresholds import Thresholds, parse_thresholds

    thresholds = parse_thresholds(args.threshold, Thresholds(resume_required=not args.no_resume_required))
    from pilotrun.commands.freeze import forecast_lines, format_projection

    code, lock, verdict = freeze_run(
        args.run_dir,
        args.out,
        despite_no_go=args.despite_no_go,
        thresholds=thresholds,
        target_steps=args.target_steps,
        mtbf_hours=args.mtbf,
        device_hour_cost=args.device_hour_cost,
    )
    if code != 0:
        print(
            f"not frozen: the pilot is {verdict.decision} ({verdict.statement}); pass --despite-no-go to "
            "freeze it "
            "anyway, recorded in the lock"
        )
        return code
    flag = " DESPITE NO-GO" if lock["despite_no_go"] else ""
    print(f"frozen{flag}: {args.out} (sha256 {lock['sha256']}; recipe sha256 {lock['recipe_sha256']}, data "
          f"{lock['data']['metadata_sha256']}, code {(lock.get('code') or {}).get('commit')})")
    if "projection" in lock:
        print("\n".join(format_projection(lock["projection"]) + forecast_lines(lock)))
    from pilotrun.commands.next_commands import long_run_commands, recorded_data_dir

    train, watch = long_run_commands(args.out, recorded_data_dir(args.run_dir), lock_content=lock)
    print(f"the long run: `{train}`; watch it with `{watch}`")
    return 0


# ---------------------------------------------------------------------------------------------- watch
def _add_watch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "watch",
        help="alerts on a live long run; never writes into it",
        description="Read a run record as it grows (hash chain checked line by line, a torn last "
        "line left for the writer) and alert, with the step, the figure and the bound, on: a stall "
        "(no line for K window intervals of the run's own), throughput below the pilot's band, a "
        "loss spike or a loss outside the pilot's envelope, a verdict rule that applies to a live run "
        "failing (skip and clip rates, QK-Clip, experts ...), a broken chain, a session ended in "
        "error or killed with no resume started, and with the lock's forecast: the loss out of its band "
        "or risen above its own course, and a change on resume that left what it assumed (that one stands "
        "while the run keeps updates made under the change). Never writes into the run folder, never takes "
        "its lock. Exit 0 healthy or completed, 1 alert (with --follow: one still standing at the end), 2 "
        "bad input.",
    )
    p.add_argument("run_dir", metavar="RUN", help="run folder")
    p.add_argument(
        "--against",
        default=None,
        metavar="LOCK",
        help="the recipe lock the run was started from (`pilotrun freeze`): the pilot's band, envelope "
        "and bounds",
    )
    p.add_argument(
        "--follow",
        action="store_true",
        help="wait for a run still starting, then watch until it completes, past alerts; exit 1 at the end "
        "unless every alert cleared",
    )
    p.add_argument(
        "--stop-at-alert",
        dest="keep_going",
        action="store_false",
        help="with --follow: stop at the first alert (exit 1)",
    )
    p.add_argument(
        "--keep-going",
        dest="keep_going",
        action="store_true",
        help="with --follow: watch on after an alert (the default)",
    )
    p.set_defaults(keep_going=True)
    p.add_argument(
        "--on-alert", default=None, metavar="CMD", help="run CMD once per alert, the alert as JSON on stdin"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per alert")
    p.add_argument("--interval", type=float, default=None, metavar="S",
                   help="seconds between looks (default: a fifth of the run's window interval, 0.05 to 5)")
    p.add_argument("--stall-windows", type=float, default=None, metavar="K",
                   help="a stall is no line for K window intervals (default 3)")
    p.add_argument(
        "--threshold",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a rule threshold, as for verdict (default: the lock's, else verdict's defaults)",
    )
    p.set_defaults(handler=_run_watch)


def _run_watch(args: argparse.Namespace) -> int:
    from pilotrun.commands.watch import watch_run

    return watch_run(args.run_dir, against=args.against, follow=args.follow, keep_going=args.keep_going,
                     on_alert=args.on_alert, as_json=args.json, interval=args.interval,
                     stall_windows=args.stall_windows, thresholds=args.threshold)


# ---------------------------------------------------------------------------------------------- pilot
def _add_pilot(sub: argparse._SubParsersAction) -> None:
    from pilotrun.commands.pilot import add_pilot_arguments

    p = sub.add_parser(
        "pilot",
        help="the whole rehearsal of a candidate (default: the built-in demo on a CPU)",
        description="Prepare or take the data, train the recipe (under torchrun with "
        "--nproc-per-node), kill every training process past a step, resume, summarize --require-step "
        "and print the verdict with the report's path; --freeze writes the lock of a GO. Exit 0 GO, "
        "1 NO-GO, 2 bad input or a failed child (its log named), 130 / 143 / 129 after SIGINT / SIGTERM / "
        "SIGHUP.",
    )
    add_pilot_arguments(p)
    p.set_defaults(handler=_run_pilot)


def _run_pilot(args: argparse.Namespace) -> int:
    from pilotrun.commands.pilot import run_pilot_from_cli

    return run_pilot_from_cli(args)


# ---------------------------------------------------------------------------------------------- export
def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="a checkpoint as a Hugging Face DeepSeek-V3 folder (safetensors)",
        description="Write a committed checkpoint (rehashed first) as model.safetensors, a "
        "transformers config.json for DeepseekV3ForCausalLM and the data folder's tokenizer, so that "
        "AutoModelForCausalLM.from_pretrained(DIR) loads it. Options transformers cannot express are "
        "refused, naming the key. Needs the [export] extra. Exit 0 written, 2 bad input or damaged "
        "checkpoint.",
    )
    p.add_argument("run_dir", help="run folder")
    p.add_argument("--out", required=True, help="output folder (new or empty)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest committed)")
    p.add_argument(
        "--data", default=None, help="the run's data folder if it moved (default: the recorded path)"
    )
    p.add_argument("--json", action="store_true", help="print what was exported as JSON")
    p.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace) -> int:

    from pilotrun.commands.export import export_run

    result = export_run(args.run_dir, args.out, step=args.step, data_dir=args.data)
    if args.json:
        print(strict_dumps(result, sort_keys=True))
    else:
        print(f"exported step {result['step']} ({result['storage']}) to {result['out']}: "
              f"{result['parameters']} parameters in {result['tensors']} tensors")
    return 0


# ---------------------------------------------------------------------------------------------- config
def _add_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="every config key with its value, default, type and meaning; validates",
        description="Load a recipe (defaults <- YAML file <- --set overrides), validate it and print "
        "every key with its value, default, type and one-line meaning; '*' marks a value that "
        "differs from the default. Exit 0 valid, 2 bad input.",
    )
    p.add_argument("--config", default=None,
                   help="YAML recipe path or packaged name (none: the built-in defaults alone)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--json", action="store_true", help="print the keys as a JSON list")
    p.set_defaults(handler=_run_config)


def _run_config(args: argparse.Namespace) -> int:

    from pilotrun.config import load_run_config
    from pilotrun.config.describe import describe_config, format_config_table
    from pilotrun.optim.schedule import schedule_warnings

    config = load_run_config(args.config, args.overrides)
    rows = describe_config(config)
    print(strict_dumps(rows, indent=1) if args.json else format_config_table(rows))
    for warning in schedule_warnings(config):  # what `train` would say at its start, said before any run
        print(f"pilotrun config: warning: {warning}", file=sys.stderr)
    return 0


class _DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends '(default: X)' to every option that has a meaningful default (not None, False or an empty
    list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or default is None or default is False or default is argparse.SUPPRESS
                or default == [] or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


class _RawDescriptionDefaultsHelpFormatter(_DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown as everywhere, and a description whose line breaks are kept (the verdict's rule
    list)."""


class _Parser(argparse.ArgumentParser):
    """Every pilotrun parser and subparser: defaults shown in --help, and bad arguments are bad input like any
    other: one line naming the problem, exit 2 (argparse's default prints the whole usage block first)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pilotrun",
        description="A pilot before a long pretraining run: does the recipe learn, is the run honestly "
        "accounted for, and does it resume exactly? Data -> train -> summarize -> verdict.",
    )
    parser.add_argument("--version", action="version", version=f"pilotrun {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        add_prepare,
        add_data,
        _add_train,
        _add_inspect_batch,
        _add_summarize,
        _add_verdict,
        _add_freeze,
        _add_watch,
        _add_pilot,
        add_tune,
        add_evaluate,
        _add_export,
        add_tensorboard,
        add_export_metrics,
        _add_config,
    ):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    # --help, --version (0) or bad arguments (2, one line): a code, not an exception
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    # What run.json records as the command: the arguments this call was given (an in-process or API call has
    # its own, not the host process's sys.argv).
    args.invocation = ["pilotrun", *argv] if argv is not None else list(sys.argv)
    if args.command != "train":  # a stop signal held since `python -m pilotrun` started acts as it would have
        stop_signals.release_early(None)
    try:
        # a file where a folder is expected (or the reverse) named so, before any work
        check_path_arguments(args)
        with _cleanup_on_termination(args.command in TEMP_WRITING_COMMANDS):
            return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `pilotrun summarize RUN | head`: the reader had what it wanted. Nothing is wrong; point stdout at
        # /dev/null so that the interpreter's final flush does not raise again, and end quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except PilotrunError as exc:
        print(f"pilotrun: error: {terminal_safe(_one_line(str(exc)))}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        # The file system refused (a read-only or full disk, a path through a file, a folder where a file was
        # expected): bad input or a bad environment, named by the path; each writer has already cleaned up.
        print(f"pilotrun: error: {terminal_safe(_os_error_line(exc))}", file=sys.stderr)
        return 2


# Commands that write an output as temp + rename without a signal handler of their own (train, prepare and
# pilot have theirs). A stop signal would end them without unwinding (SIGTERM, SIGHUP), leaving the temp (a
# whole model for export); raised as SystemExit with the stop's exit code they unwind, and each writer's
# cleanup removes its temp.
TEMP_WRITING_COMMANDS = ("verdict", "freeze", "export")


@contextlib.contextmanager
def _cleanup_on_termination(active: bool):
    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(stop_signals.exit_code_of(signum))

    with stop_signals.handling(terminate) if active else contextlib.nullcontext():
        yield


def _one_line(text: str) -> str:
    return " ".join(text.split()) if "\n" in text else text


def _os_error_line(exc: OSError) -> str:
    what = exc.strerror or type(exc).__name__
    where = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    return f"{what}: {where}" if where else f"{what} ({exc})"


if __name__ == "__main__":
    sys.exit(main())
