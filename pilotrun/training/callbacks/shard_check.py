"""The loop's side of the background shard check (data/shard_hashing.py): record each check, stop on damage.

Every rank watches both splits of its session's dataset and hashes the shards it reads itself (ranks read
different windows, and a rank's copy of the folder may be the damaged one). After each update the callback
asks its hasher whether a shard failed; the loop agrees on that across ranks (`stop_requested`), so a damage
found on any rank ends the session on all, at the next update boundary, with a checkpoint of the last applied
state and `session_end` reason "stopped", exit 1, its message the one line naming the shard with the expected
and found hash prefixes. The update that read the shard was trained on it; the checkpoint says so by its step,
and a resume after repairing the data continues from there.

Each finished check is a `shard_check` event (docs/RUN_RECORD.md), written by rank 0 for its own checks where
the window that first read the shard closes, after waiting for them, just before the window's `train` event
(the hashing runs beside the window's updates; the wait costs nothing unless the window was shorter than the
hash). The session's last update waits
for the shards still being hashed, so a session that ends "completed" has verified every shard it read (a
shard first read by the last round's evaluation is checked after that decision: its event is written, but it
cannot stop the session any more). A resumed session hashes again the shards it reads: the hasher's memory
is one session's, which costs one background read of each shard per session.
"""

from __future__ import annotations

from pilotrun.data.mixed_reader import all_splits
from pilotrun.data.shard_hashing import ShardHasher
from pilotrun.data.stream import SPLITS
from pilotrun.training.callbacks.base import PRIORITY_RARE_EVENTS, Callback, Ending, LoopState, due_on_cadence

PRIORITY_SHARD_CHECK = PRIORITY_RARE_EVENTS + 1  # beside the rare events: before the window that contains it


# At the session's end (an error included) the val shards the last evaluation read are given this long to be
# checked; a full-size shard hashes in a small fraction of that (BENCHMARKS.md, "Background shard
# hashing"), so only a stalled disk reaches it.
AT_END_WAIT_SECONDS = 30.0


def _window_closes(loop: LoopState) -> bool:
    """The update just made closes a `train` window (window_log.WindowLogCallback's cadence)."""
    t = loop.session.config.train
    return due_on_cadence(loop, t.log.every) or due_on_cadence(loop, t.checkpoint.every)


class ShardCheckCallback(Callback):
    """Logs each finished shard check and asks the session to stop at the first damaged shard."""

    priority = PRIORITY_SHARD_CHECK
    phase = "other"

    def __init__(self, hasher: ShardHasher, rank: int = 0) -> None:
        self.hasher = hasher
        self.rank = rank

    @classmethod
    def for_session(cls, loop: LoopState, hasher: ShardHasher | None = None) -> ShardCheckCallback:
        """Watch the session's train and val splits from the first read on."""
        hasher = hasher if hasher is not None else ShardHasher()
        for name in SPLITS:
            for split in all_splits(loop.session.dataset, name):
                hasher.watch(split)
        return cls(hasher, loop.session.context.rank)

    def stop_request(self, loop: LoopState) -> Ending | None:
        if _window_closes(loop) or loop.step >= loop.session.config.train.max_steps:
            # the window's shards are checked before it closes (and before the session ends)
            self.hasher.wait()
        damaged = self.hasher.mismatch
        if damaged is None:
            return None
        where = f" (rank {self.rank})" if loop.session.context.world_size > 1 else ""
        return Ending("stopped", 1, damaged.describe() + where)

    def due(self, loop: LoopState) -> bool:
        # Only where a window closes, after waiting for the shards read in it: the events then stand at the
        # same place in the record of every identical run, however fast the hashing thread was (a record that
        # moved with the thread's timing would differ from a resumed run's and from a run without observers).
        return _window_closes(loop) or loop.final

    def after_update(self, loop: LoopState) -> None:
        self.hasher.wait()
        self._log_finished(loop)

    def at_end(self, loop: LoopState) -> None:
        self.hasher.wait(timeout=AT_END_WAIT_SECONDS)  # the last evaluation's val shards
        self.hasher.close()
        self._log_finished(loop)  # checks finished since the last round, before the trainer's session_end

    def _log_finished(self, loop: LoopState) -> None:
        for result in self.hasher.take_finished():
            loop.log("shard_check", **result.event_fields())
