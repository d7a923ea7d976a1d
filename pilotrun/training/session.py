"""Building one training session, fresh or resumed: everything the loop needs, in the order that keeps it
exact.

`build_session` refuses bad input before touching anything, opens the data, plans the resume
(checkpoint/resume_plan.py decides; this module only executes the plan), builds the model under the run's
seed, wraps it (DDP / FSDP2), builds the optimizer, scaler and loaders, restores a checkpoint, and opens the
run record: run.json (new, or extended by one session) and this session's metrics writer. The loop (loop.py)
then only trains.

The order matters for exact continuation: every generator is seeded before the model is built (so a fresh
model's weights are the same in every session that builds one), and the restored RNG state replaces whatever
building consumed.
"""

from __future__ import annotations

import datetime
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pilotrun.common.errors import CheckpointError, ConfigError, PilotrunError
from pilotrun.config import RunConfig, config_from_dict, config_to_dict, renames, validate_run_config
from pilotrun.data.mixed_reader import MixedDataset, MixedLoader, all_splits, check_fits_recipe, open_data
from pilotrun.data.reader import BatchLoader, TokenDataset
from pilotrun.model.accounting import count_parameters, flops_per_token
from pilotrun.model.transformer import build_model, compile_blocks_and_output
from pilotrun.optim.muon_adamw import build_optimizer
from pilotrun.optim.partition import partition_parameters, partition_table
from pilotrun.optim.update_hooks import UpdateHook, build_update_hooks
from pilotrun.run.folder_lock import LOCK_NAME, RunFolderBusy, RunFolderLock
from pilotrun.run.marker import MARKER_NAME, resume_problem, step_folder_name
from pilotrun.run.record import (
    CHECKPOINTS_DIR,
    COUNTER_KEYS,
    HANGS_DIR,
    METRICS_JSONL,
    RUN_JSON,
    Counters,
    read_metrics_tolerant,
    read_run_json,
)
from pilotrun.run.writer import MetricsWriter, RunRecord
from pilotrun.training import distributed as dist_utils
from pilotrun.training.checkpoint.dcp_storage import (
    DCPStorage,
    check_parts,
    load_model_and_optimizer_state,
    model_and_optimizer_state,
)
from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer
from pilotrun.training.checkpoint.resume_plan import ResumePlan, checkpoint_meta, plan_session
from pilotrun.training.checkpoint.rng_state import capture_rng_state, restore_rng_state, seed_every_generator
from pilotrun.training.environment import default_threads, git_state, hardware_info, software_versions
from pilotrun.training.notices import restored_state_line, startup_warnings
from pilotrun.training.precision import build_grad_scaler, restore_grad_scaler
from pilotrun.training.preflight import PreflightError, check_run_folder, checkpoint_bytes_estimate, disk_plan
from pilotrun.training.spikes.detector import SpikeDetector, skip_data_section
from pilotrun.training.thread_choice import choose_threads, recorded_threads


def local_ranks() -> int:
    """The ranks sharing this machine (torchrun's LOCAL_WORLD_SIZE; 1 outside torchrun)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def mixture_of(dataset: TokenDataset | MixedDataset) -> dict[str, Any] | None:
    """A mixture's weights and seed (what a resume compares as data.mixture.*); None for one folder."""
    return dataset.mixture_section() if isinstance(dataset, MixedDataset) else None


def tokens_per_update(config: RunConfig, world_size: int) -> int:
    t = config.train
    return t.batch_size * t.seq_len * t.gradient_accumulation_steps * world_size


class NothingToDo(PilotrunError):
    """`--resume auto` of a run whose newest verified checkpoint is at (or past) max_steps: the run is
    complete, the command exits 0 and writes nothing, so a scheduler that reruns it blindly learns it is
    done."""

    exit_code = 0


def holds_no_run(run_dir: Path) -> bool:
    """`--resume auto`: the folder holds no run yet. Besides a new or empty folder, one left by a first start
    killed during its set-up (before run.json: the lock file, and the checkpoints/ folder the pre-flight check
    creates, with nothing committed in it, and the stacks of a start that hung) holds none either, so a rerun
    of the same command starts the run."""
    if (run_dir / RUN_JSON).is_file():
        return False
    if not run_dir.exists():
        return True
    if not run_dir.is_dir() or any(
        p.name not in (LOCK_NAME, CHECKPOINTS_DIR, HANGS_DIR) for p in run_dir.iterdir()
    ):
        return False
    checkpoints = run_dir / CHECKPOINTS_DIR
    return not checkpoints.exists() or (checkpoints.is_dir() and not checkpoints.is_symlink()
                                         and not any(checkpoints.glob(f"*/{MARKER_NAME}")))


def check_run_dir_is_new(run_dir: Path, auto: bool = False) -> None:
    """A fresh run needs a new or empty folder; the lock file a refused earlier attempt left does not count
    (nor, under `--resume auto`, what a start killed in its set-up left: `holds_no_run`)."""
    if auto and holds_no_run(run_dir):
        return
    if run_dir.exists() and (not run_dir.is_dir() or any(p.name != LOCK_NAME for p in run_dir.iterdir())):
        names = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
        if run_dir.is_dir() and not {RUN_JSON, METRICS_JSONL, CHECKPOINTS_DIR} & set(names):
            # A user's folder, a data folder, `/`: never a suggestion to delete it.
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise ConfigError(
                f"--run-dir {run_dir} is not a run folder (it holds {shown}, and no {RUN_JSON}): "
                "a new run starts only in a new or empty folder and a run folder is never made of "
                "another; choose a new --run-dir"
            )
        raise ConfigError(
            f"run folder {run_dir} already exists: pass --resume to continue it (from its newest "
            "committed checkpoint, or from step 0 when it has none), choose a new --run-dir, or delete "
            "the folder to start this run over"
        )


def resolve_vocab(config: RunConfig, data_vocab: int) -> RunConfig:
    """model.vocab_size 0 takes the data's vocabulary; a smaller one than the data's is refused."""
    if config.model.vocab_size == 0:
        data = config_to_dict(config)
        data["model"]["vocab_size"] = int(data_vocab)
        return config_from_dict(data)
    if config.model.vocab_size < data_vocab:
        raise ConfigError(
            f"model.vocab_size ({config.model.vocab_size}) is smaller than the data's vocabulary "
            f"({data_vocab}); set it to 0 to take the data's"
        )
    return config


@dataclass
class TrainingState:
    """The trainer's own state besides model, optimizer, scaler and RNG: the counters, the loader's cursor
    and what each update hook keeps. Counters are global (all ranks together)."""

    loader: BatchLoader | MixedLoader
    hooks: list[UpdateHook]
    step: int = 0
    tokens_seen: int = 0
    updates_attempted: int = 0
    updates_skipped: int = 0
    consecutive_skips: int = 0
    data_restarts: int = 0
    # a mixture's tokens_seen per source (they add up to tokens_seen)
    tokens_by_source: list[int] | None = None

    def count_sources(self) -> None:
        """Add the batch the loader just served to the per-source tokens (a mixture's; a folder has none)."""
        if self.tokens_by_source is not None:
            seq_len = self.loader.seq_len
            self.tokens_by_source = [t + rows * seq_len for t, rows in
                                     zip(self.tokens_by_source, self.loader.last_batch_rows, strict=True)]

    def counters(self) -> Counters:
        return Counters(self.step, self.tokens_seen, self.updates_attempted, self.updates_skipped)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            **self.counters().as_dict(),
            "consecutive_skips": self.consecutive_skips,
            "data_restarts": self.data_restarts,
            "train_loader": self.loader.state_dict(),
        }
        if self.tokens_by_source is not None:
            state["tokens_by_source"] = list(self.tokens_by_source)
        for hook in self.hooks:
            hook_state = hook.state_dict()
            if hook_state is not None:
                state[hook.name] = hook_state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in (*COUNTER_KEYS, "consecutive_skips", "data_restarts"):
            setattr(self, key, int(state[key]))
        self.loader.load_state_dict(state["train_loader"])
        if self.tokens_by_source is not None:
            self.tokens_by_source = [int(t) for t in state["tokens_by_source"]]
        for hook in self.hooks:
            if hook.state_dict() is not None and (
                hook.name in state or not getattr(hook, "state_optional", False)
            ):
                hook.load_state_dict(state[hook.name])


@dataclass
class Session:
    """Everything one session trains with and writes to."""

    config: RunConfig
    context: dist_utils.DistributedContext
    device: torch.device
    run_dir: Path
    data_dir: Path
    dataset: TokenDataset | MixedDataset
    checkpointer: DistributedCheckpointer
    plan: ResumePlan
    raw_model: torch.nn.Module
    model: torch.nn.Module  # raw_model, or its DDP / FSDP2 wrapper
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    partition: list[dict[str, Any]]
    state: TrainingState
    software: dict[str, Any]
    hardware: dict[str, Any]
    parameters: tuple[int, int]  # total, active per token
    flops_per_token: float  # training (forward + backward) FLOPs
    peak_flops_per_s: float | None  # all ranks together; None when the device's peak is unknown
    tokens_per_microbatch: int
    tokens_per_update: int
    session_id: str = ""
    record: RunRecord | None = None
    metrics: MetricsWriter | None = None
    notes: list[str] = field(default_factory=list)
    lock: RunFolderLock | None = None  # held by rank 0 until the session ends
    restart: dict[str, Any] | None = None  # a --resume with nothing to restore: the earlier work it loses
    started_run: bool = False  # this session created run.json (a fresh start, `--resume auto` included)

    def release_lock(self) -> None:
        if self.lock is not None:
            self.lock.release()

    @property
    def resumed_from(self) -> int | None:
        return self.plan.checkpoint_step

    def checkpoint_meta(self, config: RunConfig, partition: list[dict[str, Any]],
                        counters: Counters | None = None) -> dict[str, Any]:
        progress = None
        if counters is not None:
            progress = {"counters": counters.as_dict(), "session_id": self.session_id,
                        "run_id": self.record.data.get("run_id") if self.record else None,
                        "tokens_per_update": self.tokens_per_update,
                        # where the data stood: a model_state rollback places its checkpoints by it
                        # (training/spikes/restore_point.py) without loading their tensors
                        "batch_index": int(self.state.loader.batch_index)}
        return checkpoint_meta(
            config,
            data_sha256=self.dataset.metadata_sha256,
            data_dir=str(self.data_dir.resolve()),
            world_size=self.context.world_size,
            software=self.software,
            hardware=self.hardware,
            partition=partition,
            progress=progress,
            mixture=mixture_of(self.dataset),
        )

    def data_section(self) -> dict[str, Any]:
        meta = self.dataset.metadata
        section: dict[str, Any] = {
            "dir": str(self.data_dir.resolve()),
            "metadata_sha256": self.dataset.metadata_sha256,
        }
        for name in ("train", "val"):
            splits = all_splits(self.dataset, name)
            # One manifest identifies both splits: its sha256 is each split's identity too (a mixture's: its
            # sources' identity, with the tokens and documents of all its sources).
            section[name] = {"metadata_sha256": self.dataset.metadata_sha256,
                             "tokens": sum(int(split.num_tokens) for split in splits),
                             "documents": sum(int(split.documents) for split in splits)}
        section["tokenizer"] = meta.get("tokenizer")
        section["source"] = meta.get("source") if not isinstance(self.dataset, MixedDataset) else None
        section["vocab_size"] = self.dataset.vocab_size
        section["eos_id"] = self.dataset.eos_id
        if isinstance(self.dataset, MixedDataset):
            section["sources"] = self.dataset.sources_section()
            section["mixture"] = self.dataset.mixture_section()
        return section

    def model_section(self) -> dict[str, Any]:
        return {"parameters": self.parameters[0], "active_parameters": self.parameters[1],
                "flops_per_token": self.flops_per_token, "config": config_to_dict(self.config.model)}


def build_session(config: RunConfig, data_dir: str | Path, run_dir: str | Path, *, resume: bool | str,
                  from_step: int | None, allow_changes: list[str] | tuple[str, ...], command: list[str],
                  context: dist_utils.DistributedContext) -> Session:
    """`resume`: False (a new run), True (`--resume`) or "auto" (`--resume auto`: start the run where the
    folder holds none, else resume from the newest checkpoint that verifies, or say there is nothing to
    do)."""
    run_dir, data_dir = Path(run_dir), Path(data_dir)
    validate_run_config(config)
    torch.set_num_threads(config.train.num_threads or default_threads(local_ranks()))

    # 1. Refuse before touching anything. Rank 0 decides what `auto` means here, so that every rank agrees.
    auto = resume == "auto"
    if auto:
        resume = not dist_utils.broadcast_object(
            context, holds_no_run(run_dir) if context.is_main_process else None
        )
    if resume and (problem := resume_problem(run_dir)):
        raise CheckpointError(problem)
    if not resume:
        if from_step is not None:
            raise ConfigError("--from-step needs --resume")
        if not (run_dir / LOCK_NAME).is_file():  # a run folder's lock names a session still running, below
            check_run_dir_is_new(run_dir, auto)

    # One writer per run folder, from here until the session ends (pilotrun/run/folder_lock.py); checked again
    # under the lock, since another fresh session may have started writing between the check above and the
    # lock.
    lock = take_run_lock(run_dir, context)
    try:
        if not resume:
            check_run_dir_is_new(run_dir, auto)
        session = _build_locked_session(
            config,
            data_dir,
            run_dir,
            resume=resume,
            from_step=from_step,
            allow_changes=allow_changes,
            command=command,
            context=context,
            auto=auto,
        )
    except BaseException:
        if lock is not None:
            lock.release(refused=True)  # a refused session leaves nothing behind, not even a holder line
        raise
    session.lock = lock
    if lock is not None and lock.note:
        session.notes.append(lock.note)
    return session


def take_run_lock(run_dir: Path, context: dist_utils.DistributedContext) -> RunFolderLock | None:
    """Rank 0 takes the run folder's lock; every rank learns whether it did and refuses alike."""
    lock, refusal = None, None
    if context.is_main_process:
        try:
            lock = RunFolderLock.acquire(run_dir)
        except PilotrunError as exc:
            refusal = str(exc)
    refusal = dist_utils.broadcast_object(context, refusal)
    if refusal is not None:
        raise RunFolderBusy(refusal)
    return lock


def _open_session_data(config: RunConfig, data_dir: Path, context: dist_utils.DistributedContext
                       ) -> tuple[TokenDataset | MixedDataset, Path, RunConfig]:
    """Step 2, the data: its identity and vocabulary decide the model's vocab_size when the recipe leaves it
    at 0, and every rank must read and mix alike."""
    dataset = open_data(data_dir)
    data_dir = Path(dataset.data_dir)  # a mixture file of one folder names that folder
    config = resolve_vocab(config, dataset.vocab_size)
    mixture = mixture_of(dataset)  # every rank must mix alike too, not only read the same sources
    dist_utils.check_same_run_on_all_ranks(context, config_to_dict(config), dataset.metadata_sha256 +
                                           (f" {mixture}" if mixture else ""))
    return dataset, data_dir, config


def _checkpointer_and_model(config: RunConfig, dataset: TokenDataset | MixedDataset, run_dir: Path,
                            context: dist_utils.DistributedContext) -> tuple[DistributedCheckpointer, Any]:
    """The checkpoint storage the recipe names (auto: torch.save for one process,
    torch.distributed.checkpoint, collective with per-rank RNG, for several); the checkpointer's constructor
    is a barrier, so no rank is still checking the run folder when rank 0 starts writing. The model is built
    first (seeded: Python and NumPy too, since their draws must match across sessions) because the partition
    it implies is part of what a resume compares."""
    kept = config.train.checkpoint
    checkpointer = DistributedCheckpointer(run_dir, kept.keep, context, keep_every=kept.keep_every,
                                           keep_steps=kept.keep_steps, storage=kept.storage)
    seed_every_generator(config.train.seed)
    model = build_model(config.model)
    # before timing thread counts on this recipe's update
    check_fits_recipe(dataset, config, context.world_size)
    return checkpointer, model


def _machine_sections(config: RunConfig, device: torch.device, context: dist_utils.DistributedContext,
                      recorded: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The session's thread count (set on torch here), and the software and hardware sections a resume
    compares; returns the thread choice's note with them."""
    threads = choose_threads(
        config,
        local_ranks=local_ranks(),
        world_size=context.world_size,
        device_type=device.type,
        # before the hardware section a resume compares
        recorded=recorded_threads(recorded),
    )
    torch.set_num_threads(threads.threads)
    software = software_versions()
    hardware = hardware_info(device, context.world_size, config.train.precision)
    hardware.update(torch_threads=threads.threads, threads=threads.record(), distributed=context.describe())
    return threads.describe(), software, hardware


def _check_plan_and_rebuild(plan: ResumePlan, config: RunConfig, model: Any,
                            dataset: TokenDataset | MixedDataset, checkpointer: DistributedCheckpointer,
                            run_dir: Path,
                            context: dist_utils.DistributedContext, *, auto: bool, run_id: Any) -> Any:
    """After the plan: a resumed checkpoint must stay removable later, `auto` on a complete run has nothing to
    do, and an allowed change to the recipe rebuilds the model under it; returns the model to train."""
    if plan.resuming and context.is_main_process:
        checkpointer.check_later_removable(plan.checkpoint_step)  # before any update is trained
    if auto and plan.resuming and plan.checkpoint_step >= plan.config.train.max_steps:
        raise NothingToDo(f"nothing to do: run {run_id} is complete (checkpoint step {plan.checkpoint_step} "
                          f"reached train.max_steps={plan.config.train.max_steps}) in {run_dir}")
    if config_to_dict(plan.config) != config_to_dict(config):  # defensive: the check compares every key
        torch.manual_seed(plan.config.train.seed)
        model = build_model(plan.config.model)
        # an allowed change, before the run folder is written
        check_fits_recipe(dataset, plan.config, context.world_size)
    return model


def _batch_loader(dataset: TokenDataset | MixedDataset, config: RunConfig,
                  context: dist_utils.DistributedContext) -> BatchLoader | MixedLoader:
    """This rank's share of the training batches: a mixture's loader, or one folder's train split."""
    t = config.train
    if isinstance(dataset, MixedDataset):
        return MixedLoader(dataset, t.batch_size, t.seq_len, mode=t.data_mode,
                           rank=context.rank, world_size=context.world_size)
    return BatchLoader(
        dataset.split("train"),
        t.batch_size,
        t.seq_len,
        mode=t.data_mode,
        rank=context.rank,
        world_size=context.world_size,
    )


def _wrap_and_build_optimizer(model: Any, config: RunConfig, device: torch.device,
                              context: dist_utils.DistributedContext) -> tuple[Any, Any, Any, Any]:
    """Step 4's model, wrapper, optimizer and scaler. Wrap before building the optimizer: FSDP2's fully_shard
    replaces every parameter with a sharded DTensor parameter, and an optimizer built earlier would hold the
    old, gradient-less tensors. Returns (raw model, wrapped model, optimizer, scaler)."""
    raw_model = model.to(device)
    t = config.train
    if t.compile != "none":
        compile_blocks_and_output(raw_model, t.compile)
    wrapped = dist_utils.wrap_model(raw_model, context, t.parallelism, t.precision)
    optimizer = build_optimizer(raw_model, config.optim)
    if config.optim.muon.distribute_newton_schulz and t.parallelism == "ddp":
        optimizer.distribute_orthogonalization(context.rank, context.world_size)
    scaler = build_grad_scaler(t.precision, device.type, t.loss_scale_init, t.loss_scale_growth_interval)
    return raw_model, wrapped, optimizer, scaler


def _restore_checkpoint(session: Session) -> None:
    """Step 5, on resume: weights, optimizer, scaler, counters, cursor, hook state and every RNG."""
    optimizer, scaler, step = session.optimizer, session.scaler, session.plan.checkpoint_step
    settings = group_settings(optimizer)  # the effective recipe's, allowed changes included
    restored = read_checkpoint(session, step)
    restore_group_settings(optimizer, settings)
    if not restore_grad_scaler(scaler, restored["scaler"]):
        session.notes.append(f"loss scale: the checkpoint was written without fp16; starting at "
                             f"train.loss_scale_init ({scaler.get_scale():g})")
    session.state.load_state_dict(restored["trainer"])
    rng_notes = restore_rng_state(restored["rng"])
    session.notes.extend(rng_notes)
    session.notes.append(restored_state_line(session.checkpointer.root / step_folder_name(step),
                                             restored["trainer"], rng_notes, restored["scaler"]))


def _refuse_an_unwritable_run_folder(session: Session) -> None:
    """Before run.json and the first update: a folder that cannot take a checkpoint is refused now, not after
    train.checkpoint.every updates of work that could not be saved. Rank 0 checks; every rank refuses
    alike."""
    refusal = None
    if session.context.is_main_process:
        try:
            check_run_folder(session.run_dir, checkpoint_bytes_estimate(session.optimizer))
            session.notes.extend(disk_notes(session.checkpointer, session.config, session.optimizer))
        except PilotrunError as exc:
            refusal = str(exc)
    refusal = dist_utils.broadcast_object(session.context, refusal)
    if refusal is not None:
        raise PreflightError(refusal)


def _build_locked_session(
    config: RunConfig,
    data_dir: Path,
    run_dir: Path,
    *,
    resume: bool,
    from_step: int | None,
    allow_changes: list[str] | tuple[str, ...],
    command: list[str],
    context: dist_utils.DistributedContext,
    auto: bool = False,
) -> Session:
    world_size = context.world_size
    # 2. Data.
    dataset, data_dir, config = _open_session_data(config, data_dir, context)
    recorded = read_run_json(run_dir) if resume else {}

    # 3. The plan, from the checkpoints, the model's partition and this machine.
    checkpointer, model = _checkpointer_and_model(config, dataset, run_dir, context)
    device = torch.device(context.device)
    threads_note, software, hardware = _machine_sections(config, device, context, recorded)

    def meta_of_this_run() -> dict[str, Any]:
        return checkpoint_meta(config, data_sha256=dataset.metadata_sha256, data_dir=str(data_dir.resolve()),
                               world_size=world_size, software=software, hardware=hardware,
                               partition=partition_table(partition_parameters(model, config.optim)),
                               mixture=mixture_of(dataset))

    run_id = recorded.get("run_id")
    plan = plan_session(
        config,
        resume=resume,
        from_step=from_step,
        committed_steps=checkpointer.committed_steps,
        read_meta=checkpointer.meta,
        current_meta=meta_of_this_run,
        allow_changes=allow_changes,
        root=str(checkpointer.root),
        agree=lambda step: dist_utils.broadcast_object(context, step),
        run_id=run_id if isinstance(run_id, str) else None,
        recorded=recorded,
        verify=checkpointer.verify if auto else None,
    )
    model = _check_plan_and_rebuild(plan, config, model, dataset, checkpointer, run_dir, context,
                                    auto=auto, run_id=run_id)
    config = plan.config

    # 4. Model, wrapper, optimizer, scaler, loader.
    raw_model, wrapped, optimizer, scaler = _wrap_and_build_optimizer(model, config, device, context)
    t = config.train
    state = TrainingState(
        loader=_batch_loader(dataset, config, context),
        hooks=[*build_update_hooks(raw_model, config),
               SpikeDetector(t.spike, tokens_per_update(config, world_size))],
        tokens_by_source=[0] * len(dataset.names) if isinstance(dataset, MixedDataset) else None,
    )
    total, active = count_parameters(config.model)
    peak = hardware.get("peak_flops_per_s")
    session = Session(
        config=config, context=context, device=device, run_dir=run_dir, data_dir=data_dir, dataset=dataset,
        checkpointer=checkpointer, plan=plan, raw_model=raw_model, model=wrapped, optimizer=optimizer,
        scaler=scaler, partition=partition_table(optimizer.param_groups), state=state, software=software,
        hardware=hardware, parameters=(int(total), int(active)),
        flops_per_token=float(flops_per_token(config.model, t.seq_len)),
        peak_flops_per_s=peak * world_size if peak else None,
        tokens_per_microbatch=t.batch_size * t.seq_len * world_size,
        tokens_per_update=tokens_per_update(config, world_size), notes=[threads_note, *plan.notes])

    # 5. Restore, then the notes and the run folder's check before anything is written.
    if plan.resuming:
        _restore_checkpoint(session)
    session.notes.extend(checkpointer.notes)
    val_tokens = min(split.num_tokens for split in all_splits(session.dataset, "val"))
    session.notes.extend(startup_warnings(config, val_tokens, world_size))
    _refuse_an_unwritable_run_folder(session)
    open_record(session, resume=resume, command=command)
    return session


def disk_notes(checkpointer: DistributedCheckpointer, config: RunConfig, optimizer: torch.optim.Optimizer
               ) -> list[str]:
    """The disk plan at the start (preflight.disk_plan): the newest checkpoint's measured bytes, else the
    estimate from the model and the optimizer."""
    committed = checkpointer.committed()
    files = committed[-1].marker.get("files", {}) if committed else {}
    measured = sum(
        e["bytes"] for e in files.values() if isinstance(e, dict) and isinstance(e.get("bytes"), int)
    )
    source = (f"measured: step {committed[-1].step}" if measured else
              "estimated from the model and the optimizer before the first save")
    line, warning = disk_plan(
        checkpointer, config.train, measured or checkpoint_bytes_estimate(optimizer), source
    )
    return [line] + ([f"warning: {warning}"] if warning else [])


def checkpoint_state(session: Session, *, sharded: bool) -> dict[str, Any]:
    """What a checkpoint holds, defined once for the save (these are the values written) and for the load (the
    same structure is the template the storage reads into): the model and the optimizer (plain state dicts for
    one process, the torch.save format; name-keyed DCP state dicts, DTensor shards under FSDP2, when
    `sharded`), the loss scaler, the trainer state (counters, loader cursor, update hooks' state) and every
    RNG."""
    if sharded:
        model_state, optimizer_state = model_and_optimizer_state(session.model, session.optimizer)
    else:
        model_state, optimizer_state = session.raw_model.state_dict(), session.optimizer.state_dict()
    return {"model": model_state, "optimizer": optimizer_state, "scaler": session.scaler.state_dict(),
            "trainer": session.state.state_dict(), "rng": capture_rng_state()}


def read_checkpoint(session: Session, step: int) -> dict[str, Any]:
    """Read the checkpoint at `step` in the format its storage wrote and put the model and optimizer state in
    place; returns the whole state for the rest (scaler, trainer state, RNG), which the caller restores."""
    checkpointer = session.checkpointer
    sharded = checkpointer.storage_name(step) == DCPStorage.name
    if not sharded and dist_utils.is_fully_sharded(session.model):
        raise CheckpointError(f"checkpoint step {step} was written by one process (torch.save); it cannot be "
                              "loaded into an FSDP2-sharded model: resume it with train.parallelism=ddp")
    template = checkpoint_state(session, sharded=sharded)
    # DCP loads in place into the template (tensors keep their device, dtype and sharding); torch.save files
    # are read whole and then loaded into the model and the optimizer.
    state, _meta = checkpointer.load(step, template if sharded else None)
    check_parts(state, list(template), step)
    if sharded:
        load_model_and_optimizer_state(session.model, session.optimizer, state["model"], state["optimizer"])
    else:
        session.raw_model.load_state_dict(state["model"])
        session.optimizer.load_state_dict(state["optimizer"])
    return state


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's settings (base LR, weight decay, momentum, betas, ...) without its tensors."""
    return [
        {key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups
    ]


def restore_group_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    """Put back settings taken by `group_settings` from the optimizer the recipe built.

    `Optimizer.load_state_dict` restores every param group's saved settings over those the optimizer was
    just built with, which would silently undo an allowed change (`--allow-change optim.muon.lr`): run.json
    would record the new value while training used the old one. The partition is the checkpoint's (the
    resume's compatibility check compares it), so the groups correspond one to one; the moments and step
    counts in the per-parameter state are kept. Without a change this sets the values already there."""
    for group, built in zip(optimizer.param_groups, settings, strict=True):
        group.update(built)


def lost_work(run_dir: Path) -> dict[str, Any]:
    """What a restart from step 0 loses: every update of the earlier sessions (none left a checkpoint), as
    their last recorded counters say; the session_start and run.json name it and summarize checks it."""
    events = read_metrics_tolerant(run_dir).events
    last = events[-1] if events else {}
    return {"lost_updates": int(last.get("step", 0)), "lost_tokens": int(last.get("tokens_seen", 0)),
            "after_session": last.get("session_id")}


def run_skip_data(session: Session) -> list[dict[str, Any]]:
    detector = next(hook for hook in session.state.hooks if isinstance(hook, SpikeDetector))
    return skip_data_section(
        session.config.train.skip_data, detector, session.state.loader, session.dataset.eos_id
    )


def open_record(session: Session, *, resume: bool, command: list[str]) -> None:
    """run.json (created, or extended by this session with the restored recipe, not the flags typed) and
    this session's metrics writer. Only rank 0 writes."""
    context, config = session.context, session.config
    is_main = context.is_main_process
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    session.session_id = dist_utils.broadcast_object(context, f"{stamp}-{uuid.uuid4().hex[:8]}")
    if resume:
        record = RunRecord.load(session.run_dir, enabled=is_main)
        record.data["recipe"] = config_to_dict(config)
        record.data["tokens_per_update"] = session.tokens_per_update
        record.data["model"] = session.model_section()
        record.data["optimizer"] = {"groups": session.partition}
        if isinstance(session.dataset, MixedDataset):  # the weights in force (a change is an allowed change)
            record.data["data"].update(mixture=session.dataset.mixture_section(),
                                       sources=session.dataset.sources_section())
    else:
        record = RunRecord.create(session.run_dir, run_id=f"run-{session.session_id}",
                                  tokens_per_update=session.tokens_per_update, model=session.model_section(),
                                  optimizer={"groups": session.partition}, recipe=config_to_dict(config),
                                  data=session.data_section(), enabled=is_main)
    # what the restored state steps over (rewritten at a rollback)
    record.data["skip_data"] = run_skip_data(session)
    # `recipe` in today's names, on any resume too
    record.data[renames.RECIPE_FORMAT_KEY] = renames.RECIPE_FORMAT
    record.record_allowed_changes(session.session_id, session.plan.allowed_changes)
    record.record_free_changes(session.session_id, session.plan.free_changes)
    counters = session.state.counters()
    if session.plan.restart:
        session.restart = lost_work(session.run_dir)
    # The writer first: it cuts a torn tail and finds the chain head this session's lines continue from.
    metrics = MetricsWriter(
        session.run_dir, session.session_id, enabled=is_main, run_id=str(record.data["run_id"])
    )
    record.add_session(
        {
            "session_id": session.session_id,
            "start_step": counters.step,
            "start_tokens_seen": counters.tokens_seen,
            "resumed_from": session.resumed_from,
            "git": git_state(),
            "command": command,
            "hardware": session.hardware,
            "software": session.software,
            "started_at": datetime.datetime.now(datetime.UTC).isoformat(),
            "notes": list(session.notes),
            "chain_start": metrics.head,
            **({"restart": session.restart} if session.restart else {}),
            # From this session's first update on, a replay of the run is not promised bit for bit (the
            # verdict's replay comparison names these changes as the cause where replayed windows differ).
            **(
                {"not_exact": {"from_update": counters.step + 1, "changes": session.plan.not_exact}}
                if session.plan.not_exact
                else {}
            ),
        }
    )
    record.save()
    session.record = record
    session.metrics = metrics
    session.started_run = not resume
