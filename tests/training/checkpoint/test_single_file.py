"""The single-file storage (torch.save): parts sharded and read back exactly, every file hashed as written,
and nothing that would run code when read."""

import hashlib
from pathlib import PurePosixPath

import pytest

from pilotrun.common.errors import CheckpointError
from pilotrun.training.checkpoint import single_file
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.checkpoint.single_file import TorchSaveStorage
from tests.exactness import assert_exactly_equal
from tests.training.checkpoint.test_checkpointer import realistic_state


def test_code_objects_are_refused_on_load(tmp_path):
    # weights_only loading: a checkpoint file that would run code when read is reported, not executed.
    checkpointer = Checkpointer(tmp_path, keep=1)
    checkpointer.save(1, {"trainer": {"when": PurePosixPath("x")}}, {})  # not a plain type
    with pytest.raises(CheckpointError, match="trainer.pt cannot be read"):
        checkpointer.load()


def test_large_parts_are_sharded_and_read_back_exactly(tmp_path):
    state = realistic_state(5)
    storage = TorchSaveStorage(shard_bytes=256)  # tiny shards: every multi-tensor part is split
    path = Checkpointer(tmp_path, keep=1, storage=storage).save(5, state, {})
    names = sorted(p.name for p in path.iterdir())
    assert "model.pt" in names and "model.000.pt" in names and "optimizer.001.pt" in names
    loaded, _ = Checkpointer(tmp_path, keep=1, storage=storage).load()
    assert_exactly_equal(state, loaded)
    # The default storage reads it too (the layout is in the files, not in the storage's settings).
    assert_exactly_equal(state, Checkpointer(tmp_path, keep=1).load()[0])
    shard = path / "optimizer.001.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer\.001\.pt does not match its recorded sha256"):
        Checkpointer(tmp_path, keep=1).load()


def test_hashing_writer_is_done_with_a_chunk_when_write_returns(tmp_path):
    # torch.save may pass a temporary buffer (a CUDA tensor's CPU copy) that is freed right after write():
    # the hash must already have consumed it. Overwrite each buffer after write() to check.
    chunks = [bytes([i]) * (3 << 20) for i in range(4)] + [b"tail"]
    with open(tmp_path / "f.bin", "wb") as handle:
        writer = single_file._HashingWriter(handle)
        for chunk in chunks:
            buffer = bytearray(chunk)
            assert writer.write(buffer) == len(chunk)
            buffer[:] = b"\xff" * len(buffer)
        digest = writer.hexdigest()
    expected = hashlib.sha256(b"".join(chunks)).hexdigest()
    assert digest == expected == hashlib.sha256((tmp_path / "f.bin").read_bytes()).hexdigest()
    assert writer.bytes_written == sum(len(c) for c in chunks)
