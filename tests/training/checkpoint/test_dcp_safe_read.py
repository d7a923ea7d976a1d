"""pilotrun/training/checkpoint/dcp_safe_read.py: a DCP folder is read without running anything stored in
it."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pilotrun.common.errors import CheckpointError
from pilotrun.training.checkpoint.dcp_safe_read import read_dcp_metadata, safe_dcp_load


class Opaque:
    """A value DCP stores as a pickle beside the tensors; a weights-only read must refuse it."""

    def __init__(self):
        self.payload = [1, 2]


class TouchOnUnpickle:
    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))


def write(folder: Path, state: dict) -> None:
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)


def test_plain_entries_are_read_back_with_and_without_a_template(tmp_path):
    state = {"w": torch.arange(6.0), "trainer": {"step": 3, "name": "x"}}
    write(tmp_path, state)
    assert "w" in read_dcp_metadata(tmp_path).state_dict_metadata
    loaded = safe_dcp_load(tmp_path, None, no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["trainer"] == {"step": 3, "name": "x"}
    template = {"w": torch.zeros(6), "trainer": {"step": 0, "name": ""}}
    safe_dcp_load(tmp_path, template, no_dist=True)
    assert torch.equal(template["w"], state["w"])


def test_a_crafted_metadata_pickle_is_refused_without_running(tmp_path):
    write(tmp_path, {"w": torch.zeros(2)})
    ran = tmp_path / "payload-ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(TouchOnUnpickle(ran)))
    with pytest.raises(CheckpointError, match="metadata .* refused"):
        read_dcp_metadata(tmp_path)
    with pytest.raises(CheckpointError, match="refused"):
        safe_dcp_load(tmp_path, None, no_dist=True)
    assert not ran.exists()


def test_a_non_tensor_entry_made_of_other_objects_is_refused(tmp_path):
    write(tmp_path, {"w": torch.zeros(2), "extra": Opaque()})
    with pytest.raises(CheckpointError, match="'extra' refused"):
        safe_dcp_load(tmp_path, None, no_dist=True)
