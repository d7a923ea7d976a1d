"""pilotrun/training/callbacks/base.py: the Callback interface, its order and phases, and the loop state they
share."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from pilotrun.training.callbacks.base import (
    PRIORITY_CHECKPOINT,
    PRIORITY_EVAL,
    PRIORITY_KILL_POINT,
    PRIORITY_PROFILE,
    PRIORITY_RARE_EVENTS,
    PRIORITY_WINDOW,
    Callback,
    LoopState,
    UpdateResult,
    due_on_cadence,
    in_order,
    run_at_end,
    run_due,
)
from pilotrun.training.callbacks.checkpointing import CheckpointCallback
from pilotrun.training.callbacks.evaluation import EvalCallback
from pilotrun.training.callbacks.kill_point import KillPointCallback
from pilotrun.training.callbacks.profiling import ProfileCallback
from pilotrun.training.callbacks.window_log import RareEventsCallback, WindowLogCallback
from pilotrun.training.precision import UpdateOutcome
from pilotrun.training.signals import StopSignals
from pilotrun.training.timing import TimeAccount


class FakeClock:
    """Advances one second per reading, so each phase's share says which phase code ran in."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


def fake_session(step: int = 0, resumed_from: int | None = None):
    return SimpleNamespace(
        device=torch.device("cpu"),
        resumed_from=resumed_from,
        state=SimpleNamespace(step=step),
        context=SimpleNamespace(is_main_process=True),
    )


def loop_state(step: int = 0, applied: bool = True, resumed_from: int | None = None) -> LoopState:
    account = TimeAccount(clock=FakeClock(), cpu_clock=lambda: 0.0)
    loop = LoopState(fake_session(step, resumed_from), account, StopSignals(), out=None)
    loop.update = UpdateResult(UpdateOutcome(applied, "ok" if applied else "overflow", 1.0, False, 1.0, 1.0))
    return loop


class Recording(Callback):
    def __init__(self, name, priority, phase="other", due=True, calls=None, fail_at_end=False):
        self.name, self.priority, self.phase, self._due = name, priority, phase, due
        self.calls = calls if calls is not None else []
        self.fail_at_end = fail_at_end

    def due(self, loop):
        return self._due

    def after_update(self, loop):
        self.calls.append((self.name, loop.account.current_phase))

    def at_end(self, loop):
        self.calls.append((self.name, "end"))
        if self.fail_at_end:
            raise RuntimeError("failing at_end")


def test_callbacks_act_in_priority_order_each_in_its_own_phase_and_only_when_due():
    calls = []
    callbacks = in_order([Recording("checkpoint", 30, "checkpoint", calls=calls),
                          Recording("window", 10, "other", calls=calls),
                          Recording("never", 0, "eval", due=False, calls=calls),
                          Recording("eval", 20, "eval", calls=calls)])
    loop = loop_state()
    loop.account.switch("train")
    run_due(loop, callbacks)
    assert calls == [("window", "other"), ("eval", "eval"), ("checkpoint", "checkpoint")]
    assert loop.account.current_phase == "train"  # back to the loop's phase after each


def test_equal_priorities_keep_their_order_and_an_unknown_phase_is_refused():
    first, second = Recording("a", 5), Recording("b", 5)
    assert in_order([first, second]) == [first, second]
    with pytest.raises(ValueError, match="unknown time phase"):
        in_order([Recording("x", 1, phase="lunch")])


def test_the_built_in_order_closes_the_window_before_the_checkpoint_and_kills_last():
    assert PRIORITY_PROFILE < PRIORITY_RARE_EVENTS < PRIORITY_WINDOW < PRIORITY_EVAL < PRIORITY_CHECKPOINT
    assert PRIORITY_CHECKPOINT < PRIORITY_KILL_POINT
    built_in = [KillPointCallback.past_step(None), CheckpointCallback(5),
                EvalCallback(SimpleNamespace(every=5)), WindowLogCallback(5, 5), RareEventsCallback(),
                ProfileCallback(SimpleNamespace())]
    assert [type(c).__name__ for c in in_order(built_in)] == [
        "ProfileCallback", "RareEventsCallback", "WindowLogCallback", "EvalCallback", "CheckpointCallback",
        "KillPointCallback"]
    assert {c.phase for c in built_in} == {"other", "eval", "checkpoint", "profile"}


def test_at_end_runs_for_every_callback_and_after_an_error_swallows_their_own_failures():
    calls = []
    callbacks = in_order([Recording("a", 1, calls=calls, fail_at_end=True), Recording("b", 2, calls=calls)])
    run_at_end(loop_state(), callbacks, failing=True)
    assert calls == [("a", "end"), ("b", "end")]
    with pytest.raises(RuntimeError, match="failing at_end"):
        run_at_end(loop_state(), callbacks)


def test_due_on_cadence_needs_an_applied_update_on_a_multiple():
    assert due_on_cadence(loop_state(step=10), 5)
    assert not due_on_cadence(loop_state(step=10), 0)  # 0: never
    assert not due_on_cadence(loop_state(step=11), 5)
    assert not due_on_cadence(loop_state(step=10, applied=False), 5)  # a skip leaves the step where it was
    loop = loop_state(step=10)
    loop.update = None  # no update this round (a resume at max_steps, a data error)
    assert not due_on_cadence(loop, 5)


def test_the_loop_state_knows_whether_this_session_committed_a_checkpoint():
    loop = loop_state(step=8, resumed_from=4)
    assert loop.last_checkpoint_step == 4 and not loop.checkpoint_committed_here
    loop.last_checkpoint_step = 8
    assert loop.checkpoint_committed_here


def test_around_update_defaults_to_no_context():
    with Callback().around_update(loop_state()) as entered:
        assert entered is None
    assert isinstance(Callback().around_update(loop_state()), contextlib.nullcontext)
