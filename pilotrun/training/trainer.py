"""One training session from start to end: build it (session.py), train it (loop.py and its callbacks), end
it.

`Trainer` is what `pilotrun train` and the Python API call. It builds the session (fresh or resumed), then
`run()`: prints the plan and the session's notes, logs `session_start`, assembles the loop's callbacks from
the recipe's sections, runs `train_loop` with the stop signals handled (signals.py), and logs `session_end`
with the time split (every second of the session in one of timing.PHASES), whatever ended it.

The callbacks, in the order they act after an update (callbacks/base.py has the interface):
- profiling.ProfileCallback: torch.profiler around the attempts `train.profile` names ("profile" phase)
- window_log.RareEventsCallback: data restarts, overflows, QK-Clip events
- rollback.SpikeCallback: the `spike` event, and a rollback under train.spike.policy=rollback
- window_log.WindowLogCallback: the `train` event every `train.log.every` updates, the progress bar
- evaluation.EvalCallback: the `val` event every `train.eval.every` updates ("eval" phase)
- downstream_eval.DownstreamEvalCallback: the `downstream` event (multiple-choice tasks) every
  `train.downstream.every`
- checkpointing.CheckpointCallback: every `train.checkpoint.every` updates and at the end ("checkpoint"
  phase); beside training under `train.checkpoint.mode` (not the last save)
- kill_point.KillPointCallback: the pilot's kill point, when the pilot hands one in (`stop_past_step`) the
  hang watchdog (hang_watchdog.HangWatchdog, `pilotrun train --hang-timeout`, outermost around each update),
  which ends the session `hung` from its own thread when this rank makes no progress within its bound, and two
  that only ask the session to stop (`stop_request`, agreed across ranks by the loop):
- shard_check.ShardCheckCallback: a shard whose sha256, checked in the background on its first read, differs
- launcher_watch.LauncherWatchCallback: torchrun's launcher gone (the parent pid changed, or its death signal)

Every event written to metrics.jsonl is handed to the metrics sinks (run/sinks.py: the live mirrors of
`train.log.trackers` (TensorBoard, W&B, MLflow, trackio), and any the caller passes), each guarded so that a
failing sink warns once and changes neither the training nor the record; writing and mirroring are the
"report" phase.

A stop signal (pilotrun/common/stop_signals.py): the current update is finished, the window is logged, a
checkpoint is saved, then `session_end` with reason "interrupted", and the exit code is 128 + the signal's
number: 130 (SIGINT), 143 (SIGTERM), 129 (SIGHUP), 138 (SIGUSR1), 140 (SIGUSR2). A deadline (`stop_by`,
callbacks/deadline_stop.py) ends the same way with reason "deadline" and exit code 75. A hang
(callbacks/hang_watchdog.py) ends it with reason "hung", every thread's stack in RUN/hangs/, and exit code
124, without a checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pilotrun.common.stop_signals import HUNG_EXIT_CODE, signal_name
from pilotrun.config import DownstreamConfig, RunConfig, check_allow_change_keys
from pilotrun.data.choice_tasks import read_choice_tasks
from pilotrun.run.hang_evidence import unrecorded_hangs
from pilotrun.run.record import (
    HANGS_DIR,
    PHASES,
    run_json_digests,
)
from pilotrun.run.sinks import (
    GuardedSink,
    MetricsSink,
    check_trackers_available,
    tracker_sinks,
)
from pilotrun.run.start_costs import ReadHandover, last_save_of
from pilotrun.training import distributed as dist_utils
from pilotrun.training.callbacks.base import Callback, Ending, LoopState
from pilotrun.training.callbacks.checkpointing import CheckpointCallback
from pilotrun.training.callbacks.deadline_stop import DeadlineCallback
from pilotrun.training.callbacks.downstream_eval import DownstreamEvalCallback
from pilotrun.training.callbacks.evaluation import EvalCallback
from pilotrun.training.callbacks.hang_watchdog import HangBounds, HangWatchdog, peer_hangs
from pilotrun.training.callbacks.kill_point import KillPointCallback
from pilotrun.training.callbacks.launcher_watch import LauncherWatchCallback
from pilotrun.training.callbacks.profiling import ProfileCallback, ProfileWindow
from pilotrun.training.callbacks.shard_check import ShardCheckCallback
from pilotrun.training.callbacks.window_log import RareEventsCallback, WindowLogCallback
from pilotrun.training.checkpoint.background import out_of_space, space_error_line
from pilotrun.training.loop import train_loop
from pilotrun.training.multiple_choice import check_downstream_fits
from pilotrun.training.notices import interrupt_acknowledgement, recipe_change_lines
from pilotrun.training.run_plan import plan_lines, run_plan
from pilotrun.training.session import NothingToDo, Session, build_session, tokens_per_update
from pilotrun.training.signals import SecondSignal, StopSignals
from pilotrun.training.spikes.rollback import SpikeCallback
from pilotrun.training.timing import TimeAccount


@dataclass
class TrainResult:
    reason: str  # completed | interrupted | stopped | error
    exit_code: int
    step: int
    tokens_seen: int
    updates_attempted: int
    updates_skipped: int
    message: str = ""


def describe_plan(
    config: RunConfig, world_size: int, start_step: int = 0, device_type: str = "cpu"
) -> list[str]:
    """The lines printed before training starts: tokens per update, the planned tokens and the compile
    choice."""
    t = config.train
    per_update = tokens_per_update(config, world_size)
    lines = [
        f"tokens_per_update = batch_size * seq_len * gradient_accumulation_steps * world_size = "
        f"{t.batch_size} * {t.seq_len} * {t.gradient_accumulation_steps} * {world_size} = {per_update:,}",
        f"planned tokens = max_steps * tokens_per_update = {t.max_steps:,} * {per_update:,} = "
        f"{t.max_steps * per_update:,}",
    ]
    if start_step:
        remaining = max(0, t.max_steps - start_step)
        lines.append(
            f"resuming at step {start_step:,}: {remaining:,} updates ({remaining * per_update:,} tokens) "
            "remain"
        )
    lines.append(describe_compile(t.compile, device_type))
    return lines


def describe_compile(mode: str, device_type: str) -> str:
    """What train.compile costs and whether it pays back. On the CPU it gains a few percent per update
    (BENCHMARKS.md, bench_update) and repays its seconds of compiling only after tens to hundreds of updates:
    the compiled parts are the blocks' elementwise chains and the loss, while most of the update is in the
    matmuls, the MoE layers' kernels (which stay eager) and the optimizer step (not compiled)."""
    if mode == "none":
        if device_type == "cpu":
            return (
                "compile: none (eager). train.compile=inductor would spend seconds compiling each block "
                "shape in the first update and gains a few percent per update on the CPU (BENCHMARKS.md, "
                "bench_update), which repays the compile after tens to hundreds of updates"
            )
        return (
            "compile: none (eager). train.compile=inductor spends the first update compiling each block "
            "shape; "
            "worth it only for a run long enough to repay that"
        )
    if mode == "eager":
        return (
            "compile: eager (Dynamo traces each block, no code generation: a check that the model compiles)"
        )
    if device_type == "cpu":
        return (
            "compile: inductor, each block and the loss compiled in the first update (seconds per block "
            "shape); on the CPU it gains a few percent per update (BENCHMARKS.md, bench_update), which "
            "repays the compile after tens to hundreds of updates"
        )
    return (
        "compile: inductor, each block and the loss compiled in the first update (the first update is slower "
        "by that time)"
    )


class Trainer:
    """Builds one session (fresh or resumed, session.py), then `run()` trains to `train.max_steps`.

    `sinks`: extra metrics sinks (run/sinks.py `MetricsSink`: `write(event)` and `close()`, or a
    `GuardedSink`) that receive every event as it is recorded, beside the trackers of `train.log.trackers`.
    Only rank 0 writes the record, so only rank 0's sinks receive events; every rank's are closed when `run()`
    returns. `stop_past_step`: the pilot's kill point (callbacks/kill_point.py); None trains normally.
    `signals`: the session's stop requests (signals.py); `request(signum)` asks it to stop as a signal would
    (pass one to have it heard during the set-up too, installed by the caller). `resume`: False, True
    (`--resume`) or "auto" (`--resume auto`, session.build_session). `stop_by`: a deadline in epoch seconds
    (pilotrun/common/deadline.py), `started_at` the command's start on `clock` (the set-up's seconds stand for
    a save in the deadline's margin until the session has saved). `watchdog`: a started hang watchdog
    (`train_from_cli` starts one before the set-up); None watches nothing, so an in-process caller's process
    is never ended by a hang."""

    def __init__(
        self,
        config: RunConfig,
        data_dir: str | Path,
        run_dir: str | Path,
        *,
        resume: bool | str = False,
        from_step: int | None = None,
        allow_changes: list[str] | tuple[str, ...] = (),
        command: list[str] | None = None,
        progress: bool | str = True,
        context: dist_utils.DistributedContext | None = None,
        out=None,
        sinks: list[MetricsSink] | tuple[MetricsSink, ...] = (),
        stop_past_step: int | None = None,
        signals: StopSignals | None = None,
        stop_by: float | None = None,
        started_at: float | None = None,
        clock: Callable[[], float] | None = None,
        watchdog: HangWatchdog | None = None,
        record_read: ReadHandover | None = None,
    ):
        check_allow_change_keys(allow_changes)  # a typo'd key: refused with the nearest known key
        # A tracker named in the recipe but not installed is refused before anything is written.
        check_trackers_available(config.train.log.trackers)
        # a bad task file: refused here
        self.downstream_tasks = read_choice_tasks(config.train.downstream.tasks)
        check_downstream_fits(config, data_dir, self.downstream_tasks)  # a choice past the model's window too
        self.stop_by, self.clock = stop_by, clock if clock is not None else time.time
        self.recorded_save_seconds: float | None = None  # the run's last save, read at the session's start
        # the record as the command's checks read it (`pilotrun train --stop-by` on a resume), taken over at
        # the session's start where unchanged: read once per command
        self.record_read = record_read if record_read is not None else ReadHandover(run_dir)
        self.watchdog, self.session_ended, self.peer_hung = watchdog, False, False
        # a peer's stack file written since is this session's (hang_watchdog.peer_hangs)
        self.began = time.time()
        self.started_at = started_at if started_at is not None else self.clock()
        self.account = TimeAccount()  # everything until the loop starts is "other" (setup)
        self.progress = progress
        self.out = out if out is not None else sys.stdout
        context = context if context is not None else dist_utils.init_distributed(config.train.device)
        self.session: Session = build_session(
            config, data_dir, run_dir, resume=resume, from_step=from_step, allow_changes=allow_changes,
            command=list(command) if command is not None else list(sys.argv), context=context)
        if self.session.device.type == "cuda":
            # Leaving a phase waits for the device's queued work, so that kernels launched in training are
            # charged to training, not to whatever phase comes next.
            self.account.synchronize_with(torch.cuda.synchronize)
        self.sinks: list[GuardedSink] = [
            sink
            if isinstance(sink, GuardedSink)
            else GuardedSink(type(sink).__name__, lambda sink=sink: sink)
            for sink in sinks
        ]
        self.stop_past_step = stop_past_step
        self.signals = signals if signals is not None else StopSignals()
        self.signals.on_first = self._acknowledge

    @property
    def config(self) -> RunConfig:
        """The effective recipe (a resume's restored one, allowed changes included)."""
        return self.session.config

    @property
    def partition(self) -> list[dict[str, Any]]:
        return self.session.partition

    def _acknowledge(self, signum: int) -> None:
        if self.session.context.is_main_process:
            state, t = self.session.state, self.session.config.train
            print("\n" + interrupt_acknowledgement(signal_name(signum), state.step, t.max_steps),
                  file=sys.stderr, flush=True)  # a new line: the progress bar may hold the current one

    def callbacks(self, loop: LoopState) -> list[Callback]:
        """The loop's callbacks, each given its own section of the recipe (the progress bar opens here)."""
        session, t = self.session, self.session.config.train
        profiler = ProfileWindow(t.profile, session.run_dir, device_type=session.device.type,
                                 rank=session.context.rank)
        window = WindowLogCallback.for_session(loop, progress=self.progress)
        deadline = [] if self.stop_by is None else [
            DeadlineCallback(self.stop_by, setup_seconds=self.clock() - self.started_at, clock=self.clock,
                             recorded_save_seconds=self.recorded_save_seconds)]
        checkpoint = CheckpointCallback.for_section(t.checkpoint, session.device.type)
        watched: list[Callback] = []
        if self.watchdog is not None:
            self.watchdog.attach(loop)
            self.watchdog.on_hang = lambda message: self._record_hang(loop, message)
            watched.append(self.watchdog)
        return [
            *watched,
            ProfileCallback(profiler),
            RareEventsCallback(),
            ShardCheckCallback.for_session(loop),
            SpikeCallback(window.close_window, checkpoint.settle, checkpoint.save_now, window.reopen),
            window,
            EvalCallback(t.eval),
            self._downstream(t.downstream),
            checkpoint,
            KillPointCallback.past_step(self.stop_past_step),
            LauncherWatchCallback.for_process(),
            *deadline,
        ]

    def _downstream(self, section: DownstreamConfig) -> DownstreamEvalCallback:
        """The in-loop tasks, read before the session was built (the effective recipe may name others only
        when a resume changed them: those are read now)."""
        read = [task.path for task in self.downstream_tasks]
        same = read == list(section.tasks)
        return DownstreamEvalCallback(section, self.downstream_tasks if same else None)

    def run(self) -> TrainResult:
        loop = LoopState(self.session, self.account, self.signals, self.out, sinks=self.sinks)
        try:
            with self.signals.installed():
                return self._run(loop)
        finally:
            self.session.metrics.close()
            sinks, self.sinks, loop.sinks = self.sinks, [], []
            for sink in sinks:
                sink.close()  # guarded: a sink failing to close warns and is done with
            self.session.release_lock()  # the session's writes are done

    def _run(self, loop: LoopState) -> TrainResult:
        session = self.session
        self._start_session(loop)
        callbacks = self.callbacks(loop)
        late = dist_utils.first_across_ranks(session.context, next(
            (c.too_late_to_start(loop) for c in callbacks if isinstance(c, DeadlineCallback)), None))
        if late is not None:  # the set-up spent the time a save needs: nothing trained, nothing saved
            return self._end_session(loop, late)
        try:
            ending = train_loop(loop, callbacks)
        except BaseException as exc:
            if self.session_ended:  # ended `hung` by the watchdog, whose exit this unwinding is
                raise
            if isinstance(exc, KeyboardInterrupt):
                result = self._end_session(loop, interrupted_at_once(loop))
                if session.context.is_distributed:
                    raise  # the other ranks wait in a collective: the launcher ends them
                return result
            self.session_ended = True
            if isinstance(exc, Exception) and out_of_space(exc):
                return self._end_for_space(loop, exc)
            reason, message = "error", f"{type(exc).__name__}: {exc}"
            hung = (
                peer_hangs(session.run_dir, self.began, session.context.rank)
                if session.context.is_distributed and isinstance(exc, Exception)
                else []
            )
            if hung:  # the collective broke because a rank hung and left: the session hung
                self.peer_hung = True
                reason, message = (
                    "hung",
                    f"another rank hung (stacks in {', '.join(map(str, hung))}); here: {message}",
                )
            # the code the process ends with: an exception's traceback is Python's 1
            loop.log("session_end", reason=reason, message=message[:2000],
                     time_split=self.account.time_split(), exit_code=HUNG_EXIT_CODE if self.peer_hung else 1)
            session.record.end_session(session.session_id, reason=reason, chain_end=session.metrics.head)
            raise
        return self._end_session(loop, ending)

    def _end_for_space(self, loop: LoopState, exc: Exception) -> TrainResult:
        """The disk filled under a write of the record or a save (another process filled it): nothing is
        committed half (every write is temp + rename), so the session stops, exit 1, for a person to free
        space; its session_end is written where the disk takes it."""
        session = self.session
        message = (
            f"the disk is full ({space_error_line(exc)}); nothing was half committed, the newest committed "
            f"checkpoint is step {loop.last_checkpoint_step}: free space, then --resume"
        )
        with contextlib.suppress(OSError):
            loop.log("session_end", reason="stopped", message=message, time_split=self.account.time_split(),
                     exit_code=1)
            session.record.end_session(session.session_id, reason="stopped", chain_end=session.metrics.head)
        loop.say(f"session_end: stopped at step {loop.step:,} ({message})")
        return TrainResult(
            reason="stopped", exit_code=1, message=message, **session.state.counters().as_dict()
        )

    def _start_session(self, loop: LoopState) -> None:
        """Open the TensorBoard mirror, print the plan and the notes, log `session_start` (rank 0 prints)."""
        session, t, world_size = self.session, self.session.config.train, self.session.context.world_size
        trackers = list(t.log.trackers)
        if trackers and loop.is_main:  # the one process that has the events mirrors them
            with self.account.phase("report"):
                self.sinks[:0] = tracker_sinks(trackers, session.run_dir)
        for line in describe_plan(session.config, world_size, session.state.step, session.device.type):
            loop.say(line)
        for line in recipe_change_lines(session.plan.free_changes, session.plan.allowed_changes,
                                        session.state.step):
            loop.say(line)
        # The earlier sessions' record, read once before this session's first line: a stack file is an earlier
        # session's if written before it, the last save is the one this session's deadline margin owes, and
        # the plan's rate is its recent windows'.
        read = self.record_read.take() if loop.is_main or self.stop_by is not None else None
        if loop.is_main:
            for line in self._record_plan(read.recent_seconds_per_update()):
                loop.say(line)
        for note in session.notes:
            loop.say(f"note: {note}")
        earlier = read.events if read is not None else []
        hangs = unrecorded_hangs(session.run_dir, earlier, self.began) if loop.is_main else []
        self.recorded_save_seconds = last_save_of(earlier)
        loop.log(
            "session_start",
            resumed_from=session.resumed_from,
            world_size=world_size,
            run_json_sha256=run_json_digests(session.record.data),
            tokens_per_update=session.tokens_per_update,
            max_steps=t.max_steps,
            tokens_per_microbatch=session.tokens_per_microbatch,
            metrics_repaired_bytes=session.metrics.repaired_bytes,
            # the command's start to here: what a later start's deadline check counts as its set-up
            setup_seconds=max(0.0, self.clock() - self.started_at),
            **({"restart": session.restart} if session.restart else {}),
            **(
                {"resumed_checkpoint": self._resumed_marker()}
                if session.plan.resuming and loop.is_main
                else {}
            ),
        )
        for hang in hangs:  # the stuck rank 0 recorded no ending: the record says it now
            loop.log("hang_found", hung_session=hang.session_id, rank=hang.rank, stack_file=hang.path())
            loop.say(f"note: session {hang.session_id} has no session_end, but rank {hang.rank} wrote its "
                     f"stacks during it ({hang.path()}): it hung; recorded as hang_found")

    def _record_plan(self, recent_seconds_per_update: list[float]) -> list[str]:
        """run.json's `plan` (run_plan.py), written before the first update; returns its block for the log.
        `recent_seconds_per_update`: the record's recent windows' rates (record.RecordRead)."""
        session, t = self.session, self.session.config.train
        with self.account.phase("report"):
            plan = run_plan(session.record.data, session.state.loader, session_id=session.session_id,
                            start_step=session.state.step, max_steps=t.max_steps,
                            accumulation=t.gradient_accumulation_steps,
                            seconds_per_update=recent_seconds_per_update,
                            now=time.time())
            session.record.data["plan"] = plan
            session.record.save()
        return plan_lines(plan)

    def _resumed_marker(self) -> dict[str, Any]:
        """What the marker of the checkpoint this session resumed from says of its making: the session that
        committed it and its counters. The marker is the truth; its own `checkpoint` event may be missing (a
        kill between the commit and the record), and summarize reconciles the two with this."""
        meta = self.session.checkpointer.meta(self.session.plan.checkpoint_step)
        return {"step": self.session.plan.checkpoint_step, "session_id": meta.get("session_id"),
                "counters": meta.get("counters"), "metrics_chain_head": meta.get("metrics_chain_head")}

    def _end_session(self, loop: LoopState, ending: Ending) -> TrainResult:
        session = self.session
        self.session_ended = True
        split = self.account.time_split()
        loop.log("session_end", reason=ending.reason, message=ending.message, time_split=split,
                 val_loss=loop.last_val_loss, exit_code=ending.exit_code)
        session.record.end_session(session.session_id, reason=ending.reason, chain_end=session.metrics.head)
        phases = ", ".join(f"{phase} {split[f'{phase}_seconds']:.1f} s" for phase in PHASES)
        loop.say(f"session_end: {ending.reason} at step {loop.step:,} ({ending.message}); {phases} of "
                 f"{split['wall_seconds']:.1f} s wall")
        return TrainResult(reason=ending.reason, exit_code=ending.exit_code, message=ending.message,
                           **session.state.counters().as_dict())


    def _record_hang(self, loop: LoopState, message: str) -> None:
        """From the watchdog's thread, the main thread stuck: the session ends `hung` on the record (rank 0
        writes it; the metrics sinks are left alone, they are not the watchdog thread's to call)."""
        session = self.session
        if self.session_ended or session.metrics is None or session.record is None:
            return
        self.session_ended = True
        session.metrics.log("session_end", session.state.counters(), reason="hung", message=message[:2000],
                            time_split=self.account.time_split(), val_loss=loop.last_val_loss,
                            exit_code=HUNG_EXIT_CODE)
        session.metrics.fsync()
        session.record.end_session(session.session_id, reason="hung", chain_end=session.metrics.head)


def interrupted_at_once(loop: LoopState) -> Ending:
    """Ctrl-C where SIGINT is not one of the session's stop signals (`--stop-signals`): Python's own handler
    raised KeyboardInterrupt wherever the main thread was, so the update in flight is lost and nothing is
    saved; the person asked for the stop, so the session is `interrupted` (exit 130, as a second signal ends
    one), not an error, and says what is left to resume from."""
    kept = loop.last_checkpoint_step
    left = (f"the newest committed checkpoint is step {kept:,}" if kept is not None
            else "nothing of this run is saved (no checkpoint committed yet)")
    return Ending("interrupted", 128 + signal.SIGINT,
                  "SIGINT (Ctrl-C), not one of this session's stop signals (--stop-signals): stopped at "
                  f"once, no checkpoint for step {loop.step:,}; {left}")


AUTO_HANG_BOUNDS = HangBounds()  # `--hang-timeout auto`


def start_watchdog(bounds: HangBounds | None, run_dir: str | Path) -> HangWatchdog | None:
    """This rank's hang watchdog, started (None when `--hang-timeout off`). The rank is torchrun's (RANK),
    read before the process group exists so that its creation is watched too."""
    if bounds is None:
        return None
    rank = (
        int(os.environ["RANK"]) if dist_utils.launched_by_torchrun() and os.environ["RANK"].isdigit() else 0
    )
    return HangWatchdog(bounds, run_dir, rank).start()


def train_from_cli(config: RunConfig, data_dir: str, run_dir: str, resume: bool | str, from_step: int | None,
                   allow_changes: list[str], command: list[str], run_facts: dict[str, Any] | None = None,
                   stop_past_step: int | None = None, progress: bool | str = True,
                   signals: StopSignals | None = None, stop_by: float | None = None,
                   started_at: float | None = None, hang_bounds: HangBounds | None = AUTO_HANG_BOUNDS,
                   record_read: ReadHandover | None = None) -> int:
    """`pilotrun train`: build, run, return the exit code (bad input raises PilotrunError -> exit 2).
    `run_facts` are extra run.json sections recorded when this session starts the run (the recipe lock of a
    frozen run); `stop_past_step` is the pilot's kill point (`--stop-past-step`). `signals`, already installed
    by the command before its set-up, hears a stop signal from the start; a second one during the set-up ends
    the command at once with its code. `--resume auto` of a complete run prints "nothing to do" and returns 0.
    `hang_bounds` (`--hang-timeout`; None: off): the hang watchdog, watching from here to the process group's
    end, whose timeout it sets (hang_watchdog.HangBounds.process_group_seconds). `record_read`: the record as
    the command's checks read it, for the session's start to take over."""
    signals = signals if signals is not None else StopSignals()
    context = None
    trainer = None
    watchdog = start_watchdog(hang_bounds, run_dir)
    group_seconds = hang_bounds.process_group_seconds() if hang_bounds is not None else None
    try:
        context = dist_utils.init_distributed(config.train.device, **(
            {"timeout_minutes": group_seconds / 60} if group_seconds is not None else {}))
        trainer = Trainer(config, data_dir, run_dir, resume=resume, from_step=from_step,
                          allow_changes=allow_changes, command=command, context=context,
                          stop_past_step=stop_past_step, progress=progress, signals=signals, stop_by=stop_by,
                          started_at=started_at, watchdog=watchdog, record_read=record_read)
        if run_facts and trainer.session.started_run:
            trainer.session.record.data.update(run_facts)
            trainer.session.record.save()
        result = trainer.run()
        signals.finished = True
        # Every rank leaves together, once rank 0 has ended the session on the record: torchrun takes a rank's
        # non-zero exit (a stop's resumable code) for a failure and SIGTERMs the ranks still running.
        dist_utils.barrier(context)
        return result.exit_code
    except NothingToDo as done:
        if context is None or context.is_main_process:
            print(done, flush=True)
        return 0
    except SecondSignal as second:
        print(
            f"second {signal_name(second.signum)} during the set-up: stopped at once",
            file=sys.stderr,
            flush=True,
        )
        return signals.exit_code(second.signum)
    except Exception:
        if trainer is None or not trainer.peer_hung:
            raise
        print(
            f"pilotrun: hung: another rank made no progress (RUN/{HANGS_DIR}/); exiting with "
            f"{HUNG_EXIT_CODE}",
            file=sys.stderr,
            flush=True,
        )
        return HUNG_EXIT_CODE
    finally:
        # The DDP/FSDP wrapper (DDP's reducer) uses the process group: free it, reference cycles included,
        # before the group is destroyed rather than after, when the function's frame goes (a 2-rank gloo run
        # was once seen hanging in rank 1's teardown after its session_end with the other order).
        del trainer
        gc.collect()
        if context is not None:
            dist_utils.shutdown_distributed(context)
        if watchdog is not None:
            watchdog.stop()
