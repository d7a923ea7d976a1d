"""The replay that names a spike's cause, on the real trainer: a gradient corrupted once (after the backward,
as a faulty device would) is not reproduced by the replay and is classified so, with the rank named; an update
replayed from the state it started from reproduces its loss and gradient norm bit for bit."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pilotrun.config import load_run_config
from pilotrun.training.replay import compute_update
from tests.training.spike_faults import corrupt_gradient_once

ROOT = Path(__file__).resolve().parents[2]


def make_trainer(data_dir, run_dir, *extra):
    from pilotrun.training.trainer import Trainer

    config = load_run_config(
        ROOT / "configs" / "smoke.yaml",
        [
            "train.num_threads=1",
            "train.max_steps=14",
            "train.checkpoint_every=0",
            "train.eval_every=0",
            "train.log_every=1",
            "optim.schedule.horizon=14",
            "train.spike.min_history=8",
            "train.spike.window=20",
            *extra,
        ],
    )
    return Trainer(config, data_dir, run_dir, progress=False, out=io.StringIO())


@pytest.mark.slow
def test_a_gradient_corrupted_once_is_not_reproducible_and_its_rank_is_named(builtin_data_dir, tmp_path,
                                                                              monkeypatch):
    corrupt_gradient_once(12, monkeypatch=monkeypatch)
    trainer = make_trainer(builtin_data_dir, tmp_path / "run", "train.spike.policy=skip")
    result = trainer.run()
    assert result.reason == "completed" and result.updates_skipped == 1
    spikes = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "spike"]
    (spike,) = spikes
    assert spike["spike_step"] == 12 and spike["signals"] == ["grad_norm"] and spike["action"] == "skipped"
    replay = spike["replay"]
    assert replay["cause"] == "not_reproducible" and replay["ranks_differing"] == [0]
    assert replay["same_batch"][0][0] < spike["grad_norm"] / 100 and replay["next_batch"] is None
    assert "hardware" in replay["explanation"]


@pytest.mark.slow
def test_an_update_computed_again_gives_the_same_figures_bit_for_bit(builtin_data_dir, tmp_path):
    trainer = make_trainer(builtin_data_dir, tmp_path / "run", "train.max_steps=3")
    trainer.run()
    session = trainer.session
    cursor = session.state.loader.batch_index
    first = compute_update(session, [cursor])
    again = compute_update(session, [cursor])
    assert first == again and len(first) == 1 and first[0][0] > 0 and first[0][1] > 0


@pytest.mark.slow
def test_a_broken_model_state_recurs_on_the_next_batches_too_and_is_named_so(builtin_data_dir, tmp_path,
                                                                             monkeypatch):
    """After the 11th update the final norm's gain is multiplied by 40 (a state gone bad, as a diverged run's
    is): the 12th attempt spikes, and its replay spikes on its own batches and on the next ones:
    "model_state"."""
    import torch

    import pilotrun.training.loop as loop_module

    original, calls = loop_module.apply_update, [0]

    def apply_then_break(model, *args, **kwargs):
        outcome = original(model, *args, **kwargs)
        calls[0] += 1
        if calls[0] == 11:
            with torch.no_grad():
                dict(model.named_parameters())["norm.weight"].mul_(40.0)
        return outcome

    monkeypatch.setattr(loop_module, "apply_update", apply_then_break)
    trainer = make_trainer(
        builtin_data_dir, tmp_path / "run", "train.spike.policy=record", "train.max_steps=12"
    )
    trainer.run()
    spikes = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "spike"]
    assert [s["spike_step"] for s in spikes] == [12] and "loss" in spikes[0]["signals"], spikes
    replay = spikes[0]["replay"]
    assert replay["cause"] == "model_state" and replay["bitwise"] is True
    assert replay["next_batches"] and replay["next_batch"][0][1] > replay["same_batch"][0][1] / 2
    assert "the model state is the cause" in replay["explanation"]
