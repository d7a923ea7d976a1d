"""A refused `pilotrun train --resume` leaves the run folder exactly as it was, through the real command line
(in process): every resume refusal is one line on stderr and exit 2, and the folder's file list, bytes and
modification times (every file's and folder's) are the same before and after (no lock file, no holder line,
not even taken back, no empty checkpoints/ folder, no metrics line). Also
a checkpoint marker whose step is not an integer (JSON Infinity, NaN, 1e999, 4.0) is refused as summarize
--require-step refuses it."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from tests.commands.test_cli_bad_input import run_cli, tree_hashes, tree_state

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "configs" / "smoke.yaml")
STEPS = ["--set", "train.num_threads=1", "--progress", "none"]


def _train(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--config", SMOKE, "--data", str(data), "--run-dir", str(run_dir), *STEPS, *extra]


@pytest.fixture(scope="module")
def runs(builtin_data_dir, tmp_path_factory) -> tuple[Path, Path]:
    """Two runs of 4 updates (checkpoints at 3 and 4) with different seeds: the second is the 'other run'."""
    root = tmp_path_factory.mktemp("refusals")
    for name, seed in (("run", "0"), ("other", "7")):
        assert main(_train(builtin_data_dir, root / name, "--set", "train.max_steps=4",
                           "--set", f"train.seed={seed}")) == 0
    return root / "run", root / "other"


def _set_marker_step(run_dir: Path, literal: str) -> None:
    path = run_dir / "checkpoints" / "step-00000004" / "COMMITTED.json"
    marker = json.loads(path.read_text())
    assert marker["step"] == 4
    # only the top-level step (its meta records the step too): the literal as JSON text
    marker["step"] = "STEP"
    path.write_text(json.dumps(marker, indent=1).replace('"step": "STEP"', f'"step": {literal}'))


def _prepare(kind: str, run_dir: Path, other: Path, data: Path, tmp_path: Path) -> list[str]:
    """Damage `run_dir` for `kind` and return the extra train arguments of the refused resume."""
    resume = ["--resume", "--set", "train.max_steps=6"]
    if kind == "other-runs-checkpoint":
        shutil.rmtree(run_dir / "checkpoints" / "step-00000004")
        shutil.copytree(other / "checkpoints" / "step-00000004", run_dir / "checkpoints" / "step-00000004")
    elif kind == "changed-recipe":
        resume += ["--set", "optim.muon.lr=0.01"]
    elif kind == "changed-recipe-no-lock-file":  # a run folder copied without its run.lock
        (run_dir / "run.lock").unlink()
        resume += ["--set", "optim.muon.lr=0.01"]
    elif kind == "no-such-checkpoint":
        resume += ["--from-step", "2"]
    elif kind == "damaged-checkpoint-file":
        with open(run_dir / "checkpoints" / "step-00000004" / "model.pt", "ab") as handle:
            handle.write(b"x")
    elif kind == "metrics-folder-no-checkpoints":  # the preflight's checkpoints/ must go again
        shutil.rmtree(run_dir / "checkpoints")
        (run_dir / "metrics.jsonl").unlink()
        (run_dir / "metrics.jsonl").mkdir()
    elif kind == "bad-marker":
        _set_marker_step(run_dir, "Infinity")
    elif kind == "fresh-run-into-it":  # the same command without --resume
        return ["--set", "train.max_steps=6"]
    elif kind == "unknown-allow-change":
        resume += ["--allow-change", "optim.muon.lrr"]
    return resume


RESUME_REFUSALS = [
    "other-runs-checkpoint",
    "changed-recipe",
    "changed-recipe-no-lock-file",
    "no-such-checkpoint",
    "damaged-checkpoint-file",
    "metrics-folder-no-checkpoints",
    "bad-marker",
    "missing-data",
    "locked-folder",
    "fresh-run-into-it",
    "unknown-allow-change",
]


@pytest.mark.slow
@pytest.mark.parametrize("kind", RESUME_REFUSALS)
def test_a_refused_resume_leaves_the_run_folder_as_it_was(builtin_data_dir, runs, tmp_path, capsys, kind):
    run_dir = tmp_path / "run"
    shutil.copytree(runs[0], run_dir)
    data = tmp_path / "no-data" if kind == "missing-data" else builtin_data_dir
    extra = _prepare(kind, run_dir, runs[1], data, tmp_path)
    before = tree_state(run_dir)
    holder = None
    if kind == "locked-folder":  # another open file description of run.lock, locked: a live session's lock
        holder = os.open(run_dir / "run.lock", os.O_RDWR)
        fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        code, err = run_cli(capsys, _train(data, run_dir, *extra))
    finally:
        if holder is not None:
            os.close(holder)
    assert code == 2 and len(err) == 1 and err[0].startswith("pilotrun: error:"), err
    assert tree_state(run_dir) == before


@pytest.mark.parametrize("literal", ["Infinity", "NaN", "-Infinity", "1e999", "4.0", "true", '"4"'])
def test_a_marker_step_that_is_not_an_integer_is_refused_on_resume_as_summarize_refuses_it(
        builtin_data_dir, runs, tmp_path, capsys, literal):
    run_dir = tmp_path / "run"
    shutil.copytree(runs[0], run_dir)
    _set_marker_step(run_dir, literal)
    before = tree_hashes(run_dir)
    assert main(["summarize", str(run_dir), "--require-step", "4", "--json"]) == 1
    reasons = json.loads(capsys.readouterr().out)["reasons"]
    assert any("step-00000004/COMMITTED.json" in reason for reason in reasons)
    code, err = run_cli(capsys, _train(builtin_data_dir, run_dir, "--resume", "--set", "train.max_steps=6"))
    assert code == 2 and len(err) == 1
    assert "step-00000004/COMMITTED.json records step" in err[0] and "not an integer step" in err[0]
    assert "--from-step 3" in err[0]  # the earlier, sound checkpoint is offered
    assert tree_hashes(run_dir) == before


def test_a_refused_fresh_run_removes_the_parent_folders_it_made(builtin_data_dir, tmp_path, capsys):
    code, err = run_cli(
        capsys, _train(builtin_data_dir, tmp_path / "a" / "b" / "run", "--set", "model.vocab_size=100")
    )
    assert code == 2 and len(err) == 1 and "model.vocab_size" in err[0]
    assert list(tmp_path.iterdir()) == []
