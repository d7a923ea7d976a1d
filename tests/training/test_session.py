"""pilotrun/training/session.py: what a checkpoint holds (one definition for the save and the load), reading it
back into a session, and the session's small rules (tokens per update, the vocabulary, a new run folder)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from pilotrun.config import load_run_config
from pilotrun.errors import ConfigError
from pilotrun.training.checkpoint import Checkpointer
from pilotrun.training.dcp_storage import DCPStorage
from pilotrun.training.session import (
    check_run_dir_is_new,
    checkpoint_state,
    read_checkpoint,
    resolve_vocab,
    tokens_per_update,
)
from pilotrun.training.trainer import Trainer
from tests.exactness import assert_exactly_equal

ROOT = Path(__file__).resolve().parents[2]


def recipe(*overrides: str):
    return load_run_config(ROOT / "configs" / "smoke.yaml", ["train.num_threads=1", *overrides])


@pytest.fixture
def session(builtin_data_dir, tmp_path):
    session = Trainer(recipe(), builtin_data_dir, tmp_path / "run", progress=False, out=io.StringIO()).session
    yield session
    session.metrics.close()
    session.release_lock()


def test_checkpoint_state_holds_every_part_an_exact_resume_needs(session):
    state = checkpoint_state(session, sharded=False)
    assert list(state) == ["model", "optimizer", "scaler", "trainer", "rng"]
    assert state["trainer"] == session.state.state_dict()
    assert state["model"].keys() == session.raw_model.state_dict().keys()
    sharded = checkpoint_state(session, sharded=True)  # name-keyed DCP state dicts: the same parts
    assert list(sharded) == list(state)


@pytest.mark.parametrize("storage", [None, DCPStorage()], ids=["torch_save", "dcp"])
def test_read_checkpoint_puts_back_what_checkpoint_state_saved(session, storage):
    saved_weights = {k: v.clone() for k, v in session.raw_model.state_dict().items()}
    session.state.step, session.state.tokens_seen = 3, 384
    Checkpointer(session.run_dir, keep=2, storage=storage).save(3, checkpoint_state(session, sharded=storage is not None),
                                                                 {"step": 3})
    with torch.no_grad():
        for parameter in session.raw_model.parameters():
            parameter.add_(1.0)
    session.state.step, session.state.tokens_seen = 0, 0
    restored = read_checkpoint(session, 3)
    assert_exactly_equal(session.raw_model.state_dict(), saved_weights, "weights")
    assert restored["trainer"]["step"] == 3 and restored["trainer"]["tokens_seen"] == 384
    assert set(restored) == {"model", "optimizer", "scaler", "trainer", "rng"}


def test_tokens_per_update_and_the_vocabulary_rule():
    config = recipe("train.batch_size=4", "train.seq_len=32", "train.gradient_accumulation_steps=2")
    assert tokens_per_update(config, world_size=3) == 4 * 32 * 2 * 3
    assert resolve_vocab(config, 300).model.vocab_size == 300  # 0 in the recipe: the data's
    with pytest.raises(ConfigError, match="smaller than the data's vocabulary"):
        resolve_vocab(recipe("model.vocab_size=100"), 300)


def test_a_fresh_run_needs_a_new_or_empty_folder(tmp_path):
    check_run_dir_is_new(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    check_run_dir_is_new(tmp_path / "empty")
    (tmp_path / "empty" / "run.lock").write_text("")  # a refused attempt's lock file does not count
    check_run_dir_is_new(tmp_path / "empty")
    (tmp_path / "empty" / "run.json").write_text("{}")
    with pytest.raises(ConfigError, match="already exists"):
        check_run_dir_is_new(tmp_path / "empty")
