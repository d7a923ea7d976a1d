"""pilotrun/training/checkpoint/dcp_storage.py in one process: the DCP storage's round trip with per-rank
keys, the checkpointer for any world size reading with the storage its marker names, and a damaged marker's
missing part. The collective paths (two ranks, FSDP2) are in test_distributed_checkpoint.py and
test_distributed_trainer.py."""

from __future__ import annotations

import pytest
import torch

from pilotrun.common.errors import CheckpointError
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.checkpoint.dcp_storage import DCPStorage, check_parts
from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer
from pilotrun.training.checkpoint.single_file import TorchSaveStorage
from tests.exactness import assert_exactly_equal


def state(step: int) -> dict:
    return {"model": {"w": torch.arange(12.0).reshape(3, 4) * step}, "trainer": {"step": step, "name": "x"},
            "rng": {"torch": torch.tensor([step], dtype=torch.int64)}}


def test_dcp_storage_round_trip_stores_rng_per_rank(tmp_path):
    path = Checkpointer(tmp_path, keep=2, storage=DCPStorage()).save(2, state(2), {"step": 2})
    assert any(p.suffix == ".distcp" for p in path.iterdir()) and (path / ".metadata").is_file()
    checkpointer = DistributedCheckpointer(tmp_path, keep=2)
    assert checkpointer.storage_name(2) == DCPStorage.name
    loaded, meta = checkpointer.load(2)  # without a template: plain tensors, the rng entry under its own name
    assert meta == {"step": 2}
    assert_exactly_equal(loaded, state(2))
    template = state(0)
    loaded, _ = checkpointer.load(2, template)  # in place into a template
    assert_exactly_equal(loaded["model"], state(2)["model"])


def test_one_process_writes_torch_save_and_reads_either(tmp_path):
    checkpointer = DistributedCheckpointer(tmp_path, keep=3)
    checkpointer.save(1, state(1), {})
    assert checkpointer.storage_name(1) == TorchSaveStorage.name
    Checkpointer(tmp_path, keep=3, storage=DCPStorage()).save(2, state(2), {})
    assert checkpointer.committed_steps() == [1, 2]
    assert_exactly_equal(checkpointer.load(1)[0], state(1))
    assert_exactly_equal(checkpointer.load()[0], state(2))
    with pytest.raises(CheckpointError, match="no committed checkpoint at step 5"):
        checkpointer.storage_name(5)


def test_a_missing_part_is_named():
    check_parts({"model": 1, "rng": 2}, ["model", "rng"], 4)
    with pytest.raises(CheckpointError, match="checkpoint step 4 lacks optimizer, scaler"):
        check_parts({"model": 1}, ["model", "optimizer", "scaler"], 4)
