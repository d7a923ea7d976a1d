"""training/callbacks/deadline_stop.py: the margin is measured in the session, and the stop comes before the
deadline."""

from __future__ import annotations

import types

from pilotrun.common.stop_signals import DEADLINE_EXIT_CODE
from pilotrun.training.callbacks.deadline_stop import DeadlineCallback


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def attempt(callback: DeadlineCallback, loop, clock: Clock, update_s: float, round_s: float):
    with callback.around_update(loop):
        clock.now += update_s
    decision = callback.stop_request(loop)
    clock.now += round_s
    return decision


def test_the_margin_is_twice_the_slowest_update_and_round_and_the_last_save():
    clock = Clock()
    loop = types.SimpleNamespace(last_save_seconds=None, step=0)
    callback = DeadlineCallback(1100.0, setup_seconds=7.0, clock=clock)
    assert callback.margin(loop) == 7.0  # before any update or save: the set-up stands for the save
    attempt(callback, loop, clock, 30.0, 5.0)  # the first update (warm-up) is left out
    assert callback.margin(loop) == 7.0
    attempt(callback, loop, clock, 2.0, 4.0)
    attempt(callback, loop, clock, 3.0, 1.0)
    assert callback.margin(loop) == 2 * (3.0 + 5.0) + 7.0
    loop.last_save_seconds = 4.0
    assert callback.margin(loop) == 2 * (3.0 + 5.0) + 4.0


def test_it_asks_to_stop_once_one_more_round_and_the_save_would_not_fit():
    clock = Clock()
    loop = types.SimpleNamespace(last_save_seconds=2.0, step=0)
    callback = DeadlineCallback(1030.0, setup_seconds=0.0, clock=clock)
    asked = []
    while not asked:
        loop.step += 1
        decision = attempt(callback, loop, clock, 2.0, 1.0)
        if decision is not None:
            asked.append((loop.step, clock.now - 1.0, decision))
    step, at, ending = asked[0]
    assert (ending.reason, ending.exit_code) == ("deadline", DEADLINE_EXIT_CODE)
    assert at + callback.margin(loop) >= 1030.0 and at - 3.0 + callback.margin(loop) < 1030.0
    assert f"checkpoint step {step}" in ending.message
    assert at + 1.0 + 2.0 < 1030.0  # the last round (1 s) with its save (2 s) lands before the deadline


def test_a_negative_setup_reading_counts_as_none():
    assert DeadlineCallback(1.0, setup_seconds=-3.0).setup_seconds == 0.0
