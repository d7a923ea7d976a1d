"""pilotrun/training/callbacks/kill_point.py: when a training process stops itself for the pilot's kill, and
how the pilot sees that it has stopped (commands/pilot_process.wait_until_stopped). The whole handshake runs
end to end in tests/commands/test_pilot.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pilotrun.commands.pilot_process import wait_until_stopped
from pilotrun.config import load_run_config
from pilotrun.run.record import read_metrics_strict
from pilotrun.training.callbacks import kill_point as pilot_handshake
from pilotrun.training.callbacks.base import PRIORITY_CHECKPOINT
from pilotrun.training.callbacks.kill_point import KillPointCallback, SelfStopPoint
from pilotrun.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]


def test_the_kill_point_is_handed_in():
    assert KillPointCallback.past_step(None).point.past_step is None
    assert KillPointCallback.past_step(120).point.past_step == 120
    assert KillPointCallback.priority > PRIORITY_CHECKPOINT  # it waits for the checkpoint of the same round


@pytest.mark.slow
def test_the_kill_point_stops_at_the_first_logged_step_past_its_step_once_a_checkpoint_committed(
        builtin_data_dir, tmp_path, monkeypatch):
    """A real session with the kill point at step 4, windows every 4 updates and checkpoints every 3 (each
    also closing a window): step 3 is logged and committed but not past 4, step 4 is logged but not past it,
    so the freeze comes at step 6, the first logged step past 4, with its checkpoint committed in the same
    round. The SIGSTOP is recorded instead of sent, so the session carries on as after SIGCONT, and freezes
    only once."""
    frozen = []
    trainer = None

    def recording_kill(pid, signum):
        frozen.append(
            (signum, trainer.session.state.step, trainer.session.checkpointer.committed_steps()[-1])
        )

    monkeypatch.setattr(pilot_handshake.os, "kill", recording_kill)
    config = load_run_config(ROOT / "configs" / "smoke.yaml", [
        "train.num_threads=1", "train.max_steps=10", "train.log_every=4", "train.checkpoint_every=3",
        "train.eval_every=0", "optim.schedule.horizon=10"])
    trainer = Trainer(config, builtin_data_dir, tmp_path / "run", progress=False, stop_past_step=4)
    assert trainer.run().reason == "completed"
    assert frozen == [(signal.SIGSTOP, 6, 6)]
    events = read_metrics_strict(tmp_path / "run")
    assert [e["step"] for e in events if e["event"] == "train"] == [3, 4, 6, 8, 9, 10]


def test_the_freeze_is_due_past_the_step_after_a_checkpoint_with_updates_left():
    point = SelfStopPoint(3)
    assert point.due(logged_step=4, checkpoint_committed=True, step=4, max_steps=6)
    # not past the step yet
    assert not point.due(logged_step=3, checkpoint_committed=True, step=3, max_steps=6)
    assert not point.due(logged_step=None, checkpoint_committed=True, step=4, max_steps=6)  # nothing logged
    # nothing committed to resume from
    assert not point.due(logged_step=4, checkpoint_committed=False, step=4, max_steps=6)
    # nothing left to redo
    assert not point.due(logged_step=6, checkpoint_committed=True, step=6, max_steps=6)
    assert not SelfStopPoint(None).due(logged_step=4, checkpoint_committed=True, step=4, max_steps=6)


@pytest.mark.slow
def test_freeze_stops_the_process_once_and_sigcont_lets_it_carry_on():
    child = subprocess.Popen([sys.executable, "-c", (
        "from pilotrun.training.callbacks.kill_point import SelfStopPoint\n"
        "point = SelfStopPoint(1)\n"
        "point.stop_self()\n"
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
