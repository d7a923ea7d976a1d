"""The thread count is a machine setting, not recipe: a run resumed on 2 threads after 1 continues free of
--allow-change. It is not promised to replay the 1-thread run bit for bit: on some CPUs the thread count
decides the order of a reduction's additions (a matmul's, the gradient norm's), so the last bit of a sum may
differ. The resume records the change in run.json (`not_exact`: the update from which bit-exactness is not
promised), and what holds on every machine is asserted: the same data in the same order, the same counters,
the updates before the change identical, a finite loss after it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import pilotrun
from pilotrun.config import MACHINE_KEYS, RESUME_FREE_KEYS

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"
COMMON = {
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.checkpoint_every": 0,
    "optim.schedule.horizon": 12,
}


def windows(run_dir: Path) -> dict[int, dict]:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: e for e in events if e["event"] == "train"}


def test_machine_settings_may_change_on_resume():
    assert "train.num_threads" in MACHINE_KEYS and set(MACHINE_KEYS) <= set(RESUME_FREE_KEYS)


@pytest.mark.slow
def test_a_resume_on_two_threads_is_recorded_as_where_bit_exactness_is_no_longer_promised(builtin_data_dir,
                                                                                           tmp_path):
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
        sessions = json.loads((resumed / "run.json").read_text())["sessions"]
        assert [s["hardware"]["torch_threads"] for s in sessions] == [1, 2]  # each session records its own
        assert "not_exact" not in sessions[0]
        assert sessions[1]["not_exact"] == {"from_update": 5, "changes": [
            {"key": "hardware.torch_threads", "old": 1, "new": 2}]}
        assert any("hardware.torch_threads changed (1 -> 2)" in note and "cannot be promised" in note
                   for note in sessions[1]["notes"])
        ours, theirs = windows(resumed), windows(straight)
        assert sorted(ours) == sorted(theirs) == list(range(1, 9))
        for step in range(1, 5):  # before the change: the same session's work on both sides
            assert ours[step]["loss"] == theirs[step]["loss"]
        for step in range(5, 9):  # after it: the same data and counters; the figures only as a machine allows
            assert all(ours[step][k] == theirs[step][k] for k in ("tokens_seen", "updates_attempted", "step"))
            assert math.isfinite(ours[step]["loss"])
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_a_resume_on_the_same_threads_records_no_change(builtin_data_dir, tmp_path):
    before = torch.get_num_threads()
    try:
        run = tmp_path / "run"
        pilotrun.train(SMOKE, data=builtin_data_dir, run_dir=run,
                       overrides={**COMMON, "train.max_steps": 2, "train.num_threads": 1})
        pilotrun.train(SMOKE, data=builtin_data_dir, run_dir=run, resume=True,
                       overrides={**COMMON, "train.max_steps": 3, "train.num_threads": 1})
        sessions = json.loads((run / "run.json").read_text())["sessions"]
        assert len(sessions) == 2 and all("not_exact" not in s for s in sessions)
    finally:
        torch.set_num_threads(before)
