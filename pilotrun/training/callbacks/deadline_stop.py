"""The deadline (`--stop-by`, pilotrun/common/deadline.py): end the session with a committed checkpoint before
it.

After each update attempt the callback asks whether the session may go on: going on means one more update and
its round of callbacks (a log, an evaluation, a cadence save) before the next question, and then the last
round, with the final save, must still land before the deadline. So the margin it keeps, measured in this
session, is twice the slowest of the recent updates and rounds, plus the last save's own seconds: a margin of
exactly one update, one round and the save leaves nothing for their spread, and the save can commit just past
the deadline. Before this session has saved, the run's last recorded save stands for it
(`recorded_save_seconds`, measured); only a run that never saved counts its set-up's seconds instead (reading
and building the state cost about what writing it does, and a fresh start has little to save). A session whose
set-up ate the time left, so that not even that save fits before the deadline, trains nothing:
`too_late_to_start` ends it at once (`deadline`, 75: not in this allocation; a requeue starts it in the next).
The session's first update is left out: it pays the warm-up (the CPU kernels' load, allocator growth, a
compile), which can take many times as long as the updates after it, and predicts nothing about them. A first
update longer than the time left cannot be helped (the stop comes after an update); the command refuses a
deadline closer than the run's fastest recorded update.

It asks to stop through `stop_request`; the loop agrees across ranks (the first rank that asks stops every
rank at the same update), closes the window, saves, and ends the session with reason `deadline` and
`DEADLINE_EXIT_CODE` (75): stopped, resumable, as a requeue script reads it. Ranks' clocks may differ a
little; the agreement makes the earliest one decide, which is the safe side.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from pilotrun.common.stop_signals import DEADLINE_EXIT_CODE
from pilotrun.training.callbacks.base import Callback, Ending, LoopState

RECENT = 20  # updates and rounds the margin looks back on: recent enough to follow a slowdown


class DeadlineCallback(Callback):
    """Asks the session to stop when `clock() + margin` reaches `stop_by` (epoch seconds)."""

    priority = 50
    phase = "other"

    def __init__(self, stop_by: float, *, setup_seconds: float, clock: Callable[[], float] = time.time,
                 recorded_save_seconds: float | None = None) -> None:
        self.stop_by = stop_by
        self.clock = clock
        self.setup_seconds = max(0.0, setup_seconds)
        self.recorded_save_seconds = recorded_save_seconds
        self.updates: deque[float] = deque(maxlen=RECENT)
        self.rounds: deque[float] = deque(maxlen=RECENT)
        self.update_ended: float | None = None
        self.first_update_seen = False

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        started = self.clock()
        if self.update_ended is not None:
            self.rounds.append(started - self.update_ended)  # the callbacks' round after the previous update
        try:
            yield
        finally:
            self.update_ended = self.clock()
            if self.first_update_seen:
                self.updates.append(self.update_ended - started)
            self.first_update_seen = True

    def around_update(self, loop: LoopState) -> contextlib.AbstractContextManager[Any]:
        return self._timed()

    def margin(self, loop: LoopState) -> float:
        return 2 * (max(self.updates, default=0.0) + max(self.rounds, default=0.0)) + self.save_seconds(loop)

    def save_seconds(self, loop: LoopState) -> float:
        """This session's last save, else the run's last recorded one, else the set-up's seconds."""
        if loop.last_save_seconds is not None:
            return loop.last_save_seconds
        return self.recorded_save_seconds if self.recorded_save_seconds is not None else self.setup_seconds

    def too_late_to_start(self, loop: LoopState) -> Ending | None:
        """Before the first update: the deadline is closer than the save alone (the set-up spent the rest). A
        session resumed at max_steps (plain `--resume` of a complete run) has nothing to stop: it completes,
        0, rather than a `deadline` that a scheduler would requeue for ever."""
        left = self.stop_by - self.clock()
        if left > self.save_seconds(loop) or loop.step >= loop.session.config.train.max_steps:
            return None
        return Ending(
            "deadline",
            DEADLINE_EXIT_CODE,
            f"deadline in {left:.1f} s after the set-up, less than a save "
            f"({self.save_seconds(loop):.1f} s): nothing trained, not to be started again before the "
            f"deadline; checkpoint step {loop.step} stays the newest",
        )

    def stop_request(self, loop: LoopState) -> Ending | None:
        now = self.clock()
        margin = self.margin(loop)
        if now + margin < self.stop_by:
            return None
        return Ending(
            "deadline",
            DEADLINE_EXIT_CODE,
            f"deadline in {self.stop_by - now:.1f} s, within this "
            f"session's margin of {margin:.1f} s (twice the slowest recent update and round, and the last "
            "save): "
            f"saved checkpoint step {loop.step}",
        )
