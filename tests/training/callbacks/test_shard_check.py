"""pilotrun/training/callbacks/shard_check.py: a shard damaged after prepare stops `pilotrun train` at an
update boundary, with a checkpoint and one line naming it; an intact run records every shard it read as
verified."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pilotrun.commands.cli import main
from pilotrun.common.files import sha256_of_file
from pilotrun.data.reader import BatchLoader, open_dataset
from pilotrun.data.shard_hashing import ShardHasher
from pilotrun.training.callbacks.shard_check import ShardCheckCallback
from pilotrun.training.checkpoint.checkpointer import Checkpointer

ROOT = Path(__file__).resolve().parents[3]
SMOKE = ROOT / "configs" / "smoke.yaml"
SETTINGS = ("train.num_threads=1", "train.checkpoint_every=0")


def _train(data_dir: Path, run_dir: Path, *settings: str, resume: bool = False) -> int:
    return main(["train", "--config", str(SMOKE), "--data", str(data_dir), "--run-dir", str(run_dir),
                 *(["--resume"] if resume else []),
                 *[arg for key_value in (*SETTINGS, *settings) for arg in ("--set", key_value)]])


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _flip_early_token(shard: Path, position: int, vocab_size: int) -> None:
    """Flip the lowest bit of the token at `position`: still a vocabulary id (the vocabulary's size is even),
    so the reader's id guard lets it through and only the hash can tell."""
    data_offset = np.load(shard, mmap_mode="r").offset
    raw = bytearray(shard.read_bytes())
    byte = data_offset + 2 * position  # uint16, little-endian: the low byte first
    assert (raw[byte] | raw[byte + 1] << 8) ^ 1 < vocab_size
    raw[byte] ^= 1
    shard.write_bytes(bytes(raw))


def _reshard(source: Path, out: Path, first_tokens: int = 256, count: int = 4) -> None:
    """A copy of the prepared folder whose splits start with `count` small shards, so that a short run reads a
    few shards of many: the manifest rewritten to match (tokens, sha256, largest id per shard)."""
    shutil.copytree(source, out)
    manifest = json.loads((out / "metadata.json").read_text())
    for name, split in manifest["splits"].items():
        tokens = np.concatenate([np.load(out / shard["file"]) for shard in split["shards"]])
        for shard in split["shards"]:
            (out / shard["file"]).unlink()
        cuts = [k * first_tokens for k in range(1, count + 1) if k * first_tokens < len(tokens)]
        shards = []
        for index, piece in enumerate(np.split(tokens, cuts)):
            file = f"{name}_{index:05d}.npy"
            np.save(out / file, piece)
            shards.append({"file": file, "tokens": int(len(piece)), "sha256": sha256_of_file(out / file),
                           "max_token_id": int(piece.max())})
        split["shards"] = shards
    (out / "metadata.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _shards_read(data_dir: Path, split: str, batches: range, batch_size: int = 4, seq_len: int = 32) -> set:
    loader = BatchLoader(open_dataset(data_dir).split(split), batch_size, seq_len)
    return {(split, file) for batch in batches for row in loader.describe_batch(batch)
            for file, _, _ in row["pieces"]}


@pytest.mark.slow
def test_a_flipped_byte_stops_the_run_with_exit_1_a_checkpoint_and_one_line_naming_the_shard(
        builtin_data_dir, tmp_path, capsys):
    data_dir, run_dir = tmp_path / "data", tmp_path / "run"
    shutil.copytree(builtin_data_dir, data_dir)
    shard = data_dir / "train_00000.npy"
    expected = sha256_of_file(shard)
    _flip_early_token(shard, 10, open_dataset(builtin_data_dir).vocab_size)  # in the first batch's first row
    found = sha256_of_file(shard)

    code = _train(data_dir, run_dir)
    out, err = capsys.readouterr()
    assert code == 1
    naming = [line for line in (out + err).splitlines() if str(shard) in line]
    assert len(naming) == 1 and expected[:16] in naming[0] and found[:16] in naming[0]

    events = _events(run_dir)
    end = events[-1]
    assert end["event"] == "session_end" and end["reason"] == "stopped"
    assert str(shard) in end["message"] and expected[:16] in end["message"] and found[:16] in end["message"]
    (check,) = [e for e in events if e["event"] == "shard_check" and e["file"] == "train_00000.npy"]
    assert (check["matched"], check["expected"], check["found"]) == (False, expected, found)
    # Stopped at an update boundary with the state of that boundary committed (checkpoint_every is 0: this is
    # the stop's own checkpoint), before max_steps.
    assert 1 <= end["step"] < 6
    assert Checkpointer(run_dir, keep=2).committed_steps() == [end["step"]]
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [end["step"]]
    assert main(["summarize", str(run_dir)]) == 0  # a valid record: the window closed before the stop
    capsys.readouterr()


@pytest.mark.slow
def test_an_intact_run_records_every_shard_it_read_as_verified_and_a_resume_checks_them_again(
        builtin_data_dir, tmp_path, capsys):
    data_dir, run_dir = tmp_path / "data", tmp_path / "run"
    _reshard(builtin_data_dir, data_dir)
    assert _train(data_dir, run_dir, "train.max_steps=4", "train.eval_every=4") == 0
    assert _train(data_dir, run_dir, "train.max_steps=6", "train.eval_every=4", resume=True) == 0
    capsys.readouterr()

    events = _events(run_dir)
    sessions = [e["session_id"] for e in events if e["event"] == "session_start"]
    assert len(sessions) == 2 and all(
        e["reason"] == "completed" for e in events if e["event"] == "session_end"
    )
    manifest = json.loads((data_dir / "metadata.json").read_text())
    expected = {(name, shard["file"]): shard["sha256"] for name, split in manifest["splits"].items()
                for shard in split["shards"]}
    # Session 1 trains batches 0-3 and evaluates once (val batches 0-1); the resumed one trains batches 4-5.
    read = [_shards_read(data_dir, "train", range(4)) | _shards_read(data_dir, "val", range(2)),
            _shards_read(data_dir, "train", range(4, 6))]
    assert len(read[0]) > 2 and len(read[0]) < len(expected)  # several shards read, not all of them
    for session, shards in zip(sessions, read, strict=True):
        checks = [e for e in events if e["event"] == "shard_check" and e["session_id"] == session]
        assert sorted((e["split"], e["file"]) for e in checks) == sorted(shards)  # each once, only those read
        assert all(e["matched"] and e["found"] == expected[(e["split"], e["file"])] for e in checks)
    end = max(i for i, e in enumerate(events) if e["event"] == "session_end")
    assert all(e["event"] != "shard_check" for e in events[end:])


def test_the_sessions_last_update_waits_for_the_shards_still_being_hashed(tmp_path):
    release = threading.Event()

    def slow_wrong_hash(path, stop, chunk_bytes):
        release.wait(timeout=30)
        return "0" * 64, 1

    hasher = ShardHasher(hash_function=slow_wrong_hash)
    shard = tmp_path / "train_00003.npy"
    hasher.submit("train", shard.name, str(shard), "a" * 64)
    train = SimpleNamespace(max_steps=7, log=SimpleNamespace(every=5), checkpoint=SimpleNamespace(every=0))
    loop = SimpleNamespace(
        step=6,
        applied=True,
        session=SimpleNamespace(config=SimpleNamespace(train=train), context=SimpleNamespace(world_size=2)),
    )
    callback = ShardCheckCallback(hasher, rank=1)
    try:
        # no window closes at 6: the hash is still running, no wait
        assert callback.stop_request(loop) is None
        loop.step = 7
        threading.Timer(0.05, release.set).start()
        ending = callback.stop_request(loop)  # the last update: blocks until the hash is done
    finally:
        release.set()
        hasher.close()
    assert (ending.reason, ending.exit_code) == ("stopped", 1)
    assert (
        str(shard) in ending.message and "(rank 1)" in ending.message and "aaaaaaaaaaaaaaaa" in ending.message
    )
