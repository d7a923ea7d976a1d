"""Data the recipe cannot use to the end is refused at startup, before the run folder exists; a damaged shard
holding an id outside the vocabulary is refused by the loader naming shard and offset."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pilotrun.commands.cli import main
from pilotrun.common.errors import DataError
from pilotrun.data.reader import BatchLoader, TokenIdError, check_data_fits_recipe, open_dataset
from pilotrun.data.shards import METADATA_FILE, read_shard_header
from pilotrun.data.verify import verify_data

ROOT = Path(__file__).resolve().parents[2]


def train_argv(data_dir: Path, run_dir: Path, *sets: str) -> list[str]:
    argv = ["train", "--config", str(ROOT / "configs" / "smoke.yaml"), "--data", str(data_dir), "--run-dir",
            str(run_dir), "--set", "train.num_threads=1", "--set", "train.max_steps=2"]
    for item in sets:
        argv += ["--set", item]
    return argv


def _one_line_exit_2(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def _poke_token(data_dir: Path, file: str, offset: int, value: int, record_max: bool | None) -> None:
    """Write `value` at `offset` of a shard and fix its sha256 in the manifest (damage that passes the
    hashes); record_max: True records the new max_token_id, False leaves the old one, None removes the
    field."""
    path = data_dir / file
    header = read_shard_header(str(path))
    tokens = np.memmap(path, dtype=header.dtype, mode="r+", offset=header.data_offset, shape=header.shape)
    tokens[offset] = value
    tokens.flush()
    del tokens
    manifest = json.loads((data_dir / METADATA_FILE).read_text())
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            if record_max is None:
                shard.pop("max_token_id", None)
            if shard["file"] == file:
                shard["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
                if record_max:
                    shard["max_token_id"] = value
    (data_dir / METADATA_FILE).write_text(json.dumps(manifest))


def test_prepare_records_each_shards_largest_id(builtin_data_dir):
    manifest = json.loads((builtin_data_dir / METADATA_FILE).read_text())
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            assert shard["max_token_id"] == int(np.load(builtin_data_dir / shard["file"]).max())


def test_a_val_split_shorter_than_one_evaluation_batch_is_refused_before_the_run_folder(
        builtin_data_dir, tmp_path, capsys):
    dataset = open_dataset(builtin_data_dir)
    val_tokens = dataset.split("val").num_tokens
    batch = val_tokens // 32 + 1  # batch * 32 + 1 > val tokens, far below the train split
    err = _one_line_exit_2(capsys, train_argv(builtin_data_dir, tmp_path / "run", f"train.batch_size={batch}",
                                              "train.seq_len=32", "train.eval_every=1"))
    assert "val split" in err and str(val_tokens) in err
    assert not (tmp_path / "run").exists()
    # Without evaluation the same geometry is fine; an exact fit (G * seq_len + 1 tokens) is too.
    check_data_fits_recipe(
        dataset, batch_size=batch, seq_len=32, world_size=1, evaluates=False, vocab_size=4096
    )
    fit = val_tokens - 1
    check_data_fits_recipe(dataset, batch_size=1, seq_len=fit, world_size=1, evaluates=True, vocab_size=4096)
    BatchLoader(dataset.split("val"), 1, fit).next_batch()  # the loader agrees that it is one batch
    with pytest.raises(DataError, match="val split"):
        check_data_fits_recipe(dataset, batch_size=1, seq_len=fit + 1, world_size=1, evaluates=True,
                               vocab_size=8192)


def test_a_train_split_shorter_than_one_batch_is_refused(builtin_data_dir):
    dataset = open_dataset(builtin_data_dir)
    tokens = dataset.split("train").num_tokens
    with pytest.raises(DataError, match="train split"):
        check_data_fits_recipe(dataset, batch_size=1, seq_len=tokens, world_size=1, evaluates=False,
                               vocab_size=4096)


@pytest.mark.parametrize("record_max", [True, None], ids=["recorded", "older-manifest-computed"])
def test_an_id_beyond_the_vocabulary_is_refused_at_startup(builtin_data_dir, tmp_path, capsys, record_max):
    data = tmp_path / "data"
    shutil.copytree(builtin_data_dir, data)
    _poke_token(data, "val_00000.npy", 7, 4096, record_max)
    err = _one_line_exit_2(capsys, train_argv(data, tmp_path / "run"))
    assert "val_00000.npy" in err and "4096" in err
    assert not (tmp_path / "run").exists()


def test_the_loader_guard_names_shard_and_offset_of_a_damaged_id(builtin_data_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(builtin_data_dir, data)
    _poke_token(data, "train_00000.npy", 200, 5000, record_max=False)  # the manifest's max is now stale
    dataset = open_dataset(data)
    check_data_fits_recipe(dataset, batch_size=4, seq_len=32, world_size=1, evaluates=True, vocab_size=8192)
    loader = BatchLoader(dataset.split("train"), 4, 32)
    loader.next_batch()  # windows 0..3: tokens 0..128
    with pytest.raises(TokenIdError, match=r"train_00000\.npy holds token id 5000 at offset 200"):
        loader.next_batch()  # windows 4..7 hold token 200
    assert loader.batch_index == 1  # the refused batch is not consumed
    # The look-ahead an update boundary can use: batch 1 of 2 ranks x 2 rows covers tokens 128..256.
    ahead = BatchLoader(dataset.split("train"), 2, 32, rank=0, world_size=2)
    ahead.check_upcoming_batches(1)  # batch 0: tokens 0..128
    with pytest.raises(TokenIdError, match="offset 200"):
        # rank 1's rows of batch 1 (tokens 192..257) hold it; rank 0 sees it too
        ahead.check_upcoming_batches(2)
    assert ahead.batch_index == 0
    assert any("max_token_id" in problem for problem in verify_data(data))


@pytest.mark.slow
def test_a_damaged_id_found_mid_run_stops_with_one_line_and_the_last_checkpoint_kept(
    builtin_data_dir, tmp_path, capsys
):
    from pilotrun.training.checkpoint.checkpointer import Checkpointer

    data = tmp_path / "data"
    shutil.copytree(builtin_data_dir, data)
    # Batch b of 4 rows x 32 reads tokens 128*b .. 128*b + 128: offset 420 is first read by update 4.
    _poke_token(data, "train_00000.npy", 420, 4096, record_max=False)
    run_dir = tmp_path / "run"
    code = main(
        train_argv(data, run_dir, "train.max_steps=6", "train.checkpoint_every=2", "train.eval_every=0")
    )
    err = capsys.readouterr().err
    # the progress bar shares stderr
    errors = [line for line in err.splitlines() if line.startswith("pilotrun:")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1
    assert "train_00000.npy" in errors[0] and "offset 420" in errors[0]
    # Found before update 4 ran: the state after update 3 is checkpointed, and the record says how it ended.
    assert Checkpointer(run_dir, keep=3).committed_steps() == [2, 3]
    from pilotrun.report.record_check.summarize import summarize_run

    summary = summarize_run(run_dir)
    assert summary.valid, summary.reasons
    assert summary.sessions[-1].end_reason == "error" and summary.overall["updates_applied"] == 3
