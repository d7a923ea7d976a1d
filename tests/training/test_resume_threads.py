"""The thread count is a machine setting, not recipe: a run resumed on 2 threads after 1 continues free of
--allow-change, and replays the uninterrupted 1-thread run bit for bit (losses, weights, expert biases)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pilotrun
from pilotrun.config import MACHINE_KEYS, RESUME_FREE_KEYS

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"
COMMON = {"train.log_every": 1, "train.eval_every": 0, "train.checkpoint_every": 0, "optim.schedule.horizon": 12}


def losses(run_dir: Path) -> dict[int, float]:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: e["loss"] for e in events if e["event"] == "train"}


def test_machine_settings_may_change_on_resume():
    assert "train.num_threads" in MACHINE_KEYS and set(MACHINE_KEYS) <= set(RESUME_FREE_KEYS)


@pytest.mark.slow
def test_a_resume_on_two_threads_replays_the_one_thread_run_bit_for_bit(builtin_data_dir, tmp_path):
    before = torch.get_num_threads()
    try:
        straight = tmp_path / "straight"
        pilotrun.train(SMOKE, data=builtin_data_dir, run_dir=straight,
                       overrides={**COMMON, "train.max_steps": 8, "train.num_threads": 1})
        resumed = tmp_path / "resumed"
        pilotrun.train(SMOKE, data=builtin_data_dir, run_dir=resumed,
                       overrides={**COMMON, "train.max_steps": 4, "train.num_threads": 1})
        result = pilotrun.train(SMOKE, data=builtin_data_dir, run_dir=resumed, resume=True,
                                overrides={**COMMON, "train.max_steps": 8, "train.num_threads": 2})
        assert result.exit_code == 0
        assert losses(resumed) == losses(straight) and len(losses(straight)) == 8
        a, b = pilotrun.load_model(straight).state_dict(), pilotrun.load_model(resumed).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        sessions = json.loads((resumed / "run.json").read_text())["sessions"]
        assert [s["hardware"]["torch_threads"] for s in sessions] == [1, 2]  # each session records its own
    finally:
        torch.set_num_threads(before)
