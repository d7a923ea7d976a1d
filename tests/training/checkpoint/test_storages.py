"""pilotrun/training/checkpoint/storages.py: every registered storage, each registered whole (built under its
marker name, with a write and a read, a module of its own, a collective flag and a description), and the
choice a run makes: today's by default, a named one where the world size allows it, one line otherwise."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from pilotrun.common.errors import ConfigError
from pilotrun.training.checkpoint import storages
from pilotrun.training.checkpoint.storages import AUTOMATIC, STORAGES, chosen_storage
from pilotrun.training.distributed import SINGLE_PROCESS, DistributedContext

TWO_RANKS = DistributedContext(rank=0, world_size=2)


def half_registrations() -> list[str]:
    """What a storage's registration lacks: a builder whose storage carries the registered name, `write` and
    `read`, a module of its own; a collective flag; a one-line description."""
    found, homes = [], {}
    for name, kind in storages.STORAGES.items():
        built = kind.build(SINGLE_PROCESS) if callable(kind.build) else None
        if built is None or getattr(built, "name", None) != name:
            found.append(f"{name}: its builder does not build a storage named {name!r}")
        elif not all(callable(getattr(built, method, None)) for method in ("write", "read")):
            found.append(f"{name}: its storage lacks write or read")
        elif homes.setdefault(inspect.getmodule(type(built)), name) != name:
            found.append(f"{name}: shares a module with {homes[inspect.getmodule(type(built))]}")
        if not isinstance(kind.collective, bool):
            found.append(f"{name}: not said whether it is collective")
        if not isinstance(kind.description, str) or not kind.description.strip() or "\n" in kind.description:
            found.append(f"{name}: no one-line description")
    return found


def test_every_storage_is_registered_whole():
    assert [(kind.name, kind.collective) for kind in STORAGES.values()] == [("torch_save", False),
                                                                         ("torch_dcp", True)]
    assert half_registrations() == []


def test_a_half_registered_storage_is_named(monkeypatch):
    planted = dataclasses.replace(STORAGES["torch_save"], name="zarr", collective=None, description="")
    monkeypatch.setattr(storages, "STORAGES", {**STORAGES, "zarr": planted})
    assert half_registrations() == ["zarr: its builder does not build a storage named 'zarr'",
                                    "zarr: not said whether it is collective",
                                    "zarr: no one-line description"]


def test_the_default_is_the_choice_by_world_size():
    assert chosen_storage(AUTOMATIC, SINGLE_PROCESS) == "torch_save"
    assert chosen_storage(AUTOMATIC, TWO_RANKS) == "torch_dcp"
    assert chosen_storage("torch_dcp", SINGLE_PROCESS) == "torch_dcp"
    assert chosen_storage("torch_save", SINGLE_PROCESS) == "torch_save"


def test_an_unknown_or_unfit_storage_is_one_line():
    with pytest.raises(ConfigError, match=r"^unknown checkpoint storage 'zarr' \(known: auto, torch_save, "
                       r"torch_dcp\)$"):
        chosen_storage("zarr", SINGLE_PROCESS)
    with pytest.raises(ConfigError, match=r"^checkpoint storage 'torch_save' is written by one process; "
                       r"a run of 2 ranks needs a collective one \(torch_dcp\)$"):
        chosen_storage("torch_save", TWO_RANKS)


def test_the_recipe_offers_exactly_the_registered_storages():
    from pilotrun.config.train import CHECKPOINT_STORAGES

    assert CHECKPOINT_STORAGES == (AUTOMATIC, *STORAGES)


def test_a_run_writes_with_the_storage_its_recipe_names_and_resumes_across_storages(
    builtin_data_dir, tmp_path
):
    """train.checkpoint.storage picks the writer; a resume reads with the storage the marker names, so a
    run saved with DCP and continued with torch.save ends with the weights of a run that never stopped."""
    import json
    from pathlib import Path

    import torch

    from pilotrun.commands.cli import main

    smoke = str(Path(__file__).resolve().parents[3] / "configs" / "smoke.yaml")

    def train(run_dir, *extra):
        return main(["train", "--config", smoke, "--data", str(builtin_data_dir), "--run-dir", str(run_dir),
                     "--set", "train.num_threads=1", "--progress", "none", *extra])

    def marker(run_dir, step):
        return json.loads((run_dir / "checkpoints" / f"step-{step:08d}" / "COMMITTED.json").read_text())

    assert (
        train(tmp_path / "a", "--set", "train.max_steps=2", "--set", "train.checkpoint.storage=torch_dcp")
        == 0
    )
    assert marker(tmp_path / "a", 2)["storage"] == "torch_dcp"
    assert train(tmp_path / "a", "--resume", "--set", "train.max_steps=4",
                 "--set", "train.checkpoint.storage=torch_save") == 0
    assert marker(tmp_path / "a", 4)["storage"] == "torch_save"
    assert train(tmp_path / "b", "--set", "train.max_steps=4") == 0
    resumed = torch.load(tmp_path / "a" / "checkpoints" / "step-00000004" / "model.pt", weights_only=True)
    straight = torch.load(tmp_path / "b" / "checkpoints" / "step-00000004" / "model.pt", weights_only=True)
    assert resumed.keys() == straight.keys()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
