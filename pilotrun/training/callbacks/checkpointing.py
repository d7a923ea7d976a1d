"""When the loop saves a checkpoint, and the save itself: the "checkpoint" phase.

The policy is here, the storage is not (checkpoint.py writes and commits, dcp_storage.py picks torch.save or
DCP): a checkpoint is due after every `checkpoint_every`-th applied update, and at the session's last round
(completed, stopped, interrupted, or before a data error ends it) unless the state at that step is already the
newest checkpoint, so a session never ends with work that is not saved and never saves the same step twice.

Every rank takes part in a save: with several ranks the checkpoint is written collectively (DCP: shards and
each rank's RNG) and committed by rank 0, after a check that the DDP replicas still agree (DCP stores a
replicated tensor once); with one process it is the plain torch.save. What it holds is
`session.checkpoint_state`, the same definition a resume reads into. The `checkpoint` event follows the commit,
so a reader of metrics.jsonl that sees it can trust the folder is there.
"""

from __future__ import annotations

import time

from pilotrun.training import distributed as dist_utils
from pilotrun.training.callbacks.base import PRIORITY_CHECKPOINT, Callback, LoopState, due_on_cadence
from pilotrun.training.session import checkpoint_state


def save_checkpoint(loop: LoopState) -> None:
    """Save and commit the state at the current step, then log the `checkpoint` event (every rank calls it)."""
    session = loop.session
    started = time.perf_counter()
    size = 0
    sharded = session.context.is_distributed
    if sharded:
        dist_utils.check_replicas_identical(session.context, session.model)
    state = checkpoint_state(session, sharded=sharded)
    meta = session.checkpoint_meta(session.config, session.partition, session.state.counters())
    meta["metrics_chain_head"] = session.metrics.head  # the record up to this checkpoint, as the chain says
    path = session.checkpointer.save(loop.step, state, meta)
    if loop.is_main:
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    dist_utils.barrier(session.context)
    loop.last_checkpoint_step = loop.step
    loop.last_save_seconds = time.perf_counter() - started  # the deadline's margin (callbacks/deadline.py)
    session.metrics.fsync()
    loop.log("checkpoint", path=str(path) if path is not None else None, seconds=loop.last_save_seconds,
             bytes=size)


class CheckpointCallback(Callback):
    """Owns the cadence: `every` applied updates (0: only at the end), and the last round's save."""

    priority = PRIORITY_CHECKPOINT
    phase = "checkpoint"

    def __init__(self, every: int) -> None:
        self.every = every

    def due(self, loop: LoopState) -> bool:
        if loop.final:
            return loop.last_checkpoint_step != loop.step  # the last state, unless it is already the newest
        return due_on_cadence(loop, self.every)

    def after_update(self, loop: LoopState) -> None:
        save_checkpoint(loop)
