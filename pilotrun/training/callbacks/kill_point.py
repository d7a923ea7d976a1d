"""The pilot's kill point: a training process that stops itself at a known step, so the pilot's SIGKILL lands
there.

`pilotrun pilot` proves that a run continues exactly after a real, unannounced SIGKILL. A kill sent from
outside races the training process, which does not wait for the pilot to read metrics.jsonl: with updates of a
few milliseconds (a small recipe, any recipe on a GPU) it could commit its final checkpoint before the kill
landed, and the resumed session would then have nothing left to do, so nothing about continuing would be
proved.

So the pilot names the step (`pilotrun train --stop-past-step N`, a hidden option handed to the trainer as a
parameter) and the trainer's kill-point callback, once a `train` event past that step is logged and a
checkpoint of this session is committed (and before its last update), flushes its output and sends the process
SIGSTOP. The pilot sees the stopped state (commands/pilot_process.py `wait_until_stopped`, which reads /proc
and needs no torch) and sends SIGKILL: the process dies without any handler, atexit or final checkpoint, at
the step it stopped at rather than wherever a race would put it. A stopped process that is sent SIGCONT
instead (someone found it by hand) just carries on.

Under torchrun every rank stops itself at the same update boundary: rank 0, the one that writes the record,
decides and the decision is shared (one all-reduce per update while the kill point is armed), so no rank runs
ahead into a collective the others never join; the pilot then finds every worker stopped and kills the
launcher and all of them at once, as a lost node would be.
"""

from __future__ import annotations

import os
import signal
import sys

from pilotrun.training import distributed as dist_utils
from pilotrun.training.callbacks.base import PRIORITY_KILL_POINT, Callback, LoopState


class SelfStopPoint:
    """When the trainer stops itself for the pilot: `due` after each update, `stop_self` once."""

    def __init__(self, past_step: int | None) -> None:
        self.past_step = past_step

    def due(self, logged_step: int | None, checkpoint_committed: bool, step: int, max_steps: int) -> bool:
        """A train event past the step is logged, a checkpoint of this session is committed, updates
        remain."""
        return (self.past_step is not None and logged_step is not None and logged_step > self.past_step
                and checkpoint_committed and step < max_steps)

    def stop_self(self) -> None:
        self.past_step = None  # once: a process continued with SIGCONT trains to the end
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSTOP)


class KillPointCallback(Callback):
    """The pilot's kill point as a loop callback: last in order, so the checkpoint it waits for is
    committed."""

    priority = PRIORITY_KILL_POINT
    phase = "other"

    def __init__(self, point: SelfStopPoint) -> None:
        self.point = point

    @classmethod
    def past_step(cls, step: int | None) -> KillPointCallback:
        return cls(SelfStopPoint(step))

    def due(self, loop: LoopState) -> bool:
        if self.point.past_step is None:  # the same on every rank (the same --stop-past-step): no collective
            return False
        due = loop.ending is None and self.point.due(
            loop.logged_step, loop.checkpoint_committed_here, loop.step, loop.session.config.train.max_steps
        )
        context = loop.session.context
        if context.is_distributed:
            # Rank 0's decision on every rank: the ranks stop at one update boundary or not at all.
            due = dist_utils.any_across_ranks(context, due and context.is_main_process)
        return due

    def after_update(self, loop: LoopState) -> None:
        self.point.stop_self()

