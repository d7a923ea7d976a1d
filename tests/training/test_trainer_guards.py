"""What a skipped update, an evaluation and a checkpoint must NOT do, each checked on the real trainer.

Each test here exists because a plausible one-line bug (the expert bias moved on a skipped update, QK-Clip
applied to weights whose update was skipped, a run that never stops skipping, an evaluation that draws from
the training generators, a marker written before its files are durable) would otherwise pass the suite.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import pilotrun.training.precision as precision_module
from pilotrun.commands.cli import main
from pilotrun.config import load_run_config
from pilotrun.run.marker import MARKER_NAME
from pilotrun.training.callbacks.evaluation import evaluate
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.checkpoint.rng_state import capture_rng_state
from pilotrun.training.trainer import Trainer
from tests.exactness import assert_exactly_equal

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"


def _patch_apply_update_everywhere(monkeypatch, replacement) -> None:
    """Replace apply_update in every pilotrun.train module that imported it, wherever the loop lives."""
    original = precision_module.apply_update
    for name, module in list(sys.modules.items()):
        if name.startswith("pilotrun.") and getattr(module, "apply_update", None) is original:
            monkeypatch.setattr(module, "apply_update", replacement)


def _one_repeated_batch_config(*overrides: str):
    # repeat_batch: every attempt reads the same batch, so attempts skipped before the first applied update
    # leave that update exactly as it is in a run without them. tau far below any real logit: QK-Clip acts on
    # every applied update, so a clip on a skipped one would show in the weights.
    return load_run_config(SMOKE, ["train.num_threads=1", "train.data_mode=repeat_batch", "train.max_steps=2",
                                   "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0",
                                   "optim.qk_clip.tau=0.001", *overrides])


@pytest.mark.slow
def test_skipped_updates_move_neither_the_expert_bias_nor_qk_clip(builtin_data_dir, tmp_path, monkeypatch):
    clean = Trainer(_one_repeated_batch_config(), builtin_data_dir, tmp_path / "clean", progress=False)
    assert clean.run().reason == "completed"

    real_apply_update = precision_module.apply_update
    attempts = {"n": 0}

    def apply_update_with_three_nonfinite_gradients(model, optimizer, scaler, grad_clip, **options):
        # The first three attempts get an infinite gradient: a real skip through the real update function.
        attempts["n"] += 1
        if attempts["n"] <= 3:
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        return real_apply_update(model, optimizer, scaler, grad_clip, **options)

    _patch_apply_update_everywhere(monkeypatch, apply_update_with_three_nonfinite_gradients)
    skipping = Trainer(_one_repeated_batch_config(), builtin_data_dir, tmp_path / "skipping", progress=False)
    result = skipping.run()
    assert (result.reason, result.step, result.updates_attempted, result.updates_skipped) == (
        "completed",
        2,
        5,
        3,
    )

    clean_state, skipping_state = (
        clean.session.raw_model.state_dict(),
        skipping.session.raw_model.state_dict(),
    )
    biases = [name for name in clean_state if name.endswith("expert_bias")]
    assert biases, "the smoke model has MoE layers with an expert bias"
    assert any(clean_state[name].abs().sum() > 0 for name in biases)  # the bias did move on applied updates
    events = [json.loads(line) for line in (tmp_path / "clean" / "metrics.jsonl").read_text().splitlines()]
    assert sum(e["qk_clip"]["heads_clipped"] for e in events if e["event"] == "train") > 0  # clipping acted
    for name in clean_state:
        assert torch.equal(clean_state[name], skipping_state[name]), name


@pytest.mark.slow
def test_too_many_consecutive_skips_stop_the_run_with_exit_1_and_a_checkpoint(
    builtin_data_dir, tmp_path, capsys
):
    # fp16 with a loss scale no gradient survives: every attempt overflows.
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            "--config",
            str(SMOKE),
            "--data",
            str(builtin_data_dir),
            "--run-dir",
            str(run_dir),
            *[
                arg
                for key_value in (
                    "train.num_threads=1",
                    "train.precision=fp16",
                    "train.loss_scale_init=1e38",
                    "train.loss_scale_growth_interval=1000",
                    "train.max_consecutive_skips=3",
                    "train.max_steps=5",
                )
                for arg in ("--set", key_value)
            ],
        ]
    )
    capsys.readouterr()
    assert code == 1
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    end = events[-1]
    assert end["event"] == "session_end" and end["reason"] == "stopped"
    assert (end["step"], end["updates_attempted"], end["updates_skipped"]) == (0, 3, 3)
    assert [e["event"] for e in events].count("overflow") == 3
    assert Checkpointer(run_dir, keep=2).committed_steps() == [0]
    assert any(e["event"] == "checkpoint" and e["step"] == 0 for e in events)


@pytest.mark.slow
def test_evaluation_leaves_every_random_generator_and_the_training_cursor_untouched(
    builtin_data_dir, tmp_path
):
    config = load_run_config(SMOKE, ["train.num_threads=1", "train.eval_batches=3"])
    trainer = Trainer(config, builtin_data_dir, tmp_path / "run", progress=False)
    torch.manual_seed(1234)  # a state no earlier code left behind by chance
    before_rng, before_cursor = capture_rng_state(), dict(trainer.session.state.loader.state_dict())
    first = evaluate(trainer.session, trainer.config.train.eval)
    assert_exactly_equal(capture_rng_state(), before_rng)
    assert trainer.session.state.loader.state_dict() == before_cursor
    # the same batches every time
    assert evaluate(trainer.session, trainer.config.train.eval)["loss"] == first["loss"]


def test_every_checkpoint_file_is_fsynced_before_the_marker_is_renamed_into_place(tmp_path, monkeypatch):
    journal: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def recording_fsync(fd):
        journal.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def recording_rename(src, dst):
        journal.append(("rename", os.path.basename(str(dst))))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "rename", recording_rename)
    state = {"model": {"w": torch.ones(64, 64), "b": torch.zeros(64)}, "optimizer": {"m": torch.ones(64, 64)}}
    folder = Checkpointer(tmp_path, keep=1).save(7, state, {"note": "fsync order"})
    marker = json.loads((folder / MARKER_NAME).read_text())
    names = list(marker["files"])
    assert names
    marker_commit = journal.index(("rename", MARKER_NAME))
    synced_before_commit = {Path(path).name for kind, path in journal[:marker_commit] if kind == "fsync"}
    assert set(names) <= synced_before_commit
    # and the folder holding them was synced after they were renamed into place, before the marker
    folder_rename = journal.index(("rename", folder.name))
    assert any(kind == "fsync" and Path(path).name == "checkpoints"
               for kind, path in journal[folder_rename:marker_commit])
