"""When the loop saves a checkpoint, and the save itself: the "checkpoint" phase.

The policy is here, the storage is not (checkpointer.py writes and commits, distributed_checkpointer.py picks
the storage, background.py writes beside training): a checkpoint is due after every
`train.checkpoint.every`-th applied update, and at the session's last round (completed, stopped, interrupted,
or before a data error ends it) unless the state at that step is already the newest checkpoint, so a session
never ends with work that is not saved and never saves the same step twice.

Every rank takes part in a save: with several ranks the checkpoint is written collectively (DCP: shards and
each rank's RNG) and committed by rank 0, after a check that the DDP replicas still agree (DCP stores a
replicated tensor once); with one process it is the plain torch.save. What it holds is
`session.checkpoint_state`, the same definition a resume reads into. The `checkpoint` event follows the
commit, so a reader of metrics.jsonl that sees it can trust the folder is there.

Background saves (`train.checkpoint.mode`): a cadence save only stages the state to host memory and returns;
DCP writes, hashes and fsyncs it beside training (checkpoint/background.py). The parameters and the
optimizer's state are copied by a staging thread beside the next update's forward and backward: this callback
holds that update's optimizer step (a step pre-hook on the session's optimizer, removed when the attempt
ends) and the end of the update attempt (`around_update`: an update held by the spike gate or skipped for an
overflow does not step) until the copy is done, and charges the wait to the checkpoint phase. It is
committed at the first round after rank 0's write is done (rank 0 says so, every rank follows: one small
broadcast per round while a save is in flight), or before the next save, a spike's rollback, or the session's
end, whichever comes first. Besides the cadence, a spike's rollback commits the step it restored again
(`save_now`, synchronous), with the skip it added in the trainer state. Its `checkpoint` event is logged then,
carrying the counters of the state it saved (which may be behind the events logged meanwhile: `background:
true` tells summarize so), `seconds` and `blocking_seconds` for what the loop waited (the copy in the save's
call, the wait for the staging thread before the next step, the commit), `background_seconds` for
what ran beside training, and, when the save had to wait for the one before it, `waited_for_step` and
`waited_seconds`. The last round's save (completion, a stop signal, a deadline, a hang) is synchronous, after
the one in flight is committed.

Before each save rank 0 compares the free space with what the save will write (the last checkpoint's measured
bytes, else preflight's estimate, and a margin for the record): too little ends the session before anything is
written, so that the disk never fills under a write, nor under the record's own appends while a background
write runs. A save that still fails for a full disk (or quota: something else filled it) ends the session the
same way. Either way nothing of that save is committed, the previous checkpoint stays the newest, and the
session ends `stopped` (exit 1) with the reason; any other failure raises.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from pilotrun.config import CheckpointConfig
from pilotrun.training import distributed as dist_utils
from pilotrun.training.callbacks.base import PRIORITY_CHECKPOINT, Callback, Ending, LoopState, due_on_cadence
from pilotrun.training.checkpoint.background import (
    PendingSave,
    close_background,
    finish_background_save,
    out_of_space,
    space_error_line,
    stable_storages,
    start_background_save,
)
from pilotrun.training.checkpoint.dcp_storage import DCPStorage
from pilotrun.training.checkpoint.retention import PROTECT_FINAL
from pilotrun.training.preflight import checkpoint_bytes_estimate, disk_plan, room_problem
from pilotrun.training.session import checkpoint_state


def _state_and_meta(loop: LoopState, sharded: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    session = loop.session
    if session.context.is_distributed:
        dist_utils.check_replicas_identical(session.context, session.model)
    state = checkpoint_state(session, sharded=sharded)
    meta = session.checkpoint_meta(session.config, session.partition, session.state.counters())
    meta["metrics_chain_head"] = session.metrics.head  # the record up to this checkpoint, as the chain says
    return state, meta


def _committed_bytes(loop: LoopState, path: Any) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if loop.is_main and path else 0


def save_checkpoint(loop: LoopState, **extra: Any) -> int:
    """Save and commit the state at the current step, then log the `checkpoint` event (every rank calls it);
    `extra`: more fields for the event (a wait for the background save before it). Returns its bytes (rank
    0)."""
    session = loop.session
    started = time.perf_counter()
    if loop.final and loop.ending is None and loop.step >= session.config.train.max_steps:
        # the completed run's last state, kept for good
        session.checkpointer.protect(loop.step, PROTECT_FINAL)
    # The state's form follows the storage that writes it: name-keyed DCP state dicts for DCP (whatever the
    # world size), the plain torch.save form otherwise; a resume reads it back in the form its marker's
    # storage names.
    state, meta = _state_and_meta(loop, sharded=session.checkpointer.storage.name == DCPStorage.name)
    path = session.checkpointer.save(loop.step, state, meta)
    size = _committed_bytes(loop, path)
    dist_utils.barrier(session.context)
    loop.last_checkpoint_step = loop.step
    loop.last_save_seconds = time.perf_counter() - started  # the deadline's margin (callbacks/deadline.py)
    session.metrics.fsync()
    loop.log("checkpoint", path=str(path) if path is not None else None, seconds=loop.last_save_seconds,
             blocking_seconds=loop.last_save_seconds, bytes=size, **extra)
    return size


class CheckpointCallback(Callback):
    """Owns the cadence: `every` applied updates (0: only at the end), and the last round's save; with
    `background`, the cadence's saves are written beside training (module docstring)."""

    priority = PRIORITY_CHECKPOINT
    phase = "checkpoint"

    def __init__(self, every: int, background: bool = False) -> None:
        self.every = every
        self.background = background
        self.pending: PendingSave | None = None
        self.hold: Any = None  # the optimizer's step pre-hook while the pending save's staging copies
        self.write_done = False  # agreed this round: the pending save's write has finished on rank 0
        self.stopped_for_space: str | None = None
        self.disk_stated = False
        # the newest committed checkpoint's, measured (rank 0): the next save's expected size
        self.last_bytes = 0

    @classmethod
    def for_section(cls, section: CheckpointConfig, device_type: str) -> CheckpointCallback:
        """Built from `train.checkpoint`: its cadence, and its mode (auto: beside training on CUDA)."""
        background = section.mode == "background" or (section.mode == "auto" and device_type == "cuda")
        return cls(section.every, background=background)

    def due(self, loop: LoopState) -> bool:
        if self.stopped_for_space is not None:
            return False
        # Only a write that succeeded counts as done here: a failed one is told by stop_request, so that the
        # session stops at a round that closes its window (a full disk), or raises when it is settled.
        pending = self.pending
        self.write_done = pending is not None and dist_utils.broadcast_object(
            loop.session.context, pending.done() and pending.future.exception() is None)
        if loop.final:  # the last state, unless it is already the newest; and the save in flight, committed
            return self.pending is not None or loop.last_checkpoint_step != loop.step
        return self.write_done or due_on_cadence(loop, self.every)

    def after_update(self, loop: LoopState) -> None:
        saving = loop.final or due_on_cadence(loop, self.every)
        waited = None
        if self.pending is not None:
            step, wait_started, running = self.pending.step, time.perf_counter(), not self.write_done
            self.settle(loop)
            if saving and running:
                waited = {"waited_for_step": step, "waited_seconds": time.perf_counter() - wait_started}
        if self.stopped_for_space is not None or not saving:
            return
        if loop.final and loop.last_checkpoint_step == loop.step:
            return  # the save just committed is this very state
        if self._no_room(loop):
            return
        if waited:
            loop.say(
                f"checkpoint step {loop.step}: waited {waited['waited_seconds']:.2f} s for the background "
                f"save of step {waited['waited_for_step']} to finish (at most one is in flight)"
            )
        try:
            if self.background and not loop.final:
                self._start(loop, waited or {})
            else:
                self.last_bytes = save_checkpoint(loop, **(waited or {})) or self.last_bytes
                self._state_disk(loop)
        except Exception as exc:
            if not out_of_space(exc):
                raise
            self._stop_for_space(loop, loop.step, exc)

    def save_now(self, loop: LoopState) -> None:
        """Commit the current step now, outside the cadence, synchronously, after the save in flight (every
        rank): a spike's rollback commits the step it restored again, with the skip and the count it added. A
        disk without room stops the session as for any save (the older copy of the step stays the committed
        one)."""
        with loop.account.phase("checkpoint"):
            self.settle(loop)
            if self.stopped_for_space is not None or self._no_room(loop):
                return
            try:
                self.last_bytes = save_checkpoint(loop) or self.last_bytes
            except Exception as exc:
                if not out_of_space(exc):
                    raise
                self._stop_for_space(loop, loop.step, exc)

    def _start(self, loop: LoopState, waited: dict[str, Any]) -> None:
        session = loop.session
        state, meta = _state_and_meta(loop, sharded=True)
        self.pending = start_background_save(session.checkpointer, loop.step, state, meta,
                                             stable=stable_storages(session.raw_model, session.optimizer))
        self.pending.extra = {"counters": session.state.counters(), **waited}
        if not self.pending.staged_and_waited():  # the staging thread copies: hold the next step
            self.hold = session.optimizer.register_step_pre_hook(lambda *_: self._wait_staged(loop))

    def _wait_staged(self, loop: LoopState) -> None:
        """Before the parameters or the optimizer's state can change: the staging thread's copy is done."""
        if self.pending is not None and not self.pending.staged_and_waited():
            with loop.account.phase("checkpoint"):
                self.pending.wait_staged()

    def _release_hold(self, loop: LoopState) -> None:
        """The copy is done (waited for here if not yet); the step pre-hook goes (never from inside it: torch
        is iterating over the hooks then)."""
        self._wait_staged(loop)
        hold, self.hold = self.hold, None
        if hold is not None:
            hold.remove()

    def around_update(self, loop: LoopState) -> contextlib.AbstractContextManager[Any]:
        return self._staged_after_update(loop) if self.hold is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _staged_after_update(self, loop: LoopState) -> Iterator[None]:
        try:
            yield
        finally:  # also an update that did not step: the copy is done before anything after it runs
            self._release_hold(loop)

    def settle(self, loop: LoopState) -> None:
        """Wait for the save in flight (if any), commit it and log its `checkpoint` event (every rank)."""
        self._release_hold(loop)
        pending, self.pending, self.write_done = self.pending, None, False
        if pending is None:
            return
        session = loop.session
        finishing = time.perf_counter()
        try:
            path = finish_background_save(session.checkpointer, pending)
        except Exception as exc:
            if not out_of_space(exc):
                raise
            self._stop_for_space(loop, pending.step, exc)
            return
        now = time.perf_counter()
        total = now - pending.started
        blocking = pending.staged_seconds + pending.held_seconds + (now - finishing)
        loop.last_checkpoint_step = pending.step
        loop.last_save_seconds = total
        session.metrics.fsync()
        extra = dict(pending.extra)
        counters = extra.pop("counters", None)
        self.last_bytes = _committed_bytes(loop, path)
        loop.log("checkpoint", counters=counters, path=str(path), seconds=blocking, blocking_seconds=blocking,
                 background_seconds=max(0.0, total - blocking), total_seconds=total, background=True,
                 bytes=self.last_bytes, **extra)
        self._state_disk(loop)

    def _no_room(self, loop: LoopState) -> bool:
        """Before a save: rank 0 compares the free space with what the save will write (the last checkpoint's
        measured bytes, else the estimate); too little ends the session now, before the disk fills under a
        write (and under the record's own appends beside a background one). Every rank follows rank 0."""
        session = loop.session
        problem = None
        if loop.is_main:
            expected = self.last_bytes or checkpoint_bytes_estimate(session.optimizer)
            problem = room_problem(session.checkpointer.root, expected)
        problem = dist_utils.broadcast_object(session.context, problem)
        if problem is not None:
            self._stop_for_space(loop, loop.step, problem, written=False)
        return problem is not None

    def _stop_for_space(self, loop: LoopState, step: int, exc: Any, written: bool = True) -> None:
        newest = loop.last_checkpoint_step
        kept = f"checkpoint step {newest} is still the newest committed" if newest is not None else \
            "no checkpoint was committed"
        what = (
            "could not be written, the disk is full" if written else "was not written, the disk is too full"
        )
        said = space_error_line(exc) if isinstance(exc, BaseException) else exc
        self.stopped_for_space = (
            f"checkpoint step {step} {what} ({said}); nothing of it was committed and {kept}: "
            "free space, then --resume"
        )
        loop.say(f"error: {self.stopped_for_space}")
        loop.ending = Ending("stopped", 1, self.stopped_for_space)
        loop.final = True

    def _state_disk(self, loop: LoopState) -> None:
        """After the session's first commit: the disk plan again, with the bytes the save measured."""
        if self.disk_stated or not loop.is_main or loop.last_checkpoint_step is None:
            return
        self.disk_stated = True
        checkpointer, t = loop.session.checkpointer, loop.session.config.train
        path = checkpointer.root / f"step-{loop.last_checkpoint_step:08d}"
        line, warning = disk_plan(checkpointer, t, _committed_bytes(loop, path), "measured by this save")
        loop.say(line)
        if warning:
            loop.say(f"warning: {warning}")

    def stop_request(self, loop: LoopState) -> Ending | None:
        """A background write that failed for space asks the session to stop; the last round settles it."""
        pending = self.pending
        if pending is not None and pending.done() and pending.future.exception() is not None \
                and out_of_space(pending.future.exception()):
            return Ending(
                "stopped", 1, f"checkpoint step {pending.step} could not be written, the disk is full"
            )
        return None

    def at_end(self, loop: LoopState) -> None:
        """The session ends: the save still in flight is committed (one process), or left uncommitted when the
        session fails under several ranks (the others may be gone; its temp folder is removed by the next
        save)."""
        try:
            if self.pending is None:
                return
            if loop.session.context.is_distributed:
                self._release_hold(loop)  # its host buffers are released below
                self.pending = None
                return
            self.settle(loop)
        finally:
            close_background(loop.session.checkpointer)
