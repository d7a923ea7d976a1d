"""pilotrun/training/pilot_handshake.py: when a training process stops itself for the pilot's kill, and how the
pilot sees that it has stopped. The whole handshake runs end to end in tests/commands/test_pilot.py."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from pilotrun.errors import ConfigError
from pilotrun.training.pilot_handshake import FREEZE_PAST_STEP_ENV, FreezePoint, wait_until_stopped


def test_the_freeze_point_is_read_from_the_environment_and_ignored_under_torchrun():
    assert FreezePoint.from_environment({}).past_step is None
    assert FreezePoint.from_environment({FREEZE_PAST_STEP_ENV: " 120 "}).past_step == 120
    assert FreezePoint.from_environment({FREEZE_PAST_STEP_ENV: "120"}, distributed=True).past_step is None
    with pytest.raises(ConfigError, match=f"{FREEZE_PAST_STEP_ENV}='12o': must be a whole number"):
        FreezePoint.from_environment({FREEZE_PAST_STEP_ENV: "12o"})


def test_the_freeze_is_due_past_the_step_after_a_checkpoint_with_updates_left():
    point = FreezePoint(3)
    assert point.due(logged_step=4, checkpoint_committed=True, step=4, max_steps=6)
    assert not point.due(logged_step=3, checkpoint_committed=True, step=3, max_steps=6)  # not past the step yet
    assert not point.due(logged_step=None, checkpoint_committed=True, step=4, max_steps=6)  # nothing logged
    assert not point.due(logged_step=4, checkpoint_committed=False, step=4, max_steps=6)  # nothing committed to resume from
    assert not point.due(logged_step=6, checkpoint_committed=True, step=6, max_steps=6)  # nothing left to redo
    assert not FreezePoint(None).due(logged_step=4, checkpoint_committed=True, step=4, max_steps=6)


def test_freeze_stops_the_process_once_and_sigcont_lets_it_carry_on():
    child = subprocess.Popen([sys.executable, "-c", (
        "from pilotrun.training.pilot_handshake import FreezePoint\n"
        "point = FreezePoint(1)\n"
        "point.freeze()\n"
        "print('continued', point.past_step, point.due(5, True, 5, 9), flush=True)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert wait_until_stopped(child.pid, timeout_seconds=120)  # a hang guard: it stops as soon as it runs
        assert child.poll() is None
        child.send_signal(signal.SIGCONT)
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert (child.returncode, out) == (0, "continued None False\n")


def test_a_process_that_exits_is_not_reported_stopped():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert wait_until_stopped(child.pid, timeout_seconds=5) is False
