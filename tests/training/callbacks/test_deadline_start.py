"""training/callbacks/deadline_stop.py before the first update: the margin's save is the run's last measured
one (not this session's set-up), and a session whose set-up spent the time a save needs trains nothing and
ends `deadline` (75) at once, rather than committing after its deadline."""

from __future__ import annotations

import types

from pilotrun.common.stop_signals import DEADLINE_EXIT_CODE
from pilotrun.training.callbacks.deadline_stop import DeadlineCallback
from tests.training.callbacks.test_deadline_stop import Clock


def loop_at(step: int, max_steps: int = 100):
    train = types.SimpleNamespace(max_steps=max_steps)
    session = types.SimpleNamespace(config=types.SimpleNamespace(train=train))
    return types.SimpleNamespace(step=step, last_save_seconds=None, session=session)


def test_the_margin_counts_the_runs_last_measured_save_not_the_set_up():
    clock = Clock()
    callback = DeadlineCallback(clock.now + 600, setup_seconds=15.0, clock=clock, recorded_save_seconds=0.5)
    assert callback.margin(loop_at(36)) == 0.5
    fresh = DeadlineCallback(clock.now + 600, setup_seconds=15.0, clock=clock)
    assert fresh.margin(loop_at(0)) == 15.0  # a run that never saved: the set-up stands for the save
    saved = loop_at(40)
    saved.last_save_seconds = 2.0
    assert callback.margin(saved) == 2.0  # this session's own save, once it has one


def test_a_session_whose_set_up_spent_the_time_left_trains_nothing():
    clock = Clock()
    callback = DeadlineCallback(clock.now + 1.0, setup_seconds=5.0, clock=clock, recorded_save_seconds=3.0)
    ending = callback.too_late_to_start(loop_at(36))
    assert (ending.reason, ending.exit_code) == ("deadline", DEADLINE_EXIT_CODE)
    assert ending.message.startswith(
        "deadline in 1.0 s after the set-up, less than a save (3.0 s): nothing trained"
    )
    roomy = DeadlineCallback(clock.now + 60.0, setup_seconds=5.0, clock=clock, recorded_save_seconds=3.0)
    assert roomy.too_late_to_start(loop_at(36)) is None


def test_a_session_resumed_at_max_steps_is_not_stopped_by_its_deadline():
    """Plain `--resume` of a complete run trains nothing and completes (0); a `deadline` (75) there would have
    a scheduler requeue it for ever."""
    clock = Clock()
    callback = DeadlineCallback(clock.now + 1.0, setup_seconds=5.0, clock=clock, recorded_save_seconds=3.0)
    assert callback.too_late_to_start(loop_at(36, max_steps=36)) is None
    assert callback.too_late_to_start(loop_at(35, max_steps=36)).exit_code == DEADLINE_EXIT_CODE
