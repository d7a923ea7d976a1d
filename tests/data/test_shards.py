"""Shard files: cut at exactly shard_tokens, hashed as written, and the unfinished shard persisted and
restored for an interruptible prepare."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from pilotrun.common.errors import DataError
from pilotrun.data.shards import ShardWriter, check_shard, metadata_sha256, pending_name


def test_shards_are_cut_at_shard_tokens_and_hashed_as_they_lie_on_disk(tmp_path):
    writer = ShardWriter(str(tmp_path), "train", 4, "uint16")
    writer.add(np.arange(6, dtype=np.uint16))
    writer.add(np.arange(6, 9, dtype=np.uint16))
    shards = writer.close()
    assert [(s["file"], s["tokens"], s["max_token_id"]) for s in shards] == [
        ("train_00000.npy", 4, 3), ("train_00001.npy", 4, 7), ("train_00002.npy", 1, 8)]
    for shard in shards:
        path = tmp_path / shard["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == shard["sha256"]
        check_shard(str(path), "uint16", shard["tokens"])
    assert metadata_sha256({"b": 1, "a": [2]}) == metadata_sha256({"a": [2], "b": 1})


def test_shard_writer_persists_only_new_tokens_and_restores_a_recorded_state(tmp_path):
    writer = ShardWriter(str(tmp_path), "val", 10, "uint16")
    writer.add(np.arange(4, dtype=np.uint16))
    state = writer.persist()
    assert state == {"shards": [], "pending_tokens": 4}
    writer.add(np.arange(4, 7, dtype=np.uint16))
    writer.persist()
    assert (tmp_path / pending_name("val", 0)).stat().st_size == 7 * 2  # appended, not rewritten
    # A restore to the earlier state drops the tokens persisted after it.
    restored = ShardWriter(str(tmp_path), "val", 10, "uint16")
    restored.restore(state)
    assert (tmp_path / pending_name("val", 0)).stat().st_size == 4 * 2
    restored.add(np.arange(20, 30, dtype=np.uint16))
    assert restored.take_obsolete() == [str(tmp_path / pending_name("val", 0))]  # its shard is complete now
    shards = restored.close()
    assert np.load(tmp_path / shards[0]["file"]).tolist() == [0, 1, 2, 3, *range(20, 26)]
    with pytest.raises(DataError, match="fewer than the 9 pending tokens"):
        ShardWriter(str(tmp_path), "train", 10, "uint16").restore({"shards": [], "pending_tokens": 9})


def test_a_byte_flipped_in_the_pending_tail_is_refused_at_restore(tmp_path):
    """The pending file holds as many tokens as recorded, one byte flipped: restoring it would write a damaged
    shard that the manifest then hashes as it lies. The recorded sha256 refuses it; the intact tail
    restores."""
    writer = ShardWriter(str(tmp_path), "train", 10, "uint16")
    writer.add(np.arange(3, dtype=np.uint16))
    writer.persist_checked()
    writer.add(np.arange(3, 6, dtype=np.uint16))
    state = writer.persist_checked()  # the digest follows the appended tokens, not only the first ones
    assert state["pending_sha256"] == hashlib.sha256(np.arange(6, dtype=np.uint16).tobytes()).hexdigest()
    ShardWriter(str(tmp_path), "train", 10, "uint16").restore(state)
    pending = tmp_path / pending_name("train", 0)
    data = bytearray(pending.read_bytes())
    data[5] ^= 0x01
    pending.write_bytes(bytes(data))
    with pytest.raises(DataError, match="pending tokens are not the ones the progress file recorded"):
        ShardWriter(str(tmp_path), "train", 10, "uint16").restore(state)
