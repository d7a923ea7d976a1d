"""pilotrun/training/checkpoint/dcp_file_writer.py: each tensor's record is the archive torch.save writes
without its CRC32, byte for byte, handed to the stream in three pieces; the files load with DCP's own reader
bit for bit (views, empty and 0-d tensors, serialized values included), and lay out alike what DCP's own
writer lays out; the items are spread over the files by size; a writer thread's failure is raised."""

from __future__ import annotations

import contextlib
import io
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import WriteItemType

from pilotrun.training.checkpoint import dcp_file_writer
from pilotrun.training.checkpoint.background import _HashingFileSystemWriter
from pilotrun.training.checkpoint.dcp_file_writer import serialize_tensor, split_items
from pilotrun.training.checkpoint.dcp_safe_read import read_dcp_metadata, safe_dcp_load
from tests.exactness import assert_exactly_equal

TENSORS = {
    "matrix": torch.randn(300, 70),  # 84 KB: its bytes go to the stream in one piece
    "bf16": torch.randn(40, 3).to(torch.bfloat16),
    "scalar": torch.tensor(7.5, dtype=torch.float64),
    "empty": torch.empty(0, 4),
    "ints": torch.arange(10, dtype=torch.int64),
}


@contextlib.contextmanager
def crc32_off():
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(True)


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_a_tensor_record_is_torch_saves_archive_without_its_crc_byte_for_byte(name):
    tensor, pieces = TENSORS[name], []
    serialize_tensor(tensor, lambda data: pieces.append(bytes(data)) or len(data))
    with crc32_off():
        expected = io.BytesIO()
        torch.save(tensor, expected)
    assert b"".join(pieces) == expected.getvalue()
    assert len(pieces) <= 3  # the headers before the bytes, the bytes, the rest: not one write per record
    loaded = torch.load(io.BytesIO(b"".join(pieces)), weights_only=True)
    assert loaded.dtype == tensor.dtype and torch.equal(loaded, tensor)


def test_the_tensor_bytes_are_one_piece_and_the_small_ones_are_copied():
    tensor, pieces = TENSORS["matrix"], []
    serialize_tensor(tensor, lambda data: pieces.append(data) or len(data))
    assert [len(piece) for piece in pieces].count(tensor.nbytes) == 1
    assert all(isinstance(piece, bytearray) for piece in pieces if len(piece) != tensor.nbytes)


def a_state() -> dict:
    base = torch.randn(64, 64)
    return {
        "model": {**TENSORS, "view": base[8:24]},  # a view of a larger storage: written alone
        "trainer": {"step": 3, "cursor": [1, 2], "name": "r"},
        "rng__rank0": torch.arange(7, dtype=torch.uint8),
    }


def save(state: dict, folder: Path, writer) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(state, storage_writer=writer, no_dist=True)


def test_files_written_here_load_with_dcps_reader_bit_for_bit_and_lay_out_as_dcps_own(tmp_path):
    state = a_state()
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    save(state, ours, _HashingFileSystemWriter(str(ours), single_file_per_rank=True, sync_files=True,
                                                thread_count=2))
    save(state, theirs, dcp.FileSystemWriter(str(theirs), single_file_per_rank=True, sync_files=True,
                                             thread_count=2))
    for folder in (ours, theirs):
        assert_exactly_equal(safe_dcp_load(folder, None, True), state, folder.name)
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    ours_meta, theirs_meta = read_dcp_metadata(ours), read_dcp_metadata(theirs)
    assert ours_meta.state_dict_metadata == theirs_meta.state_dict_metadata
    assert ours_meta.storage_data.keys() == theirs_meta.storage_data.keys()
    view = next(info for index, info in ours_meta.storage_data.items() if index.fqn == "model.view")
    assert view.length < state["model"]["view"].untyped_storage().nbytes()  # not the whole base storage


def test_the_items_are_spread_over_the_files_by_size(tmp_path):
    plan_items = []

    class Recording(_HashingFileSystemWriter):
        def write_data(self, plan, planner):
            plan_items.extend(plan.items)
            return super().write_data(plan, planner)

    state = {"big": torch.randn(1000), "mid": torch.randn(600), "small": torch.randn(300), "x": 1, "y": "z"}
    save(state, tmp_path / "c", Recording(str(tmp_path / "c"), thread_count=2))
    files = split_items(plan_items, 2)
    assert sorted(id(item) for item in plan_items) == sorted(id(item) for f in files for item in f)
    sizes = [sum(dcp_file_writer._item_bytes(item) for item in f) for f in files]
    assert sorted(sizes) == [3600, 4000]  # big alone; mid + small
    assert all(any(item.type == WriteItemType.BYTE_IO for item in f) for f in files)
    assert [len(f) for f in split_items(plan_items, 8)] == [2, 2, 1]  # a file per tensor, no empty one


def test_a_writer_threads_failure_is_raised_once_every_thread_stopped(tmp_path, monkeypatch):
    stopped, write_file = [], dcp_file_writer.write_file

    def failing_second(create_stream, folder, name, items, planner, sync):
        if name.endswith("1"):
            raise OSError(28, "No space left on device")
        try:
            return write_file(create_stream, folder, name, items, planner, sync)
        finally:
            stopped.append(threading.current_thread().name)

    monkeypatch.setattr(dcp_file_writer, "write_file", failing_second)
    with pytest.raises(OSError, match="No space left"):
        dcp_file_writer.write_files(open, tmp_path, [("f0", []), ("f1", [])], planner=None, sync=True)
    assert stopped == [threading.current_thread().name] and (tmp_path / "f0").exists()
