"""The LR schedule is a pure function of applied updates and its own horizon, never of max_steps or
attempts."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import torch

from pilotrun.config import ScheduleConfig
from pilotrun.optim.muon_adamw import MuonAdamW
from pilotrun.optim.schedule import expert_bias_speed, lr_multiplier, set_learning_rates


def test_linear_warmup_then_cosine_to_floor():
    cfg = ScheduleConfig(kind="cosine", warmup_steps=4, horizon=14, min_lr_ratio=0.1)
    values = [lr_multiplier(s, cfg) for s in range(20)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[4] == 1.0  # cosine starts at its peak
    assert values[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert values[14] == pytest.approx(0.1) and values[19] == pytest.approx(0.1)  # held past the horizon
    assert all(a >= b for a, b in zip(values[4:], values[5:]))  # monotone decay


def test_wsd_is_flat_then_decays_linearly_in_the_last_fraction():
    cfg = ScheduleConfig(kind="wsd", warmup_steps=2, horizon=20, min_lr_ratio=0.0, decay_fraction=0.25)
    values = [lr_multiplier(s, cfg) for s in range(25)]
    assert values[:2] == [0.5, 1.0]
    assert all(v == 1.0 for v in values[2:15])
    assert values[15:21] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])
    assert values[24] == 0.0


def test_constant_and_zero_warmup():
    cfg = ScheduleConfig(kind="constant", warmup_steps=0, horizon=5)
    assert [lr_multiplier(s, cfg) for s in range(8)] == [1.0] * 8


def test_schedule_does_not_depend_on_max_steps_or_attempts():
    # The multiplier is a function of (applied step, schedule) only: its signature admits nothing else, and
    # its values are the closed forms of the module docstring, written out here independently.
    assert list(inspect.signature(lr_multiplier).parameters) == ["step", "schedule_cfg"]
    cfg = ScheduleConfig(kind="cosine", warmup_steps=4, horizon=44, min_lr_ratio=0.1)
    assert [lr_multiplier(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    for step in (4, 14, 24, 34, 44):
        expected = 0.1 + (1.0 - 0.1) * 0.5 * (1.0 + math.cos(math.pi * ((step - 4) / 40)))
        assert lr_multiplier(step, cfg) == expected
    assert lr_multiplier(24, cfg) == 0.1 + (1.0 - 0.1) * 0.5  # the middle of the decay
    assert lr_multiplier(10_000, cfg) == 0.1  # past the horizon it holds the floor
    with pytest.raises(ValueError):
        lr_multiplier(-1, cfg)


@pytest.mark.slow
def test_trainer_learning_rate_follows_applied_updates_not_max_steps(builtin_data_dir, tmp_path):
    """Two real runs that differ only in max_steps log the same learning rate at every step they share."""
    from pilotrun.config import load_run_config
    from pilotrun.training.trainer import Trainer

    smoke = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
    logged = []
    for max_steps in (4, 8):
        config = load_run_config(
            smoke,
            [
                "train.num_threads=1",
                f"train.max_steps={max_steps}",
                "train.log_every=1",
                "train.eval_every=0",
                "train.checkpoint_every=0",
                "optim.schedule.horizon=8",
                "optim.schedule.warmup_steps=2",
            ],
        )
        Trainer(config, builtin_data_dir, tmp_path / f"run-{max_steps}", progress=False).run()
        events = [
            json.loads(line)
            for line in (tmp_path / f"run-{max_steps}" / "metrics.jsonl").read_text().splitlines()
        ]
        logged.append({e["step"]: e["lr"] for e in events if e["event"] == "train"})
    short, long = logged
    assert sorted(short) == [1, 2, 3, 4] and all(long[step] == lr for step, lr in short.items())
    assert long[8] < long[4]  # the longer run went on decaying along the same curve


def test_set_learning_rates_scales_each_group_from_its_base_lr():
    a, b = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    opt = MuonAdamW([{"params": [a], "use_muon": True, "lr": 0.02, "base_lr": 0.02},
                     {"params": [b], "use_muon": False, "lr": 0.001, "base_lr": 0.001}])
    cfg = ScheduleConfig(kind="cosine", warmup_steps=10, horizon=100)
    multiplier = set_learning_rates(opt, 4, cfg)
    assert multiplier == 0.5
    assert opt.param_groups[0]["lr"] == 0.02 * 0.5 and opt.param_groups[1]["lr"] == 0.001 * 0.5
    set_learning_rates(opt, 4, cfg)  # idempotent
    assert opt.param_groups[0]["lr"] == 0.02 * 0.5


def test_set_learning_rates_requires_base_lr():
    opt = MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(3))], "use_muon": False}])
    with pytest.raises(ValueError, match="base_lr"):
        set_learning_rates(opt, 0, ScheduleConfig())


def test_expert_bias_stops_moving_in_the_final_fraction_of_the_horizon():
    cfg = ScheduleConfig(horizon=100, bias_freeze_fraction=0.03)
    speeds = [expert_bias_speed(step, 1e-3, cfg) for step in range(110)]
    assert speeds[:97] == [1e-3] * 97  # updates 0..96 move the bias
    assert speeds[97:] == [0.0] * 13  # the last 3 of the horizon and everything past it do not
    assert [
        expert_bias_speed(s, 1e-3, ScheduleConfig(horizon=100, bias_freeze_fraction=0.0))
        for s in (0, 99, 150)
    ] == [1e-3] * 3
    # 0.3 -> 0 steps
    assert expert_bias_speed(9, 1e-3, ScheduleConfig(horizon=10, bias_freeze_fraction=0.03)) == 1e-3
