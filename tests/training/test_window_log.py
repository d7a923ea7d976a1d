"""pilotrun/training/window_log.py: when a window closes into a `train` event, and the rare events after an update."""

from __future__ import annotations

import io
from pathlib import Path

from pilotrun.config import load_run_config
from pilotrun.run.record import read_metrics_strict
from pilotrun.training.callbacks import LoopState, UpdateResult
from pilotrun.training.loop import train_loop
from pilotrun.training.precision import UpdateOutcome
from pilotrun.training.signals import StopSignals
from pilotrun.training.timing import TimeAccount
from pilotrun.training.trainer import Trainer
from pilotrun.training.window_log import RareEventsCallback, WindowLogCallback
from tests.training.test_callbacks import loop_state

ROOT = Path(__file__).resolve().parents[2]


def test_a_window_closes_on_its_cadence_before_a_checkpoint_and_at_the_last_round():
    callback = WindowLogCallback(log_every=5, checkpoint_every=3)
    assert callback.due(loop_state(step=5)) and callback.due(loop_state(step=3))
    assert not callback.due(loop_state(step=4)) and not callback.due(loop_state(step=5, applied=False))
    final = loop_state(step=4)
    final.final = True
    assert callback.due(final)


def test_rare_events_are_due_after_a_restart_a_skip_or_a_hook_event():
    callback = RareEventsCallback()
    loop = loop_state(step=4)
    assert not callback.due(loop)
    loop.update.restarted = 1
    assert callback.due(loop)
    assert callback.due(loop_state(step=4, applied=False))
    loop = loop_state(step=4)
    loop.update.hook_events.append({"layer": 0})
    assert callback.due(loop)
    loop.update = None
    assert not callback.due(loop)


def test_train_events_partition_the_session_into_windows(builtin_data_dir, tmp_path):
    config = load_run_config(ROOT / "configs" / "smoke.yaml", [
        "train.num_threads=1", "train.max_steps=7", "train.log_every=3", "train.eval_every=0",
        "train.checkpoint_every=0"])
    session = Trainer(config, builtin_data_dir, tmp_path / "run", progress=False, out=io.StringIO()).session
    loop = LoopState(session, TimeAccount(), StopSignals(), io.StringIO())
    try:
        train_loop(loop, [WindowLogCallback(log_every=3, checkpoint_every=0)])
    finally:
        session.metrics.close()
        session.release_lock()
    trains = [e for e in read_metrics_strict(tmp_path / "run") if e["event"] == "train"]
    assert [e["step"] for e in trains] == [3, 6, 7] and loop.logged_step == 7
    assert [e["window"]["updates_applied"] for e in trains] == [3, 3, 1]
    assert sum(e["window"]["train_seconds"] for e in trains) == loop.account.time_split()["train_seconds"]
    assert loop.window.attempted == 0  # a fresh window after the last close


def test_an_overflow_event_names_the_skip(builtin_data_dir, tmp_path):
    session = Trainer(load_run_config(ROOT / "configs" / "smoke.yaml", ["train.num_threads=1"]), builtin_data_dir,
                      tmp_path / "run", progress=False, out=io.StringIO()).session
    loop = LoopState(session, TimeAccount(), StopSignals(), io.StringIO())
    loop.update = UpdateResult(UpdateOutcome(False, "overflow", float("inf"), False, 1024.0, 512.0), restarted=1)
    RareEventsCallback().after_update(loop)
    session.metrics.close()
    session.release_lock()
    events = read_metrics_strict(tmp_path / "run")
    assert [e["event"] for e in events] == ["data_restart", "overflow"]
    assert events[1]["loss_scale_before"] == 1024.0 and events[1]["loss_scale_after"] == 512.0
    assert session.state.data_restarts == 1
