"""pilotrun/training/checkpoint/distributed_checkpointer.py in one process: the storage chosen by name (the
default writes as before), every checkpoint read with the storage its marker names, a registered storage
reached by name. Two ranks: test_distributed_checkpoint.py."""

from __future__ import annotations

import pytest
import torch

from pilotrun.common.errors import ConfigError
from pilotrun.training.checkpoint import storages
from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer
from pilotrun.training.checkpoint.single_file import TorchSaveStorage
from pilotrun.training.checkpoint.storages import STORAGES, StorageKind
from tests.exactness import assert_exactly_equal


def state(step: int) -> dict:
    return {"model": {"w": torch.arange(6.0) * step}, "trainer": {"step": step},
            "rng": {"torch": torch.tensor([step])}}


def test_the_default_writes_torch_save_in_one_process(tmp_path):
    checkpointer = DistributedCheckpointer(tmp_path, keep=2)
    assert checkpointer.storage is checkpointer.torch_save_storage
    checkpointer.save(1, state(1), {})
    assert checkpointer.storage_name(1) == "torch_save"


def test_a_named_storage_writes_and_every_checkpoint_reads_with_its_own(tmp_path):
    DistributedCheckpointer(tmp_path, keep=3).save(1, state(1), {})
    dcp = DistributedCheckpointer(tmp_path, keep=3, storage="torch_dcp")
    assert dcp.storage is dcp.dcp_storage
    dcp.save(2, state(2), {})
    assert [dcp.storage_name(step) for step in (1, 2)] == ["torch_save", "torch_dcp"]
    for step in (1, 2):
        assert_exactly_equal(dcp.load(step)[0], state(step))
        assert_exactly_equal(DistributedCheckpointer(tmp_path, keep=3).load(step)[0], state(step))


def test_an_unknown_storage_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match="unknown checkpoint storage 'zarr'"):
        DistributedCheckpointer(tmp_path / "run", keep=1, storage="zarr")
    assert not (tmp_path / "run").exists()


class CountingStorage(TorchSaveStorage):
    """torch.save under another name, counting its reads."""

    name = "counted"
    reads = 0

    def read(self, folder, files, template=None):
        CountingStorage.reads += 1
        return super().read(folder, files, template)


def test_a_registered_storage_is_chosen_by_name_and_read_by_its_marker(tmp_path, monkeypatch):
    counted = StorageKind("counted", lambda context: CountingStorage(), collective=False,
                          description="a test")
    monkeypatch.setattr(storages, "STORAGES", {**STORAGES, "counted": counted})
    DistributedCheckpointer(tmp_path, keep=2, storage="counted").save(3, state(3), {})
    reader = DistributedCheckpointer(tmp_path, keep=2)  # chooses torch_save, reads what the marker names
    assert reader.storage_name(3) == "counted"
    assert_exactly_equal(reader.load(3)[0], state(3))
    assert CountingStorage.reads == 1
