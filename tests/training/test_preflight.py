"""Before the first update, through `pilotrun train` (cli.main in process): a run folder that cannot take a
checkpoint, a disk without room for one, and a link where the session writes are one line and exit 2, with
nothing written (no run.json, no checkpoints/, the outside file unchanged)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from pilotrun.commands.cli import main
from pilotrun.config import load_run_config
from pilotrun.model.transformer import build_model
from pilotrun.optim.muon_adamw import build_optimizer
from pilotrun.training import preflight

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"


def _train(data: Path, run_dir: Path) -> tuple[int, str]:
    err = io.StringIO()
    argv = ["train", "--config", str(SMOKE), "--data", str(data), "--run-dir", str(run_dir), "--set",
            "train.num_threads=1", "--set", "train.max_steps=2", "--set", "train.eval_every=0"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def _last_line(err: str) -> str:
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_a_disk_without_room_for_one_checkpoint_is_refused_before_training(
    builtin_data_dir, tmp_path, monkeypatch
):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: usage(10 << 20, 10 << 20, 1024))
    run_dir = tmp_path / "run"
    code, err = _train(builtin_data_dir, run_dir)
    assert code == 2
    line = _last_line(err)
    assert "MiB free" in line and "one checkpoint" in line and "checkpoints" in line, line
    assert not run_dir.exists()  # a refused fresh session leaves nothing behind


def test_a_checkpoints_folder_that_takes_no_write_is_refused_before_training(builtin_data_dir, tmp_path,
                                                                             monkeypatch):
    real_open = os.open

    def read_only_checkpoints(path, flags, *args):
        if Path(path).parent.name == "checkpoints" and flags & os.O_WRONLY:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only_checkpoints)
    run_dir = tmp_path / "run"
    code, err = _train(builtin_data_dir, run_dir)
    assert code == 2
    line = _last_line(err)
    assert "checkpoints is not writable" in line and "before the first update" in line, line
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "name", ["report", "checkpoints", "metrics.jsonl", "run.json", "tensorboard", "profile"]
)
def test_a_link_where_the_session_writes_is_refused_and_its_target_unchanged(
    builtin_data_dir, tmp_path, name
):
    outside = tmp_path / "users-file"
    outside.write_bytes(b"the user's own bytes\n" * 100)
    before = hashlib.sha256(outside.read_bytes()).hexdigest()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).symlink_to(outside)
    code, err = _train(builtin_data_dir, run_dir)
    # A folder holding anything is not new: a fresh train refuses it first; the link is what is named either
    # way.
    assert code == 2
    assert hashlib.sha256(outside.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in run_dir.iterdir()) == [name]


@pytest.mark.slow
def test_a_link_in_a_resumed_run_folder_is_refused_before_training(builtin_data_dir, tmp_path):
    run_dir = tmp_path / "run"
    assert _train(builtin_data_dir, run_dir)[0] == 0
    outside = tmp_path / "users-folder"
    outside.mkdir()
    (outside / "report.html").write_text("mine")
    (run_dir / "report").symlink_to(outside, target_is_directory=True)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(
            [
                "train",
                "--config",
                str(SMOKE),
                "--data",
                str(builtin_data_dir),
                "--run-dir",
                str(run_dir),
                "--resume",
                "--set",
                "train.num_threads=1",
                "--set",
                "train.max_steps=3",
            ]
        )
    assert code == 2
    line = _last_line(err.getvalue())
    assert f"{run_dir / 'report'} is a symbolic link" in line, line
    assert (outside / "report.html").read_text() == "mine" and sorted(os.listdir(outside)) == ["report.html"]


def test_the_estimate_matches_what_the_optimizer_holds_after_its_first_step():
    config = load_run_config(SMOKE, ["model.vocab_size=256"])
    model = build_model(config.model)
    optimizer = build_optimizer(model, config.optim)
    estimate = preflight.checkpoint_bytes_estimate(optimizer)  # before the lazily created state exists
    sum(p.float().square().sum() for p in model.parameters()).backward()
    optimizer.step()
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    assert held <= estimate <= 1.05 * held


def test_the_disk_plan_states_the_bytes_the_count_and_the_free_space_and_warns_when_the_policy_cannot_fit(
        tmp_path, monkeypatch):
    from pilotrun.config import CheckpointConfig, TrainConfig
    from pilotrun.training import preflight
    from pilotrun.training.checkpoint.checkpointer import Checkpointer

    checkpointer = Checkpointer(tmp_path / "run", keep=3, keep_steps=[5])
    train = TrainConfig(
        max_steps=1000, checkpoint=CheckpointConfig(every=50, keep=3, keep_every=100, keep_steps=[5])
    )
    monkeypatch.setattr(preflight, "_free_bytes", lambda folder: 100 << 30)
    line, warning = preflight.disk_plan(checkpointer, train, 1 << 30, "estimated")
    # the newest 3 + steps 100..1000 + step 5 + the final one = 15, and one more being written
    assert line.startswith(
        "checkpoints: 1.00 GiB each (estimated); the retention policy keeps at most 15 by step"
    )
    assert "16.00 GiB with the one being written; 100.00 GiB free" in line and warning is None
    monkeypatch.setattr(preflight, "_free_bytes", lambda folder: 10 << 30)
    _, warning = preflight.disk_plan(checkpointer, train, 1 << 30, "estimated")
    assert warning is not None and "needs about 16.00 GiB" in warning and "10.00 GiB free" in warning
    monkeypatch.setattr(preflight, "_free_bytes", lambda folder: None)
    line, warning = preflight.disk_plan(checkpointer, train, 1 << 30, "estimated")
    assert "unknown free" in line and warning is None


def test_the_room_check_before_a_save(tmp_path, monkeypatch):
    from pilotrun.training import preflight

    monkeypatch.setattr(preflight, "_free_bytes", lambda folder: 100 << 20)
    assert preflight.room_problem(tmp_path, 90 << 20) is None
    problem = preflight.room_problem(tmp_path, 97 << 20)  # fits, but not with the record's margin
    assert problem is not None and "100.0 MiB free" in problem and "97.0 MiB" in problem
