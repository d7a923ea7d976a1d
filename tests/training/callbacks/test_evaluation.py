"""pilotrun/training/callbacks/evaluation.py: the val loss over the same first batches, and its cadence."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from pilotrun.config import load_run_config
from pilotrun.run.record import read_metrics_strict
from pilotrun.training.callbacks.base import LoopState
from pilotrun.training.callbacks.evaluation import EvalCallback, evaluate
from pilotrun.training.loop import train_loop
from pilotrun.training.signals import StopSignals
from pilotrun.training.timing import TimeAccount
from pilotrun.training.trainer import Trainer
from tests.training.callbacks.test_base import loop_state

ROOT = Path(__file__).resolve().parents[3]


def test_evaluation_is_due_on_its_cadence_only_after_an_applied_update():
    callback = EvalCallback(SimpleNamespace(every=3))  # train.eval
    assert callback.phase == "eval"
    assert callback.due(loop_state(step=6)) and not callback.due(loop_state(step=7))
    assert not callback.due(loop_state(step=6, applied=False))
    assert not EvalCallback(SimpleNamespace(every=0)).due(loop_state(step=6))


@pytest.mark.slow
def test_evaluation_reads_the_same_batches_and_is_logged_on_its_cadence(builtin_data_dir, tmp_path):
    config = load_run_config(ROOT / "configs" / "smoke.yaml", [
        "train.num_threads=1", "train.max_steps=4", "train.eval_every=2", "train.eval_batches=3",
        "train.checkpoint_every=0"])
    session = Trainer(config, builtin_data_dir, tmp_path / "run", progress=False, out=io.StringIO()).session
    first, second = evaluate(session, config.train.eval), evaluate(session, config.train.eval)
    assert first["loss"] == second["loss"] and session.raw_model.training
    assert (first["batches"], first["tokens"]) == (3, 3 * session.tokens_per_microbatch)
    loop = LoopState(session, TimeAccount(), StopSignals(), io.StringIO())
    try:
        train_loop(loop, [EvalCallback(config.train.eval)])
    finally:
        session.metrics.close()
        session.release_lock()
    vals = [e for e in read_metrics_strict(tmp_path / "run") if e["event"] == "val"]
    assert [e["step"] for e in vals] == [2, 4] and loop.last_val_loss == vals[-1]["loss"]
    assert vals[0]["loss"] != first["loss"]  # the model trained in between
    assert loop.account.time_split()["eval_seconds"] > 0


def test_a_mixtures_loss_is_finite_for_weights_near_a_floats_limit_and_unchanged_otherwise():
    import math

    from pilotrun.training.callbacks.evaluation import weighted_mean

    assert weighted_mean([0.7, 0.3], [5.0, 7.0]) == (0.7 * 5.0 + 0.3 * 7.0) / 1.0  # the plain formula's bits
    assert weighted_mean([2.0, 1.0], [5.0, 7.0]) == (2.0 * 5.0 + 1.0 * 7.0) / 3.0
    huge = weighted_mean([1.0e308, 1.0], [6.0, 7.0])
    assert math.isfinite(huge) and huge == 6.0  # 1 beside 1e308 weighs nothing a float can hold
    assert math.isnan(weighted_mean([1.0, 1.0], [math.nan, 7.0]))  # a non-finite source loss stays what it is
