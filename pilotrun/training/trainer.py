"""The training loop: one honest update after another, with the run record, checkpoints and signals.

session.py builds everything (fresh or resumed); this module trains. One update (docs/MODEL.md, "one
optimizer step"):

    set_learning_rates(step)                       # the LR is a function of applied updates only
    for each of A microbatches: forward under autocast, scaler.scale(loss / A).backward()
                                tokens_seen += tokens_per_microbatch        # work done, applied or not
    all-reduce the step statistics (expert counts SUM, max logits MAX)
    apply_update: unscale, global norm, clip, step, scaler update            # may skip (overflow)
    if applied: the update hooks (QK-Clip, expert-bias update), step += 1
    else:       updates_skipped += 1, an `overflow` event
    reset the step statistics

Nothing else moves `step`: an fp16 overflow must move neither the step nor the schedule, so that a resumed
run and an uninterrupted one agree. Counters are global (all ranks together) and only rank 0 writes the
record. Every `log_every` applied updates a `train` event closes the window; before every checkpoint the
window is closed too, so a checkpoint's counters always coincide with a `train` event (what `summarize`
reconciles a resumed session against). Evaluation, checkpointing, profiling and reporting are timed apart from
training (timing.py), and the hot loop does no host synchronisation beyond the one the skip decision needs.

Observers: `train.profile` runs torch.profiler around a few update attempts (profiling.py); those attempts are
the "profile" phase's, not training's, and their window says so (`window.profiled_attempts`), so no throughput
figure counts them. Every event written to metrics.jsonl is handed to the metrics sinks (report/sinks.py: the
live TensorBoard mirror of `train.tensorboard`, and any the caller passes), each guarded so that a failing
sink warns once and changes neither the training nor the record; writing and mirroring are the "report" phase.

SIGINT / SIGTERM: the current update is finished, the window is logged, a checkpoint is saved, then
`session_end` with reason "interrupted", and the exit code is 130 (SIGINT) or 143 (SIGTERM).

Over this project's ~500-line module size because the loop's observers (the profiler window, the metrics sinks,
the look-ahead at the next update's data) are small methods of the one object whose phases they are timed in;
the loop itself (`_run`) still fits on a screen.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pilotrun.config import RunConfig
from pilotrun.data.reader import BatchLoader, TokenIdError
from pilotrun.model.diagnostics import (
    attention_diagnostics,
    block_output_rms,
    collect_step_statistics,
    moe_diagnostics,
    reset_step_statistics,
)
from pilotrun.optim.muon_adamw import parameter_rms
from pilotrun.optim.schedule import set_learning_rates
from pilotrun.optim.update_hooks import StepStatistics
from pilotrun.run.record import run_json_digests
from pilotrun.run.sinks import GuardedSink, MetricsSink, guarded_tensorboard_sink
from pilotrun.training import distributed as dist_utils
from pilotrun.training.dcp_storage import training_state
from pilotrun.training.environment import memory_snapshot
from pilotrun.training.notices import interrupt_acknowledgement
from pilotrun.training.pilot_handshake import FreezePoint
from pilotrun.training.precision import UpdateOutcome, apply_update, autocast_context
from pilotrun.training.profiling import ProfileWindow
from pilotrun.training.rng import capture_rng_state
from pilotrun.training.session import build_session, tokens_per_update
from pilotrun.training.timing import PHASES, TimeAccount, WindowClock, throughput
from pilotrun.training.window import Window, WindowFigures, train_event_fields

EXIT_CODES = {"completed": 0, "stopped": 1, signal.SIGINT: 130, signal.SIGTERM: 143}
TENSORBOARD_FOLDER = "tensorboard"  # RUN/tensorboard/: the live mirror of `train.tensorboard`


@dataclass
class TrainResult:
    reason: str  # completed | interrupted | stopped | error
    exit_code: int
    step: int
    tokens_seen: int
    updates_attempted: int
    updates_skipped: int
    message: str = ""


class _SecondSignal(Exception):
    """A second SIGINT/SIGTERM while the first was being honoured: stop without waiting further."""


def describe_plan(config: RunConfig, world_size: int, start_step: int = 0) -> list[str]:
    """The lines printed before training starts: tokens per update and the planned tokens."""
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
        lines.append(f"resuming at step {start_step:,}: {remaining:,} updates ({remaining * per_update:,} tokens) "
                     "remain")
    return lines


def _due(applied: bool, step: int, every: int) -> bool:
    """An applied update that lands on a multiple of a cadence (0: never)."""
    return applied and every > 0 and step % every == 0


def _float(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


class Trainer:
    """Builds one session (fresh or resumed, session.py), then `run()` trains to `train.max_steps`.

    `sinks`: extra metrics sinks (report/sinks.py `MetricsSink`: `write(event)` and `close()`, or a
    `GuardedSink`) that receive every event as it is recorded, beside the TensorBoard mirror of
    `train.tensorboard`. Only rank 0 writes the record, so only rank 0's sinks receive events; every rank's
    are closed when `run()` returns."""

    def __init__(self, config: RunConfig, data_dir: str | Path, run_dir: str | Path, *, resume: bool = False,
                 from_step: int | None = None, allow_changes: list[str] | tuple[str, ...] = (),
                 command: list[str] | None = None, progress: bool = True,
                 context: dist_utils.DistributedContext | None = None, out=None,
                 sinks: list[MetricsSink] | tuple[MetricsSink, ...] = ()):
        self.account = TimeAccount()  # everything until the loop starts is "other" (setup)
        self.progress = progress
        self.out = out if out is not None else sys.stdout
        context = context if context is not None else dist_utils.init_distributed(config.train.device)
        self.freeze_point = FreezePoint.from_environment(distributed=context.is_distributed)
        s = build_session(config, data_dir, run_dir, resume=resume, from_step=from_step, allow_changes=allow_changes,
                          command=list(command) if command is not None else list(sys.argv), context=context)
        self.session = s
        self.context, self.is_main, self.config, self.device = context, context.is_main_process, s.config, s.device
        if self.device.type == "cuda":
            # Leaving a phase waits for the device's queued work, so that kernels launched in training are
            # charged to training, not to whatever phase comes next.
            self.account.synchronize_with(torch.cuda.synchronize)
        self.raw_model, self.model, self.optimizer, self.scaler = s.raw_model, s.model, s.optimizer, s.scaler
        self.partition, self.state, self.hooks, self.train_loader = s.partition, s.state, s.state.hooks, s.state.loader
        self.resumed_from, self.notes, self.record, self.metrics = s.resumed_from, s.notes, s.record, s.metrics
        self.checkpointer, self.tokens_per_microbatch, self.dataset = s.checkpointer, s.tokens_per_microbatch, s.dataset
        self.last_checkpoint_step = s.resumed_from
        self.last_val_loss: float | None = None
        self.run_dir = Path(run_dir)
        # Every rank profiles the same attempts (the ranks wait for each other inside an update, so profiling
        # one alone would slow them all anyway) and writes its own rank-named files.
        self.profiler = ProfileWindow(self.config.train.profile, self.run_dir, device_type=self.device.type,
                                      rank=context.rank)
        self.sinks: list[GuardedSink] = [
            sink if isinstance(sink, GuardedSink) else GuardedSink(type(sink).__name__, lambda sink=sink: sink)
            for sink in sinks]
        self._stop_signal: int | None = None
        self._signal_count = 0
        self._logged_step: int | None = None  # the pilot's kill point (pilot_handshake.py) waits for a train event

    # ------------------------------------------------------------------------------------------ state
    @property
    def step(self) -> int:
        return self.state.step

    @property
    def updates_skipped(self) -> int:
        return self.state.updates_skipped

    def hook(self, name: str) -> Any:
        """The update hook of that name (tests and tools read their counters)."""
        return next(hook for hook in self.hooks if hook.name == name)

    @property
    def qk_counters(self) -> Any:
        return self.hook("qk_clip").counters

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own state: counters, loader cursor, update hooks' state (model, optimizer, scaler
        and RNG travel beside it in the checkpoint)."""
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)

    def counters(self) -> dict[str, int]:
        return self.state.counters().as_dict()

    # ------------------------------------------------------------------------------------------ signals
    def _handle_signal(self, signum: int, frame: Any) -> None:
        self._signal_count += 1
        if self._signal_count > 1:
            raise _SecondSignal(signum)
        self._stop_signal = signum
        if self.is_main:
            print("\n" + interrupt_acknowledgement(signal.Signals(signum).name, self.step, self.config.train.max_steps),
                  file=sys.stderr, flush=True)  # a new line: the progress bar may hold the current one

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, self._handle_signal)
        return previous

    # ------------------------------------------------------------------------------------------ pieces
    def _log(self, event: str, **fields: Any) -> None:
        """Record one event (rank 0) and hand it to the sinks; both are the "report" phase."""
        with self.account.phase("report"):
            record = self.metrics.log(event, self.state.counters(), **fields)
            if record is not None:
                for sink in self.sinks:
                    sink.write(record)

    def _open_tensorboard(self) -> None:
        """`train.tensorboard`: the live mirror, on rank 0 only (the one process that has the events)."""
        if self.config.train.tensorboard and self.is_main:
            with self.account.phase("report"):
                self.sinks.insert(0, guarded_tensorboard_sink(self.run_dir / TENSORBOARD_FOLDER))

    def _close_sinks(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()  # guarded: a sink failing to close warns and is done with

    def evaluate(self) -> dict[str, Any]:
        """Mean CE over `eval_batches` batches from the start of val: eval mode (no counters or trackers move),
        no grad, the training precision. The same batches every time, so values are comparable."""
        t = self.config.train
        loader = BatchLoader(self.session.dataset.split("val"), t.batch_size, t.seq_len, mode="successive",
                             rank=self.context.rank, world_size=self.context.world_size)
        started = time.perf_counter()
        self.raw_model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        try:
            with torch.no_grad():
                for _ in range(t.eval_batches):
                    inputs, targets = loader.next_batch()
                    inputs = inputs.to(self.device, non_blocking=True)
                    targets = targets.to(self.device, non_blocking=True)
                    with autocast_context(t.precision, self.device.type):
                        output = self.raw_model(inputs, targets)
                    total += output.ce_loss.detach().double()
        finally:
            self.raw_model.train()
        loss = dist_utils.mean_across_ranks(self.context, {"loss": float(total.item()) / t.eval_batches})["loss"]
        self.last_val_loss = loss
        return {"loss": loss, "batches": t.eval_batches, "tokens": t.eval_batches * self.tokens_per_microbatch,
                "seconds": time.perf_counter() - started}

    def save_checkpoint(self) -> None:
        started = time.perf_counter()
        size = 0
        # Every rank takes part: with several ranks the checkpoint is written collectively (DCP: shards and
        # each rank's RNG) and committed by rank 0; with one process this is the plain torch.save.
        state = training_state(self.model, self.raw_model, self.optimizer, self.context)
        state.update({"scaler": self.scaler.state_dict(), "trainer": self.state_dict(), "rng": capture_rng_state()})
        meta = self.session.checkpoint_meta(self.config, self.partition, self.state.counters())
        meta["metrics_chain_head"] = self.metrics.head  # the record up to this checkpoint, as the chain says
        path = self.checkpointer.save(self.step, state, meta)
        if self.is_main:
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        dist_utils.barrier(self.context)
        self.last_checkpoint_step = self.step
        self.metrics.fsync()
        self._log("checkpoint", path=str(path) if path is not None else None, seconds=time.perf_counter() - started,
                  bytes=size)

    # ------------------------------------------------------------------------------------------ the loop
    def run(self) -> TrainResult:
        previous_handlers = self._install_signal_handlers()
        try:
            return self._run()
        finally:
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
            self.metrics.close()
            self._close_sinks()
            self.session.release_lock()  # the session's writes are done

    def _run(self) -> TrainResult:
        t, account, state = self.config.train, self.account, self.state
        bar = self._start_session()
        window, window_clock = Window(self.device), WindowClock(account)
        reason, message, exit_code = "completed", f"reached max_steps={t.max_steps}", 0
        self.raw_model.train()
        reset_step_statistics(self.raw_model)
        try:
            account.switch("train")
            while state.step < t.max_steps:
                self._check_next_update_data(window, window_clock, bar)
                if self.profiler.profiles(state.step + 1):
                    outcome, restarted, hook_events = self._profiled_update(window)
                else:
                    window.update_started()
                    outcome, restarted, hook_events = self._train_one_update(window)
                    window.update_finished()
                if restarted or not outcome.applied or hook_events:  # rare: logged outside the training time
                    with account.phase("other"):
                        self._log_rare_events(outcome, restarted, hook_events)
                stop = self._stop_signal is not None
                if self.context.is_distributed:
                    stop = dist_utils.any_across_ranks(self.context, stop)
                too_many_skips = state.consecutive_skips >= t.max_consecutive_skips
                final = stop or too_many_skips or state.step >= t.max_steps
                at_checkpoint = _due(outcome.applied, state.step, t.checkpoint_every)
                at_eval = _due(outcome.applied, state.step, t.eval_every)
                if _due(outcome.applied, state.step, t.log_every) or final or at_checkpoint:
                    # The last window leaves the training phase for good, so that the session's training
                    # seconds equal the sum of its windows' exactly.
                    with account.phase("other") if not final else _switch_for_good(account, "other"):
                        self._close_window(window, window_clock, bar)
                        window = Window(self.device)
                reset_step_statistics(self.raw_model)
                if at_eval:
                    with account.phase("eval"):
                        result = self.evaluate()
                    with account.phase("other"):
                        self._log("val", **result)
                if at_checkpoint or (final and self.last_checkpoint_step != state.step):
                    with account.phase("checkpoint"):
                        self.save_checkpoint()
                if stop or too_many_skips:
                    reason, exit_code, message = self._stop_reason(stop, outcome)
                    break
                committed_here = self.last_checkpoint_step != self.resumed_from  # steps only grow
                if self.freeze_point.due(self._logged_step, committed_here, state.step, t.max_steps):
                    with account.phase("other"):
                        self.freeze_point.freeze()
            else:
                if self.last_checkpoint_step != state.step:  # a resume at or past max_steps: nothing new to save
                    with account.phase("checkpoint"):
                        self.save_checkpoint()
        except _SecondSignal as exc:
            signum = int(exc.args[0])
            reason, exit_code = "interrupted", EXIT_CODES.get(signum, 143)
            message = f"second {signal.Signals(signum).name}: stopped at once, no checkpoint for step {state.step}"
        except BaseException as exc:
            account.switch("other")
            with contextlib.suppress(Exception):  # what the profiler saw is worth keeping, but the session's own
                self._close_profiler()            # error is the one to report
            self._log("session_end", reason="error", message=f"{type(exc).__name__}: {exc}"[:2000],
                      time_split=account.time_split())
            self.record.end_session(self.session.session_id, reason="error", chain_end=self.metrics.head)
            if bar is not None:
                bar.close()
            raise
        return self._end_session(reason, exit_code, message, bar)

    def _start_session(self):
        """Print the plan and the notes, open the TensorBoard mirror, log `session_start`, open the progress bar
        (rank 0)."""
        t, world_size = self.config.train, self.context.world_size
        self._open_tensorboard()
        if self.is_main:
            for line in describe_plan(self.config, world_size, self.step):
                print(line, file=self.out, flush=True)
            for note in self.notes:
                print(f"note: {note}", file=self.out, flush=True)
        self._log("session_start", resumed_from=self.resumed_from, world_size=world_size,
                  run_json_sha256=run_json_digests(self.record.data),
                  tokens_per_update=self.session.tokens_per_update, max_steps=t.max_steps,
                  tokens_per_microbatch=self.tokens_per_microbatch, metrics_repaired_bytes=self.metrics.repaired_bytes)
        if not (self.progress and self.is_main):
            return None
        from tqdm import tqdm

        return tqdm(total=t.max_steps, initial=self.step, file=sys.stderr, unit="step", dynamic_ncols=True,
                    desc="train", mininterval=0.5)

    def _log_rare_events(self, outcome: UpdateOutcome, restarted: int, hook_events: list[dict[str, Any]]) -> None:
        for _ in range(restarted):
            self.state.data_restarts += 1
            self._log("data_restart", epoch=int(self.train_loader.epoch), data_restarts=self.state.data_restarts)
        if not outcome.applied:
            self._log("overflow", reason=outcome.reason, loss_scale_before=outcome.loss_scale_before,
                      loss_scale_after=outcome.loss_scale_after, consecutive_skips=self.state.consecutive_skips)
        for fields in hook_events:  # logged after the update they follow: the counters include it
            self._log("qk_clip", **fields)

    def _stop_reason(self, stop: bool, outcome: UpdateOutcome) -> tuple[str, int, str]:
        if stop:
            signum = self._stop_signal if self._stop_signal is not None else signal.SIGTERM
            return ("interrupted", EXIT_CODES.get(signum, 143),
                    f"{signal.Signals(signum).name} received: finished the update, saved checkpoint step {self.step}")
        t = self.config.train
        return ("stopped", 1, f"{self.state.consecutive_skips} consecutive skipped updates "
                f"(train.max_consecutive_skips={t.max_consecutive_skips}); last reason: {outcome.reason}")

    def _end_session(self, reason: str, exit_code: int, message: str, bar) -> TrainResult:
        account = self.account
        account.switch("other")
        self._close_profiler()  # a window cut short by a signal or the end of the run writes what it saw
        if bar is not None:
            with account.phase("report"):
                bar.close()
        split = account.time_split()
        self._log("session_end", reason=reason, message=message, time_split=split, val_loss=self.last_val_loss)
        self.record.end_session(self.session.session_id, reason=reason, chain_end=self.metrics.head)
        if self.is_main:
            phases = ", ".join(f"{phase} {split[f'{phase}_seconds']:.1f} s" for phase in PHASES)
            print(f"session_end: {reason} at step {self.step:,} ({message}); {phases} of "
                  f"{split['wall_seconds']:.1f} s wall", file=self.out, flush=True)
        return TrainResult(reason=reason, exit_code=exit_code, message=message, **self.counters())

    def _check_next_update_data(self, window: Window, window_clock: WindowClock, bar) -> None:
        """Look at the ids of the next update's batches (every rank's rows, so all ranks agree) before any of it
        runs. A damaged shard can hold an id outside the vocabulary although its manifest did not; found here,
        at an update boundary, the last applied state is whole: its window is closed and checkpointed, and the
        TokenIdError (one line naming shard and offset, exit 2) ends the session as an error. Found inside an
        update by the reader's own guard, half an update would be lost with no checkpoint of the state before.
        The ids were read from memory-mapped shards that the update then reads again from the page cache."""
        try:
            self.train_loader.check_upcoming_batches(self.config.train.gradient_accumulation_steps)
        except TokenIdError:
            with _switch_for_good(self.account, "other"):
                self._close_window(window, window_clock, bar)
            if self.last_checkpoint_step != self.state.step:
                with self.account.phase("checkpoint"):
                    self.save_checkpoint()
            raise

    def _profiled_update(self, window: Window) -> tuple[UpdateOutcome, int, list[dict[str, Any]]]:
        """One update attempt under torch.profiler, charged to the "profile" phase together with the profiler's
        start and the writing of its files, and counted in the window as profiled, so that neither the training
        seconds nor any training-only throughput figure includes it."""
        with self.account.phase("profile"):
            self.profiler.before_update(self.state.step + 1)
            microbatches = window.microbatches
            result = self._train_one_update(window)
            window.profiled_attempts += 1
            window.profiled_microbatches += window.microbatches - microbatches
            written = self.profiler.after_update()
        self._report_profile(written)
        return result

    def _close_profiler(self) -> None:
        if self.profiler.active:
            with self.account.phase("profile"):
                written = self.profiler.close()
            self._report_profile(written)

    def _report_profile(self, written: list[Path]) -> None:
        if written and self.is_main:
            with self.account.phase("report"):
                print(f"profile: {len(written)} file(s) in {written[0].parent} (this rank's: "
                      f"{', '.join(p.name for p in written)})", file=self.out, flush=True)

    def _train_one_update(self, window: Window) -> tuple[UpdateOutcome, int, list[dict[str, Any]]]:
        """One update: microbatches, agreed statistics, the update, and what follows only when applied.

        Returns the outcome, how many exhaustion restarts of the training split happened during it (0 nearly
        always) and the fields of the update hooks' events (QK-Clip's `qk_clip` events, usually none);
        logging them is left to the caller, outside the timed training region."""
        cfg, t, state = self.config, self.config.train, self.state
        model, optimizer, scaler, loader = self.model, self.optimizer, self.scaler, self.train_loader
        accumulation = t.gradient_accumulation_steps
        set_learning_rates(optimizer, state.step, cfg.optim.schedule)
        # The update that should close a window also measures the update RMS per group, once a window.
        measure_rms = (state.step + 1) % t.log_every == 0 or state.step + 1 >= t.max_steps
        optimizer.zero_grad(set_to_none=True)
        restarted = 0
        for micro in range(accumulation):
            inputs, targets = loader.next_batch()
            restarted += loader.last_batch_restarted
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            with dist_utils.gradient_sync(model, micro == accumulation - 1):
                with autocast_context(t.precision, self.device.type):
                    output = model(inputs, targets)
                scaler.scale(output.loss / accumulation).backward()
            window.ce_sum += output.ce_loss.detach()
            window.aux_sum += output.aux_loss.detach()
            state.tokens_seen += self.tokens_per_microbatch
            window.microbatches += 1
        state.updates_attempted += 1
        window.attempted += 1
        statistics = StepStatistics(*dist_utils.all_reduce_step_statistics(
            self.context, *collect_step_statistics(self.raw_model)))
        outcome = apply_update(model, optimizer, scaler, cfg.optim.grad_clip, measure_update_rms=measure_rms)
        hook_events: list[dict[str, Any]] = []
        if outcome.applied:
            for hook in self.hooks:
                hook_events += hook.after_update(state.step, statistics)
            if measure_rms:
                window.update_rms, window.update_rms_step = optimizer.last_update_rms, state.step + 1
            state.step += 1
            state.consecutive_skips = 0
            window.applied += 1
            window.clipped += int(outcome.clipped)
            window.grad_norm = outcome.grad_norm
            window.grad_norm_max = max(window.grad_norm_max, outcome.grad_norm)
        else:
            state.updates_skipped += 1
            state.consecutive_skips += 1
            window.skipped += 1
        window.loss_scale = outcome.loss_scale_after
        window.add_statistics(statistics.tokens_per_expert, statistics.qk_max_logit)
        return outcome, restarted, hook_events

    def _close_window(self, window: Window, window_clock: WindowClock, bar) -> None:
        train_seconds, wall_seconds = window_clock.close_window()
        if window.attempted == 0:
            return
        raw, optimizer = self.raw_model, self.optimizer
        tokens = window.microbatches * self.tokens_per_microbatch
        profiled_tokens = window.profiled_microbatches * self.tokens_per_microbatch
        local = {"loss": _float(window.ce_sum) / window.microbatches, "aux": _float(window.aux_sum) / window.microbatches}
        means = dist_utils.mean_across_ranks(self.context, local)
        figures = WindowFigures(
            updates_applied=window.applied, updates_attempted=window.attempted, updates_skipped=window.skipped,
            clipped=window.clipped, microbatches=window.microbatches, tokens=tokens, train_seconds=train_seconds,
            wall_seconds=wall_seconds, cpu_seconds=window_clock.cpu_seconds, loss=means["loss"], aux_loss=means["aux"], grad_norm=window.grad_norm,
            grad_norm_max=window.grad_norm_max, loss_scale=window.loss_scale, update_rms=window.update_rms,
            update_rms_step=window.update_rms_step, profiled_attempts=window.profiled_attempts,
            profiled_tokens=profiled_tokens, profile_seconds=window_clock.profile_seconds,
            device_seconds=window.device_seconds())
        speed = throughput(tokens, train_seconds, wall_seconds, self.session.flops_per_token,
                           self.session.peak_flops_per_s, train_tokens=tokens - profiled_tokens)
        group = optimizer.param_groups[0]
        fields = train_event_fields(
            figures, lr=float(group["lr"]), base_lr=float(group["base_lr"]) if group.get("base_lr") else None,
            epoch=int(self.train_loader.epoch), data_restarts=self.state.data_restarts, throughput=speed,
            moe=moe_diagnostics(raw, window.tokens_per_expert) if window.tokens_per_expert is not None else {},
            attention=attention_diagnostics(window.qk_max_logit) if window.qk_max_logit is not None else {},
            hook_metrics={hook.name: hook.window_metrics() for hook in self.hooks},
            memory=memory_snapshot(self.device), block_output_rms=block_output_rms(raw),
            weight_rms=parameter_rms(optimizer))
        self._log("train", **fields)
        self._logged_step = self.step
        if bar is not None:
            with self.account.phase("report"):
                bar.update(self.step - bar.n)
                tps = speed["train_tokens_per_s"]
                bar.set_postfix_str(f"loss={means['loss']:.4f} train_tok/s={tps:,.0f}" if tps else
                                    f"loss={means['loss']:.4f}", refresh=True)


@contextlib.contextmanager
def _switch_for_good(account: TimeAccount, phase: str):
    account.switch(phase)
    yield


def train_from_cli(config: RunConfig, data_dir: str, run_dir: str, resume: bool, from_step: int | None,
                   allow_changes: list[str], command: list[str], run_facts: dict[str, Any] | None = None) -> int:
    """`pilotrun train`: build, run, return the exit code (bad input raises PilotrunError -> exit 2).
    `run_facts` are extra run.json sections recorded before training starts (the recipe lock of a frozen run)."""
    context = dist_utils.init_distributed(config.train.device)
    trainer = None
    try:
        trainer = Trainer(config, data_dir, run_dir, resume=resume, from_step=from_step,
                          allow_changes=allow_changes, command=command, context=context)
        if run_facts:
            trainer.record.data.update(run_facts)
            trainer.record.save()
        return trainer.run().exit_code
    finally:
        # The DDP/FSDP wrapper (DDP's reducer) uses the process group: free it, reference cycles included, before
        # the group is destroyed rather than after, when the function's frame goes (a 2-rank gloo run was once
        # seen hanging in rank 1's teardown after its session_end with the other order).
        del trainer
        gc.collect()
        dist_utils.shutdown_distributed(context)
