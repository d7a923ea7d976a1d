"""pilotrun/training/session.py: what a checkpoint holds (one definition for the save and the load), reading
it back into a session, and the session's small rules (tokens per update, the vocabulary, a new run
folder)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from pilotrun.common.errors import ConfigError
from pilotrun.config import load_run_config
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.checkpoint.dcp_storage import DCPStorage
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


@pytest.mark.slow
def test_checkpoint_state_holds_every_part_an_exact_resume_needs(session):
    state = checkpoint_state(session, sharded=False)
    assert list(state) == ["model", "optimizer", "scaler", "trainer", "rng"]
    assert state["trainer"] == session.state.state_dict()
    assert state["model"].keys() == session.raw_model.state_dict().keys()
    sharded = checkpoint_state(session, sharded=True)  # name-keyed DCP state dicts: the same parts
    assert list(sharded) == list(state)


@pytest.mark.slow
@pytest.mark.parametrize("storage", [None, DCPStorage()], ids=["torch_save", "dcp"])
def test_read_checkpoint_puts_back_what_checkpoint_state_saved(session, storage):
    saved_weights = {k: v.clone() for k, v in session.raw_model.state_dict().items()}
    session.state.step, session.state.tokens_seen = 3, 384
    Checkpointer(session.run_dir, keep=2, storage=storage).save(
        3, checkpoint_state(session, sharded=storage is not None), {"step": 3}
    )
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
    with pytest.raises(
        ConfigError, match="already exists: pass --resume .* or from step 0 when it has none.* delete"
    ):
        check_run_dir_is_new(tmp_path / "empty")


# The first training process stops itself where its first checkpoint would be written, so the SIGKILL that
# follows lands before any checkpoint exists (deterministically: no race with the save).
STOP_BEFORE_FIRST_CHECKPOINT = (
    "import os, signal, sys\n"
    "from pilotrun.training.callbacks import checkpointing\n"
    "checkpointing.save_checkpoint = lambda loop: os.kill(os.getpid(), signal.SIGSTOP)\n"
    "from pilotrun.commands.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.slow
def test_resume_with_no_committed_checkpoint_starts_again_at_zero_naming_the_lost_updates(
    builtin_data_dir, tmp_path
):
    import json
    import os
    import subprocess
    import sys

    from pilotrun.commands.pilot_process import wait_until_stopped
    from pilotrun.report.record_check.summarize import format_summary, summarize_run

    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        [
            sys.executable,
            "-c",
            STOP_BEFORE_FIRST_CHECKPOINT,
            "train",
            "--config",
            "smoke",
            "--data",
            str(builtin_data_dir),
            "--run-dir",
            str(run_dir),
            "--set",
            "train.num_threads=1",
            "--progress",
            "none",
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_until_stopped(first.pid, timeout_seconds=240)  # a hang guard
    finally:
        first.kill()
        first.wait()
    assert not (run_dir / "checkpoints").is_dir() or not any((run_dir / "checkpoints").iterdir())

    with pytest.raises(ConfigError, match="pass --resume"):
        Trainer(recipe(), builtin_data_dir, run_dir, progress=False)
    trainer = Trainer(recipe(), builtin_data_dir, run_dir, resume=True, progress=False, out=io.StringIO())
    assert trainer.session.state.step == 0 and trainer.session.resumed_from is None
    assert trainer.session.restart["lost_updates"] == 3  # the smoke recipe checkpoints every 3 updates
    assert any("no committed checkpoint" in note for note in trainer.session.notes)
    assert trainer.run().reason == "completed"

    run = json.loads((run_dir / "run.json").read_text())
    killed, restarted = run["sessions"]
    assert restarted["restart"] == {
        "lost_updates": 3,
        "lost_tokens": 3 * 128,
        "after_session": killed["session_id"],
    }
    summary = summarize_run(run_dir, require_step=6)
    assert summary.valid, summary.reasons
    assert [s.status for s in summary.sessions] == ["rolled back", "kept"]
    assert summary.overall["updates_rolled_back"] == 3 and summary.overall["updates_applied"] == 6
    assert any("no committed checkpoint" in note and "3 update(s)" in note for note in summary.notes)
    text = format_summary(summary)
    assert killed["session_id"] in text and f"{restarted['session_id']} (latest)" in text  # whole ids
    assert " restart kept " in text.splitlines()[5]


def test_a_restart_claiming_other_lost_work_is_refused_by_summarize(builtin_data_dir, tmp_path):
    from pilotrun.report.record_check.summarize import _check_restart
    from pilotrun.run.record import Counters

    groups = {"a": [{"event": "session_start"}], "b": [{"event": "session_start", "restart": {
        "lost_updates": 5, "lost_tokens": 640, "after_session": "a"}}]}
    checked = {"a": {"last": Counters(step=3, tokens_seen=384)}, "b": {"last": Counters()}}
    reasons, notes = [], []
    _check_restart("b", 1, ["a", "b"], groups, checked, reasons, notes)
    assert len(reasons) == 1 and "names 5 update(s)" in reasons[0] and not notes


@pytest.mark.slow
def test_num_threads_0_runs_with_the_default_and_the_session_records_it(
    builtin_data_dir, tmp_path, monkeypatch
):
    from pilotrun.training import session as session_module

    before = torch.get_num_threads()
    from pilotrun.training import thread_choice

    monkeypatch.setattr(session_module, "default_threads", lambda local_ranks: 1 if local_ranks == 1 else 99)
    # One core in the affinity: the only candidate, nothing to measure.
    monkeypatch.setattr(thread_choice, "default_threads", lambda local_ranks: 1 if local_ranks == 1 else 99)
    try:
        torch.set_num_threads(2)
        trainer = Trainer(recipe("train.num_threads=0"), builtin_data_dir, tmp_path / "run", progress=False)
        assert torch.get_num_threads() == 1 and trainer.session.hardware["torch_threads"] == 1
        trainer.session.release_lock()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["user", "data"])
def test_a_folder_that_is_not_a_run_is_refused_untouched_without_a_suggestion_to_delete_it(tmp_path, kind):
    from pilotrun.common.errors import ConfigError
    from pilotrun.training.session import check_run_dir_is_new

    folder = tmp_path / kind
    folder.mkdir()
    names = (
        ["notes.txt"] if kind == "user" else ["metadata.json", "train_00000.npy", "val_00000.npy", "x.json"]
    )
    for name in names:
        (folder / name).write_text("mine")
    with pytest.raises(ConfigError) as refused:
        check_run_dir_is_new(folder)
    message = str(refused.value)
    assert (
        f"--run-dir {folder} is not a run folder (it holds {names[0]}" in message and "delete" not in message
    )
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)
    assert all((folder / name).read_text() == "mine" for name in names)
