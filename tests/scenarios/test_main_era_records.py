"""A run folder and a lock written by the code before the recipe's sections (recipe format 1, every training
key flat: `train.eval_every`), kept in main_era/ as that code wrote them: today's code resumes the run bit for
bit, sees no recipe difference that is only a new name, and holds a long run to the lock.

main_era/ was made with the code of commit 5783b2d: `pilotrun prepare --out data --source builtin --tokenizer
bpe:300`, then `pilotrun train --config smoke --data data --run-dir run` with FORMAT_1_SETS and
train.max_steps=2, then `pilotrun freeze run --out lock.json --despite-no-go`.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from pilotrun.commands.cli import main

MAIN_ERA = Path(__file__).resolve().parent / "main_era"
SIZES = ["model.d_model=16", "model.n_heads=2", "model.kv_lora_rank=8", "model.qk_nope_head_dim=4",
         "model.qk_rope_head_dim=4", "model.v_head_dim=4", "model.moe_hidden=8", "model.dense_hidden=16",
         "train.num_threads=1", "optim.schedule.horizon=4"]
FORMAT_1_SETS = [*SIZES, "train.checkpoint_every=2", "train.keep_checkpoints=1", "train.eval_every=2"]
TODAYS_SETS = [*SIZES, "train.checkpoint.every=2", "train.checkpoint.keep=1", "train.eval.every=2"]


def flags(sets: list[str]) -> list[str]:
    return [part for s in sets for part in ("--set", s)]


@pytest.fixture(scope="module")
def main_era_data(tmp_path_factory):
    from pilotrun.data.prepare import prepare_corpus

    out = tmp_path_factory.mktemp("main_era") / "data"
    prepare_corpus(out, source="builtin", tokenizer="bpe:300", progress=False)
    return out


def weights(run: Path, step: int) -> dict:
    return torch.load(run / "checkpoints" / f"step-{step:08d}" / "model.pt", weights_only=True)


@pytest.mark.slow
def test_a_main_era_run_resumes_bit_for_bit_and_records_todays_format(main_era_data, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(MAIN_ERA / "run", run)
    recorded = json.loads((run / "run.json").read_text())
    assert "eval_every" in recorded["recipe"]["train"] and "recipe_format" not in recorded  # format 1
    data = ["--config", "smoke", "--data", str(main_era_data)]
    assert main(["train", *data, "--run-dir", str(run), "--resume", *flags(FORMAT_1_SETS),
                 "--set", "train.max_steps=4"]) == 0
    assert main(["train", *data, "--run-dir", str(tmp_path / "straight"), *flags(TODAYS_SETS),
                 "--set", "train.max_steps=4"]) == 0
    resumed, straight = weights(run, 4), weights(tmp_path / "straight", 4)
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[name], straight[name]) for name in straight)
    record = json.loads((run / "run.json").read_text())
    assert record["recipe_format"] == 2 and record["recipe"]["train"]["eval"]["every"] == 2
    # The only difference from the checkpoint's recipe is the longer run: no name read as a change.
    assert [c["key"] for c in record.get("free_changes", [])] == ["train.max_steps"]
    assert record["allowed_changes"] == []
    capsys.readouterr()
    assert main(["summarize", str(run)]) == 0


@pytest.mark.slow
def test_a_main_era_lock_holds_a_long_run_in_todays_names(main_era_data, tmp_path):
    from pilotrun.run.recipe_lock import frozen_candidate_status, load_lock

    lock_path = tmp_path / "lock.json"
    shutil.copy(MAIN_ERA / "lock.json", lock_path)
    lock = load_lock(lock_path)  # its sha256 still matches its content
    assert "keep_checkpoints" in lock["recipe"]["train"] and "recipe_format" not in lock
    long = tmp_path / "long"
    # The code is today's, not the pilot's: named; every recipe key compares equal after translation.
    assert main(["train", "--frozen", str(lock_path), "--data", str(main_era_data), "--run-dir", str(long),
                 "--allow-change", "code"]) == 0
    run = json.loads((long / "run.json").read_text())
    assert [d["key"] for d in run["frozen"]["differences"]] == ["code"]
    status = frozen_candidate_status(run)
    assert status["matches"] and status["drift"] == [] and status["lock_file"] == "unchanged"
    # A difference named under its earlier flat name is today's key.
    refused = main(["train", "--frozen", str(lock_path), "--data", str(main_era_data), "--run-dir",
                    str(tmp_path / "other"), "--allow-change", "code", "--set", "train.eval_every=1"])
    assert refused == 2
    assert main(["train", "--frozen", str(lock_path), "--data", str(main_era_data), "--run-dir",
                 str(tmp_path / "other"), "--allow-change", "code", "--allow-change", "train.eval_every",
                 "--set", "train.eval_every=1"]) == 0
    other = json.loads((tmp_path / "other" / "run.json").read_text())
    assert sorted(d["key"] for d in other["frozen"]["differences"]) == ["code", "train.eval.every"]
