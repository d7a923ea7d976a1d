"""pilotrun/training/callbacks/checkpointing.py: the checkpoint callback owns its cadence (every N applied
updates, and the last round's save unless that step is already the newest) and saves what `checkpoint_state`
defines."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from pilotrun.config import load_run_config
from pilotrun.run.record import read_metrics_strict
from pilotrun.training.callbacks.checkpointing import CheckpointCallback
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.trainer import Trainer
from tests.training.callbacks.test_base import loop_state

ROOT = Path(__file__).resolve().parents[3]


def recipe(*overrides: str):
    return load_run_config(ROOT / "configs" / "smoke.yaml", [
        "train.num_threads=1", "train.max_steps=10", "train.log_every=5", "train.checkpoint_every=4",
        "train.eval_every=0", "train.keep_checkpoints=5", "optim.schedule.horizon=10", *overrides])


def test_the_cadence_and_the_last_round():
    callback = CheckpointCallback(4)
    assert callback.due(loop_state(step=8)) and not callback.due(loop_state(step=9))
    assert not callback.due(loop_state(step=8, applied=False))
    final = loop_state(step=9)
    final.final = True
    assert callback.due(final)  # the last state is saved off the cadence
    final.last_checkpoint_step = 9
    assert not callback.due(final)  # ... unless it is already the newest checkpoint
    resumed_at_the_end = loop_state(step=10, resumed_from=10)
    resumed_at_the_end.final, resumed_at_the_end.update = True, None
    assert not callback.due(resumed_at_the_end)  # a resume at max_steps has nothing new to save
    assert not CheckpointCallback(0).due(loop_state(step=8))  # 0: only at the end


@pytest.mark.slow
def test_a_session_saves_on_its_cadence_and_at_its_last_step_each_after_a_train_event(
    builtin_data_dir, tmp_path
):
    run_dir = tmp_path / "run"
    assert (
        Trainer(recipe(), builtin_data_dir, run_dir, progress=False, out=io.StringIO()).run().reason
        == "completed"
    )
    assert Checkpointer(run_dir, keep=5).committed_steps() == [4, 8, 10]
    events = [e for e in read_metrics_strict(run_dir) if e["event"] in ("train", "checkpoint")]
    assert [(e["event"], e["step"]) for e in events] == [
        ("train", 4), ("checkpoint", 4), ("train", 5), ("train", 8), ("checkpoint", 8), ("train", 10),
        ("checkpoint", 10)]
    for train, checkpoint in zip(events, events[1:]):
        if checkpoint["event"] == "checkpoint":  # the window closed first: the same counters
            assert train["event"] == "train" and train["tokens_seen"] == checkpoint["tokens_seen"]
    # Resumed at max_steps: the session has nothing to do and saves nothing new.
    again = Trainer(recipe(), builtin_data_dir, run_dir, resume=True, progress=False, out=io.StringIO())
    assert again.run().step == 10
    assert sum(e["event"] == "checkpoint" for e in read_metrics_strict(run_dir)) == 3
