"""Once the watchdog declares its rank hung (the session ended on the record), a main thread whose stall ends
afterwards goes no further than its next progress point until the exit: nothing of an ended session
follows."""

from __future__ import annotations

import threading

from pilotrun.training.callbacks.hang_watchdog import HangBounds
from tests.training.callbacks.test_hang_watchdog import watchdog


def test_a_stall_that_ends_after_the_watchdog_fired_stops_at_its_next_progress_point(tmp_path):
    dog, clock, exits = watchdog(tmp_path, HangBounds(steady=10.0, startup=10.0))
    released, exit_now = threading.Event(), threading.Event()
    dog.exit = lambda code: (exits.append(code), exit_now.wait(30))
    dog.beat("update")
    clock.now += 11
    firing = threading.Thread(target=dog.check)
    firing.start()
    while dog.fired is None:
        firing.join(0.01)
    # the stall ended: a progress point
    beat = threading.Thread(target=lambda: (dog.beat("other"), released.set()))
    beat.start()
    assert not released.wait(0.5) and exits == [124]  # held: the exit is under way
    exit_now.set()  # the exit returns (a seam's; os._exit never does): the held progress point goes on
    assert released.wait(30)
    firing.join(30)
    beat.join(30)
