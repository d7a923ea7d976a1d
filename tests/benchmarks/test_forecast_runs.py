"""The forecast benchmark's cooldown branches: their schedule goes on from the pilot's LR down to the floor,
and a branch is the pilot's own run resumed from its checkpoint in another folder (real `pilotrun train`
processes), read back by forecast_record.branch_input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import forecast_runs
from pilotrun.report.projection.forecast import multipliers
from pilotrun.report.projection.forecast_record import branch_input, val_points
from pilotrun.report.record_check.summarize import summarize_run

PILOT = {"kind": "cosine", "warmup_steps": 10, "horizon": 100, "min_lr_ratio": 0.1, "decay_fraction": 0.2}


@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
@pytest.mark.parametrize("length", [10, 25])
def test_a_cooldown_goes_on_from_the_pilots_lr_down_to_the_floor(kind, length):
    pilot = {**PILOT, "kind": kind}
    branch = {**pilot, **forecast_runs.cooldown_schedule(pilot, 50, length)}
    before, after = multipliers(pilot, 51), multipliers(branch, 51 + length)
    assert branch["kind"] == "wsd" and branch["horizon"] == 50 + length
    assert abs(after[50] - before[50]) < 0.02  # no jump at the branch point (whole updates: within one step)
    assert after[50 + length] == pytest.approx(0.1) and np.all(np.diff(after[50:]) < 0)


@pytest.mark.slow
def test_a_branch_is_the_pilots_run_resumed_from_its_checkpoint_in_its_own_folder(
    builtin_data_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(forecast_runs, "PILOT_STEPS", 20)  # checkpoints at 10 and 20
    monkeypatch.setattr(forecast_runs, "BRANCH_EVAL_EVERY", 2)
    case = forecast_runs.Case("cosine-s0", "cosine", 0)
    pilot_dir = forecast_runs.train_pilot(tmp_path, builtin_data_dir, case)
    branch_dir = forecast_runs.train_branch(tmp_path, builtin_data_dir, case, pilot_dir, 10, 6)
    pilot, branch = summarize_run(pilot_dir), summarize_run(branch_dir)
    run = json.loads((branch_dir / "run.json").read_text())
    assert run["run_id"] == pilot.run["run_id"] and run["sessions"][-1]["resumed_from"] == 10
    assert {c["key"] for c in run["allowed_changes"]} == {
        "optim.schedule.kind",
        "optim.schedule.horizon",
        "optim.schedule.decay_fraction",
    }
    assert branch.final.step == 16 and not (pilot_dir / "checkpoints" / "step-00000016").exists()
    shared = [p for p in val_points(pilot.kept_events) if p[0] <= 10]
    assert shared and [p for p in val_points(branch.kept_events) if p[0] <= 10] == shared  # bit for bit
    points, setting = branch_input(pilot, branch)
    assert setting.then[0] == 10 and setting.steps == 16 and setting.then[1]["kind"] == "wsd"
    assert [s for s, _ in points if s > 10] == [12, 14, 16]


@pytest.mark.slow
def test_a_replay_commits_the_pilots_own_model_between_its_checkpoints(
    builtin_data_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(forecast_runs, "PILOT_STEPS", 20)  # the pilot's checkpoints at 10 and 20
    monkeypatch.setattr(forecast_runs, "PILOT_EVAL_EVERY", 2)
    monkeypatch.setattr(forecast_runs, "ANNEAL_EVERY", 2)
    monkeypatch.setattr(forecast_runs, "BRANCH_EVAL_EVERY", 2)
    case = forecast_runs.Case("constant-s0", "constant", 0)
    work, other = tmp_path / "a", tmp_path / "b"
    for folder in (work, other):
        (folder / "runs").mkdir(parents=True)
    pilot_dir = forecast_runs.train_pilot(work, builtin_data_dir, case)
    replay_dir = forecast_runs.train_replay(work, builtin_data_dir, case, pilot_dir)
    assert sorted(p.name for p in (replay_dir / "checkpoints").iterdir()) == [
        f"step-{s:08d}" for s in range(10, 21, 2)
    ]
    pilot, replay = summarize_run(pilot_dir), summarize_run(replay_dir)
    assert val_points(replay.kept_events) == val_points(pilot.kept_events)  # bit for bit
    # a cooldown from the replay's last checkpoint is the one from the pilot's own, loss for loss
    from_pilot = forecast_runs.train_branch(work, builtin_data_dir, case, pilot_dir, 20, 4)
    from_replay = forecast_runs.train_branch(other, builtin_data_dir, case, replay_dir, 20, 4)
    ends = [val_points(summarize_run(d).kept_events) for d in (from_pilot, from_replay)]
    assert [s for s, _ in ends[0] if s > 20] == [22, 24] and ends[0] == ends[1]
