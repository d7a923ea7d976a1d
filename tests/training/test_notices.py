"""Start, resume and interrupt notices: the schedule against max_steps, a val split smaller than one
evaluation, what a resume restored, and the immediate answer to a first SIGINT."""

from __future__ import annotations

import io
import math
import signal
from pathlib import Path

import pytest

from pilotrun.config import load_run_config
from pilotrun.data.reader import tokens_per_evaluation, val_split_warnings
from pilotrun.optim.schedule import final_lr_multiplier, lr_multiplier, schedule_warnings
from pilotrun.run.marker import step_folder_name
from pilotrun.run.record import read_run_json
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.notices import interrupt_acknowledgement, restored_state_line
from pilotrun.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


def recipe(*overrides: str):
    return load_run_config(ROOT / "configs" / "stability.yaml", list(overrides))


def test_schedule_warning_only_when_max_steps_and_horizon_disagree():
    assert schedule_warnings(recipe()) == []
    assert schedule_warnings(recipe("train.max_steps=30", "optim.schedule.horizon=30")) == []
    assert schedule_warnings(recipe("train.max_steps=30", "optim.schedule.kind=constant")) == []
    assert len(schedule_warnings(recipe("train.max_steps=30"))) == 1
    assert len(schedule_warnings(recipe("train.max_steps=300"))) == 1


def test_final_lr_of_a_shortened_run_is_the_schedule_value_at_its_last_update():
    short = recipe("train.max_steps=30")
    assert final_lr_multiplier(short) == lr_multiplier(29, short.optim.schedule)
    assert final_lr_multiplier(short) > 0.9  # horizon 240: the cosine has barely started
    proper = recipe("train.max_steps=30", "optim.schedule.horizon=30")
    # warm-up 20, horizon 30: the last update is 9/10 of the way down the cosine to min_lr_ratio 0.1
    assert final_lr_multiplier(proper) == 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * 9 / 10))


def test_val_warning_at_exactly_one_evaluation():
    needed = tokens_per_evaluation(batch_size=8, seq_len=64, eval_batches=3)
    assert needed == 3 * 8 * 64 + 1
    assert val_split_warnings(needed, 8, 64, 3) == []
    assert len(val_split_warnings(needed - 1, 8, 64, 3)) == 1
    assert len(val_split_warnings(needed, 8, 64, 3, world_size=2)) == 1


@pytest.mark.slow
def test_resume_records_what_it_restored_and_warnings_in_run_json(builtin_data_dir, tmp_path):
    overrides = ["train.num_threads=1", "train.max_steps=2", "train.eval_every=0", "train.checkpoint_every=0"]
    config = load_run_config(ROOT / "configs" / "smoke.yaml", overrides)
    run_dir = tmp_path / "run"
    Trainer(config, builtin_data_dir, run_dir, progress=False, out=io.StringIO()).run()
    first_notes = read_run_json(run_dir)["sessions"][0]["notes"]
    assert schedule_warnings(config)[0] in first_notes  # max_steps 2, horizon 6
    state, _meta = Checkpointer(run_dir, keep=3).load(2)
    resumed = Trainer(load_run_config(ROOT / "configs" / "smoke.yaml", [*overrides[:1], "train.max_steps=3"]),
                      builtin_data_dir, run_dir, resume=True, progress=False, out=io.StringIO())
    expected = restored_state_line(run_dir / "checkpoints" / step_folder_name(2), state["trainer"], [],
                                   state["scaler"])
    assert expected in resumed.session.notes


@pytest.mark.slow
def test_first_sigint_is_acknowledged_at_once(builtin_data_dir, tmp_path, capsys):
    config = load_run_config(ROOT / "configs" / "smoke.yaml", ["train.num_threads=1", "train.max_steps=4"])
    trainer = Trainer(config, builtin_data_dir, tmp_path / "run", progress=False, out=io.StringIO())
    capsys.readouterr()
    trainer.signals.handle(signal.SIGINT, None)
    assert capsys.readouterr().err.strip() == interrupt_acknowledgement("SIGINT", 0, 4)
    assert trainer.signals.received == signal.SIGINT
    trainer.session.metrics.close()


def test_task_files_that_no_cadence_scores_are_warned_about():
    from pilotrun.training.notices import startup_warnings

    smoke = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
    unscored = load_run_config(
        smoke, ["train.downstream_tasks=[a.jsonl, b.jsonl]", "train.downstream_every=0"]
    )
    said = [w for w in startup_warnings(unscored, 10**6, 1) if "downstream" in w]
    assert said == [
        "warning: train.downstream.tasks names 2 task file(s) but train.downstream.every is 0: they "
        "are never scored in this run (set train.downstream.every, the updates between scorings, or "
        "`pilotrun evaluate` a checkpoint)"
    ]
    scored = load_run_config(smoke, ["train.downstream_tasks=[a.jsonl]", "train.downstream_every=5"])
    assert not [w for w in startup_warnings(scored, 10**6, 1) if "downstream" in w]
