"""What attaches to the training loop: the Callback interface and the loop's state every callback reads.

The loop (loop.py) runs one update, then asks each callback, in `priority` order (lowest first), whether it is
`due`; a due callback's `after_update` runs in its own time `phase` (one of `PHASES`), so that every second of
the session lands in the phase of the concern that spent it. When the session ends, for any reason, every
callback's `at_end` runs in the same order. A callback that must wrap the update attempt itself (the profiler,
the window's device timers) returns a context manager from `around_update`; all others leave it alone.

The order is part of the record's meaning: the window closes (a `train` event) before a checkpoint is taken,
so a checkpoint's counters always coincide with a `train` event, which is what `summarize` reconciles a
resumed session against; the pilot's kill point comes last, once the checkpoint it waits for is committed.

`LoopState` is the one object the loop and its callbacks share (OLMo-core's trainer state): the session
(model, optimizer, counters, record), the time account, the current window, what the last update did, and the
few facts callbacks hand on to each other (the step of the last checkpoint, of the last `train` event, the
last validation loss). New concerns (watching, spike handling) attach as further callbacks; the loop does not
change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from pilotrun.optim.update_hooks import UpdateHook
from pilotrun.run.record import PHASES
from pilotrun.run.sinks import GuardedSink
from pilotrun.training.precision import UpdateOutcome
from pilotrun.training.session import Session
from pilotrun.training.signals import StopSignals
from pilotrun.training.timing import TimeAccount, WindowClock
from pilotrun.training.window import Window

if TYPE_CHECKING:
    from pilotrun.training.spikes.detector import SpikeVerdict

# The built-in callbacks' places; a new callback picks a number between them.
PRIORITY_PROFILE = -10  # outermost around the update: it decides which phase the attempt is charged to
# data restarts, overflows, QK-Clip events: logged right after the update they follow
PRIORITY_RARE_EVENTS = 0
# the spike event, and a rollback (which closes the window itself) before the window's turn
PRIORITY_SPIKE = 5
PRIORITY_WINDOW = 10  # the `train` event and the progress bar
PRIORITY_EVAL = 20
PRIORITY_CHECKPOINT = 30  # after the window: a checkpoint's counters are those of a `train` event
PRIORITY_KILL_POINT = 100  # last: it waits for a logged step and a committed checkpoint


@dataclass
class UpdateResult:
    """What one update attempt did: the outcome (applied or skipped), how many exhaustion restarts of the
    training split happened during it (0 nearly always) and the fields of the update hooks' events."""

    outcome: UpdateOutcome
    restarted: int = 0
    hook_events: list[dict[str, Any]] = field(default_factory=list)
    # the attempt was a spike (spikes.py): its figures and the policy's action
    spike: SpikeVerdict | None = None

    @property
    def applied(self) -> bool:
        return self.outcome.applied


@dataclass
class Ending:
    """How the session ends: reason (completed | interrupted | deadline | stopped), exit code and message."""

    reason: str
    exit_code: int
    message: str


@dataclass
class LoopState:
    """The state the loop and its callbacks share; see the module docstring."""

    session: Session
    account: TimeAccount
    signals: StopSignals
    out: TextIO
    sinks: list[GuardedSink] = field(default_factory=list)
    window: Window | None = None
    window_clock: WindowClock | None = None
    update: UpdateResult | None = None  # the last update attempt's; None before the first and at a data error
    update_profiled: bool = False  # the attempt in flight runs under the profiler
    final: bool = False  # the session ends after this round of callbacks
    ending: Ending | None = None  # set when the session stops before max_steps
    last_checkpoint_step: int | None = None
    last_save_seconds: float | None = None  # the last save's wall seconds in this session
    logged_step: int | None = None  # the step of the last `train` event
    last_val_loss: float | None = None

    def __post_init__(self) -> None:
        if self.window is None:
            self.window = Window(self.session.device)
        if self.window_clock is None:
            self.window_clock = WindowClock(self.account)
        if self.last_checkpoint_step is None:
            self.last_checkpoint_step = self.session.resumed_from

    @property
    def step(self) -> int:
        return self.session.state.step

    @property
    def is_main(self) -> bool:
        return self.session.context.is_main_process

    @property
    def applied(self) -> bool:
        """The last update attempt was applied (False before any, and after a skip)."""
        return self.update is not None and self.update.applied

    @property
    def checkpoint_committed_here(self) -> bool:
        """A checkpoint was committed in this session (steps only grow, so any save moves past the
        resume's)."""
        return self.last_checkpoint_step != self.session.resumed_from

    def hook(self, name: str) -> UpdateHook:
        return next(hook for hook in self.session.state.hooks if hook.name == name)

    def log(self, event: str, counters: Any = None, **fields: Any) -> None:
        """Record one event (rank 0) and hand it to the sinks; both are the "report" phase. `counters`: those
        the event is about when they are not the current ones (a background checkpoint's, committed later)."""
        with self.account.phase("report"):
            counters = counters if counters is not None else self.session.state.counters()
            record = self.session.metrics.log(event, counters, **fields)
            if record is not None:
                for sink in self.sinks:
                    sink.write(record)

    def say(self, line: str) -> None:
        """A line for the user on rank 0 (the plan, notes, profile files, the session's end)."""
        if self.is_main:
            print(line, file=self.out, flush=True)


def due_on_cadence(loop: LoopState, every: int) -> bool:
    """An applied update that lands on a multiple of a cadence (0: never)."""
    return loop.applied and every > 0 and loop.step % every == 0


class Callback:
    """One concern of the loop. Subclasses set `priority` and `phase` and override what they need."""

    priority: int = 50
    phase: str = "other"

    def due(self, loop: LoopState) -> bool:
        """Whether `after_update` runs now (after the update just done, or at the session's last round)."""
        return False

    def after_update(self, loop: LoopState) -> None:
        """Act; runs in `phase`."""

    def at_end(self, loop: LoopState) -> None:
        """The session ends (completed, stopped, interrupted or an error): release what the callback holds."""

    def around_update(self, loop: LoopState) -> contextlib.AbstractContextManager[Any]:
        """A context the update attempt runs in (entered in priority order, so a lower priority is
        outside)."""
        return contextlib.nullcontext()

    def stop_request(self, loop: LoopState) -> Ending | None:
        """After each update attempt, on every rank: how this concern wants the session to end now (a shard
        found damaged, the launcher gone), or None. The loop agrees across ranks: when any rank asks, every
        rank stops with the first asking rank's Ending, and the last round checkpoints the state as for a
        signal. Must not synchronise with other ranks itself (the loop does that, once for all)."""
        return None


def in_order(callbacks: Iterable[Callback]) -> list[Callback]:
    ordered = sorted(callbacks, key=lambda callback: callback.priority)  # stable: equal priorities keep order
    unknown = [type(c).__name__ for c in ordered if c.phase not in PHASES]
    if unknown:
        raise ValueError(
            f"callbacks with an unknown time phase: {', '.join(unknown)} (phases: {', '.join(PHASES)})"
        )
    return ordered


def run_due(loop: LoopState, callbacks: Sequence[Callback]) -> None:
    """Each due callback acts, in order, in its own phase (back to the loop's phase after each)."""
    for callback in callbacks:
        if callback.due(loop):
            with loop.account.phase(callback.phase):
                callback.after_update(loop)


def run_at_end(loop: LoopState, callbacks: Sequence[Callback], *, failing: bool = False) -> None:
    """Every callback's `at_end`, in order. After an error, a callback's own failure is swallowed: what it
    holds is worth releasing, but the session's error is the one to report."""
    for callback in callbacks:
        if failing:
            with contextlib.suppress(Exception):
                callback.at_end(loop)
        else:
            callback.at_end(loop)
