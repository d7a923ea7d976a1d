"""The training loop: one honest update after another, with the run record, checkpoints and signals.

One update follows spec/model.md section 2.5 exactly:

    set_learning_rates(step)                       # the LR is a function of applied updates only (D11)
    for each of A microbatches: forward under autocast, scaler.scale(loss / A).backward()
                                tokens_seen += tokens_per_microbatch        # work done, applied or not
    all-reduce the step statistics (expert counts SUM, max logits MAX)
    apply_update: unscale, global norm, clip, step, scaler update            # may skip (overflow)
    if applied: QK-Clip, expert-bias update, step += 1
    else:       updates_skipped += 1, an `overflow` event
    reset the step statistics

Nothing else moves `step`. Counters are global (all ranks together) and only rank 0 writes the record.
Every `log_every` applied updates a `train` event closes the window; before every checkpoint the window is
closed too, so a checkpoint's counters always coincide with a `train` event (what `summarize` reconciles
a resumed session against). Evaluation, checkpointing and logging are timed apart from training
(timing.py), and the hot loop does no host synchronisation beyond the one the skip decision needs.

SIGINT / SIGTERM: the current update is finished, the window is logged, a checkpoint is saved, then
`session_end` with reason "interrupted", and the exit code is 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pilotrun.config import RunConfig, config_from_dict, config_to_dict, validate_run_config
from pilotrun.data.reader import BatchLoader, check_data_fits_recipe, open_dataset
from pilotrun.errors import CheckpointError, ConfigError
from pilotrun.model.accounting import count_parameters, flops_per_token
from pilotrun.model.balancing import update_expert_bias
from pilotrun.model.diagnostics import (
    attention_diagnostics,
    block_output_rms,
    collect_step_statistics,
    moe_diagnostics,
    reset_step_statistics,
)
from pilotrun.model.transformer import build_model
from pilotrun.optim.muon_adamw import build_optimizer, parameter_rms
from pilotrun.optim.partition import partition_table
from pilotrun.optim.qk_clip import QKClipCounters, apply_qk_clip, qk_clip_events
from pilotrun.optim.schedule import expert_bias_speed, set_learning_rates
from pilotrun.train import distributed as dist_utils
from pilotrun.train.checkpoint import check_resume_compatibility
from pilotrun.train.dcp_storage import DistributedCheckpointer, load_training_state, training_state
from pilotrun.train.environment import git_state, hardware_info, memory_snapshot, software_versions
from pilotrun.train.precision import UpdateOutcome, apply_update, autocast_context, build_grad_scaler
from pilotrun.train.rng import capture_rng_state, restore_rng_state, seed_every_generator
from pilotrun.train.runlog import MetricsLog, RunRecord
from pilotrun.train.timing import TimeAccount, WindowClock, throughput

EXIT_CODES = {"completed": 0, "stopped": 1, signal.SIGINT: 130, signal.SIGTERM: 143}


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


def tokens_per_update(config: RunConfig, world_size: int) -> int:
    t = config.train
    return t.batch_size * t.seq_len * t.gradient_accumulation_steps * world_size


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


def check_run_dir_is_new(run_dir: Path) -> None:
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise ConfigError(f"run folder {run_dir} already exists; pass --resume to continue it, or choose a new "
                          "--run-dir")


def _float(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


class Trainer:
    """Builds everything for one session (fresh or resumed), then `run()` trains to `train.max_steps`."""

    def __init__(self, config: RunConfig, data_dir: str | Path, run_dir: str | Path, *, resume: bool = False,
                 from_step: int | None = None, allow_changes: list[str] | tuple[str, ...] = (),
                 command: list[str] | None = None, progress: bool = True,
                 context: dist_utils.DistributedContext | None = None, out=None):

        self.account = TimeAccount()  # everything until the loop starts is "other" (setup)
        self.run_dir = Path(run_dir)
        self.data_dir = Path(data_dir)
        self.progress = progress
        self.out = out if out is not None else sys.stdout
        self.command = list(command) if command is not None else list(sys.argv)
        self.context = context if context is not None else dist_utils.init_distributed(config.train.device)
        self.is_main = self.context.is_main_process
        world_size = self.context.world_size
        validate_run_config(config)
        if config.train.num_threads > 0:
            torch.set_num_threads(config.train.num_threads)

        # 1. Refuse before touching anything.
        if resume:
            if not (self.run_dir / "run.json").is_file():
                raise CheckpointError(f"--resume: {self.run_dir / 'run.json'} not found; nothing to resume "
                                      "(start without --resume)")
        else:
            if from_step is not None:
                raise ConfigError("--from-step needs --resume")
            check_run_dir_is_new(self.run_dir)

        # 2. Data: its identity and vocabulary decide the model's vocab_size when the recipe leaves it at 0.
        self.dataset = open_dataset(self.data_dir)
        config = self._resolve_vocab(config, self.dataset.vocab_size)
        dist_utils.check_same_run_on_all_ranks(self.context, config_to_dict(config), self.dataset.metadata_sha256)

        # 3. On resume the checkpoint's recipe is authoritative: a difference is either free, allowed, or refused.
        # torch.save for one process, torch.distributed.checkpoint (collective, per-rank RNG) for several; its
        # constructor is a barrier, so no rank is still checking the run folder when rank 0 starts writing.
        self.checkpointer = DistributedCheckpointer(self.run_dir, config.train.keep_checkpoints, self.context)
        self.resumed_from: int | None = None
        allowed_changes: list[dict[str, Any]] = []
        self.notes: list[str] = []
        saved_meta: dict[str, Any] | None = None
        if resume:
            steps = self.checkpointer.committed_steps()
            if not steps:
                raise CheckpointError(f"--resume: no committed checkpoint in {self.checkpointer.root}")
            chosen = from_step if from_step is not None else steps[-1]
            chosen = dist_utils.broadcast_object(self.context, chosen)
            if chosen not in steps:
                raise CheckpointError(f"--from-step {chosen}: no committed checkpoint at that step in "
                                      f"{self.checkpointer.root} (committed: {steps})")
            saved_meta = self.checkpointer.meta(chosen)
            self.resumed_from = chosen

        self.device = torch.device(self.context.device)
        seed_every_generator(config.train.seed)  # Python and NumPy too: their draws must match across sessions
        model = build_model(config.model)
        groups_preview = partition_table(build_optimizer(model, config.optim).param_groups)
        self.software = software_versions()
        self.hardware = hardware_info(self.device, world_size, config.train.precision)
        self.hardware["distributed"] = self.context.describe()
        if saved_meta is not None:
            current_meta = self._checkpoint_meta(config, groups_preview, counters=None)
            saved_meta, world_notes = dist_utils.reconcile_world_size(saved_meta, current_meta, list(allow_changes))
            self.notes.extend(world_notes)
            report = check_resume_compatibility(saved_meta, current_meta, list(allow_changes))
            allowed_changes = report.allowed_changes
            self.notes.extend(report.warnings)
            restored = config_from_dict(saved_meta["recipe"])
            restored_flat = config_to_dict(restored)
            for change in report.free_changes + report.allowed_changes:
                _set_dotted(restored_flat, change["key"], change["new"])
            effective = config_from_dict(restored_flat)
            validate_run_config(effective)
            if config_to_dict(effective) != config_to_dict(config):  # defensive: the check compares everything
                torch.manual_seed(effective.train.seed)
                model = build_model(effective.model)
            config = effective
        self.config = config
        check_data_fits_recipe(self.dataset, batch_size=config.train.batch_size, seq_len=config.train.seq_len,
                               world_size=world_size, evaluates=config.train.eval_every > 0,
                               vocab_size=config.model.vocab_size)  # before the run folder is written
        self.raw_model = model.to(self.device)
        if config.train.compile != "none":
            compile_blocks(self.raw_model, config.train.compile)
        # Wrap before building the optimizer: FSDP2's fully_shard replaces every parameter with a sharded
        # DTensor parameter, and an optimizer built earlier would hold the old, gradient-less tensors.
        self.model = dist_utils.wrap_model(self.raw_model, self.context, config.train.parallelism,
                                           config.train.precision)
        self.optimizer = build_optimizer(self.raw_model, config.optim)
        if config.optim.muon.distribute_newton_schulz and config.train.parallelism == "ddp":
            self.optimizer.distribute_orthogonalization(self.context.rank, self.context.world_size)
        self.partition = partition_table(self.optimizer.param_groups)
        t = config.train
        self.scaler = build_grad_scaler(t.precision, self.device.type, t.loss_scale_init, t.loss_scale_growth_interval)
        self.train_split = self.dataset.split("train")
        self.val_split = self.dataset.split("val")
        self.train_loader = BatchLoader(self.train_split, t.batch_size, t.seq_len, mode=t.data_mode,
                                        rank=self.context.rank, world_size=world_size)
        self._val_loader_args = (t.batch_size, t.seq_len)
        n_attn = len(self.raw_model.attention_layers())
        self.qk_counters = QKClipCounters(n_attn, config.model.n_heads)
        self.tokens_per_microbatch = t.batch_size * t.seq_len * world_size
        self.tokens_per_update = tokens_per_update(config, world_size)

        # Counters (the trainer state besides model, optimizer, scaler and RNG).
        self.step = 0
        self.tokens_seen = 0
        self.updates_attempted = 0
        self.updates_skipped = 0
        self.consecutive_skips = 0
        self.data_restarts = 0
        self.last_val_loss: float | None = None

        if self.resumed_from is not None:
            from pilotrun.train.rng import capture_rng_state

            state, _meta = load_training_state(
                self.checkpointer, self.resumed_from, self.model, self.raw_model, self.optimizer,
                {"scaler": self.scaler.state_dict(), "trainer": self.state_dict(), "rng": capture_rng_state()})
            self.scaler.load_state_dict(state["scaler"])
            self.load_state_dict(state["trainer"])
            self.notes.extend(restore_rng_state(state["rng"]))
        self.notes.extend(self.checkpointer.notes)
        self.last_checkpoint_step = self.resumed_from

        # Model facts for run.json.

        total, active = count_parameters(config.model)
        self.flops_per_token = float(flops_per_token(config.model, t.seq_len))  # training (fwd + bwd) FLOPs
        self.parameters = (int(total), int(active))
        peak = self.hardware.get("peak_flops_per_s")
        self.peak_flops_per_s = peak * world_size if peak else None

        # 4. The record: run.json (new or extended) and this session's metrics writer.
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        self.session_id = dist_utils.broadcast_object(self.context, f"{stamp}-{uuid.uuid4().hex[:8]}")
        if resume:
            self.record = RunRecord.load(self.run_dir, enabled=self.is_main)
            self.record.data["recipe"] = config_to_dict(config)  # the restored recipe, not the flags typed
            self.record.data["tokens_per_update"] = self.tokens_per_update
            self.record.data["model"] = self._model_section()
            self.record.data["optimizer"] = {"groups": self.partition}
        else:
            self.record = RunRecord.create(self.run_dir, run_id=f"run-{self.session_id}",
                                           tokens_per_update=self.tokens_per_update, model=self._model_section(),
                                           optimizer={"groups": self.partition}, recipe=config_to_dict(config),
                                           data=self._data_section(), enabled=self.is_main)
        self.record.record_allowed_changes(self.session_id, allowed_changes)
        self.record.add_session({
            "session_id": self.session_id, "start_step": self.step, "start_tokens_seen": self.tokens_seen,
            "resumed_from": self.resumed_from, "git": git_state(), "command": self.command,
            "hardware": self.hardware, "software": self.software,
            "started_at": datetime.datetime.now(datetime.UTC).isoformat(), "notes": list(self.notes),
        })
        self.record.save()
        self.metrics = MetricsLog(self.run_dir, self.session_id, enabled=self.is_main)
        self._stop_signal: int | None = None
        self._signal_count = 0

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The trainer's own state: counters, loader cursors, QK-Clip counters (model, optimizer, scaler and
        RNG travel beside it in the checkpoint)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "updates_attempted": self.updates_attempted,
                "updates_skipped": self.updates_skipped, "consecutive_skips": self.consecutive_skips,
                "data_restarts": self.data_restarts, "train_loader": self.train_loader.state_dict(),
                "qk_clip": self.qk_counters.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("step", "tokens_seen", "updates_attempted", "updates_skipped", "consecutive_skips",
                    "data_restarts"):
            setattr(self, key, int(state[key]))
        self.train_loader.load_state_dict(state["train_loader"])
        self.qk_counters.load_state_dict(state["qk_clip"])

    def counters(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "updates_attempted": self.updates_attempted,
                "updates_skipped": self.updates_skipped}

    # ------------------------------------------------------------------------------------------ record parts
    @staticmethod
    def _resolve_vocab(config: RunConfig, data_vocab: int) -> RunConfig:
        if config.model.vocab_size == 0:
            data = config_to_dict(config)
            data["model"]["vocab_size"] = int(data_vocab)
            return config_from_dict(data)
        if config.model.vocab_size < data_vocab:
            raise ConfigError(f"model.vocab_size ({config.model.vocab_size}) is smaller than the data's vocabulary "
                              f"({data_vocab}); set it to 0 to take the data's")
        return config

    def _data_section(self) -> dict[str, Any]:
        meta = self.dataset.metadata
        section: dict[str, Any] = {"dir": str(self.data_dir.resolve()), "metadata_sha256": self.dataset.metadata_sha256}
        for name, split in (("train", self.train_split), ("val", self.val_split)):
            # One manifest identifies both splits: its sha256 is each split's identity too.
            section[name] = {"metadata_sha256": self.dataset.metadata_sha256, "tokens": int(split.num_tokens),
                             "documents": int(split.documents)}
        section["tokenizer"] = meta.get("tokenizer")
        section["source"] = meta.get("source")
        section["vocab_size"] = self.dataset.vocab_size
        section["eos_id"] = self.dataset.eos_id
        return section

    def _model_section(self) -> dict[str, Any]:
        return {"parameters": self.parameters[0], "active_parameters": self.parameters[1],
                "flops_per_token": self.flops_per_token, "config": config_to_dict(self.config.model)}

    def _checkpoint_meta(self, config: RunConfig, partition: list[dict[str, Any]],
                         counters: dict[str, int] | None) -> dict[str, Any]:
        meta = {"recipe": config_to_dict(config),
                "data": {"metadata_sha256": self.dataset.metadata_sha256, "dir": str(self.data_dir.resolve())},
                "world_size": self.context.world_size, "software": self.software,
                "hardware": {k: self.hardware.get(k) for k in ("device", "device_name", "world_size")},
                "optimizer": {"partition": partition}}
        if counters is not None:
            meta["counters"] = counters
            meta["session_id"] = self.session_id
            meta["run_id"] = self.record.data.get("run_id")
            meta["tokens_per_update"] = self.tokens_per_update
        return meta

    # ------------------------------------------------------------------------------------------ signals
    def _handle_signal(self, signum: int, frame: Any) -> None:
        self._signal_count += 1
        if self._signal_count > 1:
            raise _SecondSignal(signum)
        self._stop_signal = signum

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, self._handle_signal)
        return previous

    # ------------------------------------------------------------------------------------------ pieces
    def _log(self, event: str, **fields: Any) -> None:
        self.metrics.log(event, **self.counters(), **fields)

    def evaluate(self) -> dict[str, Any]:
        """Mean CE over `eval_batches` batches from the start of val: eval mode (no counters or trackers move),
        no grad, the training precision. The same batches every time, so values are comparable."""

        t = self.config.train
        loader = BatchLoader(self.val_split, t.batch_size, t.seq_len, mode="successive", rank=self.context.rank,
                             world_size=self.context.world_size)
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
        path = None
        size = 0
        # Every rank takes part: with several ranks the checkpoint is written collectively (DCP: shards and
        # each rank's RNG) and committed by rank 0; with one process this is the plain torch.save.
        state = training_state(self.model, self.raw_model, self.optimizer, self.context)
        state.update({"scaler": self.scaler.state_dict(), "trainer": self.state_dict(), "rng": capture_rng_state()})
        meta = self._checkpoint_meta(self.config, self.partition, self.counters())
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

    def _run(self) -> TrainResult:
        cfg, t = self.config, self.config.train
        raw, optimizer, loader, context = self.raw_model, self.optimizer, self.train_loader, self.context
        tokens_per_microbatch, device, account = self.tokens_per_microbatch, self.device, self.account

        if self.is_main:
            for line in describe_plan(cfg, context.world_size, self.step):
                print(line, file=self.out, flush=True)
            for note in self.notes:
                print(f"note: {note}", file=self.out, flush=True)
        self._log("session_start", resumed_from=self.resumed_from, world_size=context.world_size,
                  tokens_per_update=self.tokens_per_update, max_steps=t.max_steps,
                  tokens_per_microbatch=tokens_per_microbatch, metrics_repaired_bytes=self.metrics.repaired_bytes)
        bar = None
        if self.progress and self.is_main:
            from tqdm import tqdm

            bar = tqdm(total=t.max_steps, initial=self.step, file=sys.stderr, unit="step", dynamic_ncols=True,
                       desc="train", mininterval=0.5)

        window = _Window(device)
        window_clock = WindowClock(account)
        reason, message, exit_code = "completed", f"reached max_steps={t.max_steps}", 0
        raw.train()
        reset_step_statistics(raw)
        try:
            account.switch("train")
            while self.step < t.max_steps:
                outcome, restarted, clip_events = self._train_one_update(window)
                # ---- bookkeeping outside the timed training region ---------------------------------------
                rare = restarted or not outcome.applied or clip_events
                if rare:
                    with account.phase("other"):
                        for _ in range(restarted):
                            self.data_restarts += 1
                            self._log("data_restart", epoch=int(loader.epoch), data_restarts=self.data_restarts)
                        if not outcome.applied:
                            self._log("overflow", reason=outcome.reason, loss_scale_before=outcome.loss_scale_before,
                                      loss_scale_after=outcome.loss_scale_after,
                                      consecutive_skips=self.consecutive_skips)
                        for fields in clip_events:  # logged after the update they follow: counters include it
                            self._log("qk_clip", **fields)
                stop = self._stop_signal is not None
                if context.is_distributed:
                    stop = dist_utils.any_across_ranks(context, stop)
                too_many_skips = self.consecutive_skips >= t.max_consecutive_skips
                done = self.step >= t.max_steps
                at_checkpoint = outcome.applied and t.checkpoint_every > 0 and self.step % t.checkpoint_every == 0
                at_eval = outcome.applied and t.eval_every > 0 and self.step % t.eval_every == 0
                close = (outcome.applied and self.step % t.log_every == 0) or stop or too_many_skips or done \
                    or at_checkpoint
                final = stop or too_many_skips or done
                if close:
                    # The last window leaves the training phase for good, so that the session's training
                    # seconds equal the sum of its windows' exactly.
                    with account.phase("other") if not final else _switch_for_good(account, "other"):
                        self._close_window(window, window_clock, raw, moe_diagnostics, attention_diagnostics,
                                           optimizer, bar)
                        window = _Window(device)
                reset_step_statistics(raw)
                if at_eval:
                    with account.phase("eval"):
                        result = self.evaluate()
                    with account.phase("other"):
                        self._log("val", **result)
                if at_checkpoint or (final and self.last_checkpoint_step != self.step):
                    with account.phase("checkpoint"):
                        self.save_checkpoint()
                if stop:
                    signum = self._stop_signal if self._stop_signal is not None else signal.SIGTERM
                    name = signal.Signals(signum).name
                    reason, exit_code = "interrupted", EXIT_CODES.get(signum, 143)
                    message = f"{name} received: finished the update, saved checkpoint step {self.step}"
                    break
                if too_many_skips:
                    reason, exit_code = "stopped", 1
                    message = (f"{self.consecutive_skips} consecutive skipped updates (train.max_consecutive_skips="
                               f"{t.max_consecutive_skips}); last reason: {outcome.reason}")
                    break
            else:
                if self.last_checkpoint_step != self.step:  # a resume at or past max_steps: nothing new to save
                    with account.phase("checkpoint"):
                        self.save_checkpoint()
        except _SecondSignal as exc:
            signum = int(exc.args[0])
            reason, exit_code = "interrupted", EXIT_CODES.get(signum, 143)
            message = f"second {signal.Signals(signum).name}: stopped at once, no checkpoint for step {self.step}"
        except BaseException as exc:
            account.switch("other")
            self._log("session_end", reason="error", message=f"{type(exc).__name__}: {exc}"[:2000],
                      time_split=account.time_split())
            if bar is not None:
                bar.close()
            raise
        account.switch("other")
        if bar is not None:
            bar.close()
        self._log("session_end", reason=reason, message=message, time_split=account.time_split(),
                  val_loss=self.last_val_loss)
        if self.is_main:
            split = account.time_split()
            print(f"session_end: {reason} at step {self.step:,} ({message}); train {split['train_seconds']:.1f} s, "
                  f"eval {split['eval_seconds']:.1f} s, checkpoint {split['checkpoint_seconds']:.1f} s, other "
                  f"{split['other_seconds']:.1f} s of {split['wall_seconds']:.1f} s wall", file=self.out, flush=True)
        return TrainResult(reason=reason, exit_code=exit_code, message=message, **self.counters())

    def _train_one_update(self, window: _Window) -> tuple[UpdateOutcome, int, list[dict[str, Any]]]:
        """Spec 2.5, one update: microbatches, agreed statistics, the update, and what follows only when applied.

        Returns the outcome, how many exhaustion restarts of the training split happened during it (0 nearly
        always) and the fields of its spec 3.4 `qk_clip` events (usually none); logging them is left to the
        caller, outside the timed training region."""
        cfg, t = self.config, self.config.train
        model, raw, optimizer, scaler, loader = self.model, self.raw_model, self.optimizer, self.scaler, self.train_loader
        accumulation = t.gradient_accumulation_steps
        qk_enabled, tau = cfg.optim.qk_clip.enabled, cfg.optim.qk_clip.tau
        set_learning_rates(optimizer, self.step, cfg.optim.schedule)
        # The update that should close a window also measures the update RMS per group (spec 5), once a window.
        optimizer.measure_update_rms = (self.step + 1) % t.log_every == 0 or self.step + 1 >= t.max_steps
        optimizer.zero_grad(set_to_none=True)
        restarted = 0  # exhaustion restarts of the training split during this update (0 nearly always)
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
            self.tokens_seen += self.tokens_per_microbatch
            window.microbatches += 1
        self.updates_attempted += 1
        window.attempted += 1
        tokens_per_expert, qk_max_logit = collect_step_statistics(raw)
        tokens_per_expert, qk_max_logit = dist_utils.all_reduce_step_statistics(
            self.context, tokens_per_expert, qk_max_logit)
        outcome = apply_update(model, optimizer, scaler, cfg.optim.grad_clip)
        clip_events: list[dict[str, Any]] = []
        if outcome.applied:
            if qk_enabled:
                clip = apply_qk_clip(raw, qk_max_logit, tau)
                if clip.n_heads_clipped or clip.skipped_nonfinite_layers:  # rare: only then any work
                    first_clipped = self.qk_counters.update(clip)
                    window.first_clipped += first_clipped
                    window.heads_clipped += int(clip.n_heads_clipped)
                    window.min_gamma = min(window.min_gamma, float(clip.min_gamma))
                    clip_events = qk_clip_events(clip, qk_max_logit, first_clipped)
            if optimizer.measure_update_rms:
                window.update_rms, window.update_rms_step = optimizer.last_update_rms, self.step + 1
            update_expert_bias(raw, tokens_per_expert,
                               expert_bias_speed(self.step, cfg.model.bias_update_speed, cfg.optim.schedule))
            self.step += 1
            self.consecutive_skips = 0
            window.applied += 1
            window.clipped += int(outcome.clipped)
            window.grad_norm = outcome.grad_norm
            window.grad_norm_max = max(window.grad_norm_max, outcome.grad_norm)
        else:
            self.updates_skipped += 1
            self.consecutive_skips += 1
            window.skipped += 1
        window.loss_scale = outcome.loss_scale_after
        window.add_statistics(tokens_per_expert, qk_max_logit)
        return outcome, restarted, clip_events

    def _close_window(self, window: _Window, window_clock: WindowClock, raw: torch.nn.Module, moe_diagnostics,
                      attention_diagnostics, optimizer: torch.optim.Optimizer, bar) -> None:
        train_seconds, wall_seconds = window_clock.close_window()
        if window.attempted == 0:
            return
        tokens = window.microbatches * self.tokens_per_microbatch
        local = {"loss": _float(window.ce_sum) / window.microbatches, "aux": _float(window.aux_sum) / window.microbatches}
        means = dist_utils.mean_across_ranks(self.context, local)
        moe = moe_diagnostics(raw, window.tokens_per_expert) if window.tokens_per_expert is not None else {}
        if moe and window.applied:  # gamma at the window's last applied update (0 once the bias is frozen)
            moe["bias_update_speed"] = expert_bias_speed(self.step - 1, self.config.model.bias_update_speed,
                                                         self.config.optim.schedule)
        attention = attention_diagnostics(window.qk_max_logit) if window.qk_max_logit is not None else {}
        figures = throughput(tokens, train_seconds, wall_seconds, self.flops_per_token, self.peak_flops_per_s)
        group = optimizer.param_groups[0]
        self._log(
            "train",
            window={"updates_applied": window.applied, "updates_attempted": window.attempted,
                    "updates_skipped": window.skipped, "clipped": window.clipped,
                    "microbatches": window.microbatches, "tokens": tokens, "train_seconds": train_seconds,
                    "wall_seconds": wall_seconds},
            loss=means["loss"], aux_loss=means["aux"], lr=float(group["lr"]),
            lr_multiplier=float(group["lr"]) / float(group["base_lr"]) if group.get("base_lr") else None,
            grad_norm=window.grad_norm, grad_norm_max=window.grad_norm_max if window.applied else None,
            loss_scale=window.loss_scale, epoch=int(self.train_loader.epoch), data_restarts=self.data_restarts,
            throughput=figures, moe=moe,
            qk_clip={"max_logit": attention.get("max_logit"), "max_logit_per_head": attention.get("max_logit_per_head"),
                     "heads_clipped": window.heads_clipped, "min_gamma": window.min_gamma,
                     "first_clipped": window.first_clipped, "updates_with_clip": self.qk_counters.updates_with_clip,
                     "cumulative_interventions": self.qk_counters.total_interventions(),
                     "nonfinite_layer_skips": self.qk_counters.nonfinite_layer_skips},
            memory=memory_snapshot(self.device),
            activations={"block_output_rms": block_output_rms(raw)},
            optimizer={"weight_rms": parameter_rms(optimizer), "update_rms": window.update_rms,
                       "update_rms_step": window.update_rms_step},
        )
        if bar is not None:
            bar.update(self.step - bar.n)
            tps = figures["train_tokens_per_s"]
            bar.set_postfix_str(f"loss={means['loss']:.4f} train_tok/s={tps:,.0f}" if tps else
                                f"loss={means['loss']:.4f}", refresh=True)


@contextlib.contextmanager
def _switch_for_good(account: TimeAccount, phase: str):
    account.switch(phase)
    yield


def compile_blocks(model: torch.nn.Module, backend: str) -> None:
    """torch.compile every decoder block in place (nn.Module.compile), as torchtitan does: one small graph
    compiled once and reused by every layer of the same shape, where compiling the whole model would trace it
    as one graph; parameter names, the state dict, DDP/FSDP wrapping and activation checkpointing stay as
    they are. Dynamo state is reset first so that an earlier model's graphs are not reused by mistake."""
    import torch._dynamo

    torch._dynamo.reset()
    for block in model.layers:
        block.compile(backend=backend)


class _Window:
    """Accumulators for one logging window; tensors stay on the device until the window closes."""

    def __init__(self, device: torch.device):
        self.ce_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.aux_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.microbatches = 0
        self.attempted = 0
        self.applied = 0
        self.skipped = 0
        self.clipped = 0
        self.heads_clipped = 0
        self.min_gamma = 1.0
        self.first_clipped: list[tuple[int, int]] = []  # (layer, head) pairs clipped for the first time in the run
        self.grad_norm: float | None = None
        self.grad_norm_max = -math.inf
        self.loss_scale = 1.0
        self.tokens_per_expert: torch.Tensor | None = None
        self.qk_max_logit: torch.Tensor | None = None
        self.update_rms: dict[str, float] | None = None  # per group, from the update numbered update_rms_step
        self.update_rms_step: int | None = None

    def add_statistics(self, tokens_per_expert: torch.Tensor, qk_max_logit: torch.Tensor) -> None:
        if self.tokens_per_expert is None:
            self.tokens_per_expert = tokens_per_expert.clone()
            self.qk_max_logit = qk_max_logit.clone()
        else:
            self.tokens_per_expert += tokens_per_expert
            torch.maximum(self.qk_max_logit, qk_max_logit, out=self.qk_max_logit)


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if parts[0] == "recipe":
        parts = parts[1:]
    node = data
    for part in parts[:-1]:
        if part not in node or not isinstance(node[part], dict):
            return  # not a recipe key (world size, data identity, partition): nothing to set in the recipe
        node = node[part]
    if parts[-1] in node:
        node[parts[-1]] = value


def train_from_cli(config: RunConfig, data_dir: str, run_dir: str, resume: bool, from_step: int | None,
                   allow_changes: list[str], command: list[str]) -> int:
    """`pilotrun train`: build, run, return the exit code (bad input raises PilotrunError -> exit 2)."""
    context = dist_utils.init_distributed(config.train.device)
    trainer = None
    try:
        trainer = Trainer(config, data_dir, run_dir, resume=resume, from_step=from_step,
                          allow_changes=allow_changes, command=command, context=context)
        return trainer.run().exit_code
    finally:
        # The DDP/FSDP wrapper (DDP's reducer) uses the process group: free it, reference cycles included, before
        # the group is destroyed rather than after, when the function's frame goes. A 2-rank gloo run once hung
        # there after its session_end, in rank 1's teardown (a CI run of this session; see issue 3's note).
        del trainer
        gc.collect()
        dist_utils.shutdown_distributed(context)
