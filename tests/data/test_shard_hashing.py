"""pilotrun/data/shard_hashing.py: the background sha256 check of first-read shards, and the reader's hook."""

from __future__ import annotations

import hashlib
import threading

import pytest

from pilotrun.common.files import sha256_of_file
from pilotrun.data.reader import BatchLoader, open_dataset
from pilotrun.data.shard_hashing import ShardHasher, hash_file


def _shard(tmp_path, name: str, content: bytes) -> tuple[str, str]:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path), hashlib.sha256(content).hexdigest()


def test_hash_file_reads_in_chunks_to_the_files_sha256_and_stops_between_chunks(tmp_path):
    path, digest = _shard(tmp_path, "a.npy", bytes(range(256)) * 1000)
    assert hash_file(path, chunk_bytes=4096) == (digest, 256_000)
    stop = threading.Event()
    stop.set()
    assert hash_file(path, stop, chunk_bytes=4096) == (None, 0)


def test_each_shard_is_hashed_once_however_often_it_is_submitted(tmp_path):
    calls = []

    def counting_hash(path, stop, chunk_bytes):
        calls.append(path)
        return hash_file(path, stop, chunk_bytes)

    path, digest = _shard(tmp_path, "train_00000.npy", b"tokens" * 100)
    hasher = ShardHasher(hash_function=counting_hash)
    try:
        assert hasher.submit("train", "train_00000.npy", path, digest)
        assert not hasher.submit("train", "train_00000.npy", path, digest)
        assert hasher.wait(timeout=30)
        assert not hasher.submit("train", "train_00000.npy", path, digest)
        (result,) = hasher.take_finished()
    finally:
        hasher.close()
    assert calls == [path]
    assert result.matched and result.found == digest and result.bytes == 600 and hasher.mismatch is None
    assert hasher.take_finished() == []  # taken once


def test_a_mismatch_is_reported_with_the_shard_and_both_hash_prefixes(tmp_path):
    good, good_digest = _shard(tmp_path, "train_00000.npy", b"a" * 5000)
    bad, bad_digest = _shard(tmp_path, "train_00001.npy", b"b" * 5000)
    expected = "f" * 64  # what the manifest says shard 1 holds
    hasher = ShardHasher()
    try:
        hasher.submit("train", "train_00000.npy", good, good_digest)
        hasher.submit("train", "train_00001.npy", bad, expected)
        assert hasher.wait(timeout=30)
        results = hasher.take_finished()
    finally:
        hasher.close()
    assert [r.matched for r in results] == [True, False]  # in the order first read
    damaged = hasher.mismatch
    assert damaged is results[1] and damaged.found == bad_digest and damaged.expected == expected
    line = damaged.describe()
    assert "\n" not in line and bad in line and bad_digest[:16] in line and expected[:16] in line
    fields = damaged.event_fields()
    assert fields["matched"] is False and fields["file"] == "train_00001.npy" and fields["split"] == "train"


def test_an_unreadable_shard_counts_as_damaged(tmp_path):
    hasher = ShardHasher()
    try:
        hasher.submit("val", "val_00000.npy", str(tmp_path / "val_00000.npy"), "0" * 64)
        assert hasher.wait(timeout=30)
    finally:
        hasher.close()
    damaged = hasher.mismatch
    assert damaged is not None and not damaged.matched and damaged.found is None
    assert "FileNotFoundError" in damaged.error and "val_00000.npy" in damaged.describe()


def test_close_stops_the_thread_mid_shard_and_leaves_the_queue_unverified(tmp_path):
    started = threading.Event()

    def hash_until_stopped(path, stop, chunk_bytes):
        started.set()
        stop.wait()  # a shard too large to finish before the session ends
        return None, 0

    hasher = ShardHasher(hash_function=hash_until_stopped)
    for index in range(3):
        path, digest = _shard(tmp_path, f"train_{index:05d}.npy", b"x")
        hasher.submit("train", f"train_{index:05d}.npy", path, digest)
    assert started.wait(timeout=30) and hasher.alive
    hasher.close(timeout=30)
    assert not hasher.alive
    assert hasher.take_finished() == [] and hasher.mismatch is None and hasher.pending == 3
    assert not hasher.wait(timeout=1)  # closed: nothing will finish
    path, digest = _shard(tmp_path, "train_00009.npy", b"y")
    assert not hasher.submit("train", "train_00009.npy", path, digest)  # a closed hasher takes nothing new


def test_the_reader_hands_each_shard_to_the_hasher_on_its_first_read_only(builtin_data_dir):
    dataset = open_dataset(builtin_data_dir)
    train = dataset.split("train")
    hasher = ShardHasher()
    hasher.watch(train)
    try:
        loader = BatchLoader(train, batch_size=4, seq_len=32)
        assert hasher.submitted == 0  # opening and building the loader read nothing
        loader.next_batch()
        loader.next_batch()
        assert hasher.submitted == 1 and hasher.wait(timeout=30)
        (result,) = hasher.take_finished()
    finally:
        hasher.close()
    assert result.matched and result.file == train.files[0]
    assert result.found == sha256_of_file(builtin_data_dir / train.files[0])
    loader.next_batch()  # closed: the split is no longer watched
    assert hasher.submitted == 1


@pytest.mark.parametrize("watching", [False, True])
def test_watching_leaves_the_batches_as_they_are(builtin_data_dir, watching):
    dataset = open_dataset(builtin_data_dir)
    reference = BatchLoader(dataset.split("train"), 2, 16).next_batch()
    split = open_dataset(builtin_data_dir).split("train")
    if watching:
        split.watch_first_reads(lambda split, index: None)
    inputs, targets = BatchLoader(split, 2, 16).next_batch()
    assert inputs.equal(reference[0]) and targets.equal(reference[1])
