"""A branch of the checks is an exact continuation of the pilot where it changes nothing: the same losses and
the same weights, bit for bit, as the pilot's own updates after the checkpoint it starts from; with a change,
the change is the only difference and is recorded; and the pilot's own folder is never written."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from pilotrun.commands.cli import main
from pilotrun.commands.next_commands import train_words
from pilotrun.commands.tune_branch import (
    Branch,
    branch_train_losses,
    branch_val_loss,
    cadence_overrides,
    make_branch_folder,
    pilot_session_ids,
)
from pilotrun.run.marker import step_folder
from pilotrun.run.record import read_run_json

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "configs" / "smoke.yaml")
PILOT_SETS = ["train.max_steps=12", "optim.schedule.horizon=12", "train.checkpoint.every=4",
              "train.checkpoint.keep=10", "train.eval.every=4", "train.num_threads=1"]


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def pilot(builtin_data_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tune-branch") / "pilot"
    words = train_words(config=SMOKE, data=builtin_data_dir, run_dir=run_dir, overrides=PILOT_SETS,
                        extra=["--progress", "none"])
    assert main(words) == 0
    return run_dir


def _run_branch(pilot: Path, data: Path, branch: Branch) -> Path:
    recipe = pilot.parent / "recipe.json"
    recipe.write_text(json.dumps(read_run_json(pilot)["recipe"]))
    folder = pilot.parent / branch.name
    make_branch_folder(pilot, folder, branch.from_step)
    words = train_words(config=recipe, data=data, run_dir=folder,
                        overrides=[*branch.overrides, *cadence_overrides(branch)], allow_changes=branch.allow,
                        resume=True, extra=["--from-step", str(branch.from_step), "--progress", "none"])
    assert main(words) == 0
    return folder


def _pilot_losses(pilot: Path, first: int, last: int) -> dict[int, float]:
    events = [json.loads(line) for line in (pilot / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: e["loss"] for e in events if e["event"] == "train" and first < e["step"] <= last}


def test_a_branch_that_changes_nothing_is_the_pilots_own_continuation_bit_for_bit(pilot, builtin_data_dir):
    before = _files(pilot)
    branch = Branch("base", 1.0, from_step=4, updates=4)
    folder = _run_branch(pilot, builtin_data_dir, branch)
    assert _files(pilot) == before  # the pilot's folder is only read
    sessions = pilot_session_ids(pilot)
    assert branch_train_losses(folder, sessions) == _pilot_losses(pilot, 4, 8)  # exact float equality
    mine = torch.load(step_folder(folder, 8) / "model.pt", weights_only=True)
    theirs = torch.load(step_folder(pilot, 8) / "model.pt", weights_only=True)
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    pilot_val = [json.loads(line) for line in (pilot / "metrics.jsonl").read_text().splitlines()]
    assert branch_val_loss(folder, sessions, 8) == [e["loss"] for e in pilot_val
                                                    if e["event"] == "val" and e["step"] == 8][0]
    run = read_run_json(folder)
    assert run["run_id"] == read_run_json(pilot)["run_id"]  # the lineage: the pilot's run, its sessions
    assert run["sessions"][-1]["resumed_from"] is not None


def test_a_branch_with_a_change_records_it_and_differs(pilot, builtin_data_dir):
    recipe = read_run_json(pilot)["recipe"]
    lr = recipe["optim"]["muon"]["lr"]
    branch = Branch("lr", 2.0, from_step=4, updates=4, overrides=[f"optim.muon.lr={lr * 2!r}"],
                    allow=["optim.muon.lr"])
    folder = _run_branch(pilot, builtin_data_dir, branch)
    run = read_run_json(folder)
    assert [(c["key"], c["old"], c["new"]) for c in run["allowed_changes"]] == [("optim.muon.lr", lr, lr * 2)]
    losses = branch_train_losses(folder, pilot_session_ids(pilot))
    assert losses[5] == _pilot_losses(pilot, 4, 5)[5]  # the first update's loss is measured before it applies
    assert losses[8] != _pilot_losses(pilot, 4, 8)[8]


def test_a_half_batch_branch_reads_the_same_tokens(pilot, builtin_data_dir):
    branch = Branch("batch", 0.5, from_step=4, updates=8,
                    overrides=["train.batch_size=2", "train.eval.batches=4"], allow=["train.batch_size"])
    folder = _run_branch(pilot, builtin_data_dir, branch)
    own = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    pilots = pilot_session_ids(pilot)
    ends = [e for e in own if e["event"] == "session_end" and e["session_id"] not in pilots]
    pilot_at_8 = [json.loads(line) for line in (pilot / "metrics.jsonl").read_text().splitlines()]
    tokens_8 = [e["tokens_seen"] for e in pilot_at_8 if e["event"] == "train" and e["step"] == 8][0]
    assert (ends[-1]["step"], ends[-1]["tokens_seen"]) == (12, tokens_8)
    assert branch_val_loss(folder, pilots, 12) is not None
    assert main(["summarize", str(folder)]) == 0  # a valid record: the earlier sessions ran at 4 rows


def test_an_unfinished_branch_has_no_loss(pilot, tmp_path):
    folder = tmp_path / "unfinished"
    make_branch_folder(pilot, folder, 4)
    assert branch_val_loss(folder, pilot_session_ids(pilot), 8) is None  # the pilot's own val at 8 is not it
    assert not list(tmp_path.glob(".*partial"))
