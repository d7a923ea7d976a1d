"""Hostile checkpoints: a crafted folder never executes code, never makes a resume read or delete anything
outside its own step folder, and is refused with one line and exit code 2 (in process, through cli.main)."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from pilotrun.commands.cli import main
from pilotrun.common.errors import CheckpointError
from pilotrun.run.marker import MARKER_NAME, step_folder_name
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.checkpoint.dcp_safe_read import unpickle_dcp_metadata
from pilotrun.training.checkpoint.dcp_storage import DCPStorage

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ["train.num_threads=1", "train.max_steps=4", "train.eval_every=0", "train.checkpoint_every=2",
          "train.keep_checkpoints=1"]


def train_argv(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    argv = ["train", "--config", str(ROOT / "configs" / "smoke.yaml"), "--data", str(data_dir),
            "--run-dir", str(run_dir)]
    for item in RECIPE:
        argv += ["--set", item]
    return argv + list(extra)


@pytest.fixture(scope="module")
def trained_run(builtin_data_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("hostile") / "run"
    assert main(train_argv(builtin_data_dir, run_dir)) == 0
    return run_dir


class _TouchOnLoad:
    """Unpickling this calls Path.touch(target): a stand-in for any code a crafted pickle could run."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.target),))


def _refused_in_one_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _rewrite_marker(step_dir: Path, files: dict[str, bytes], storage: str | None = None) -> None:
    marker = json.loads((step_dir / MARKER_NAME).read_text())
    for name in list(marker["files"]):
        if (step_dir / name).exists():
            (step_dir / name).unlink()
    marker["files"] = {}
    for name, data in files.items():
        if "/" not in name:
            (step_dir / name).write_bytes(data)
        marker["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    if storage is not None:
        marker["storage"] = storage
    (step_dir / MARKER_NAME).write_text(json.dumps(marker))


def _newest_step_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / step_folder_name(Checkpointer(run_dir, keep=1).committed_steps()[-1])


@pytest.mark.slow
def test_a_dcp_metadata_pickle_payload_is_refused_and_never_runs(
    builtin_data_dir, trained_run, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    target = tmp_path / "payload-ran"
    _rewrite_marker(_newest_step_dir(run_dir), {".metadata": pickle.dumps(_TouchOnLoad(target)),
                                                "__0_0.distcp": b"x"}, storage="torch_dcp")
    line = _refused_in_one_line(capsys, train_argv(builtin_data_dir, run_dir, "--resume", "--set",
                                                   "train.max_steps=6"))
    assert not target.exists()
    assert ".metadata" in line and "refused" in line


def test_export_of_a_crafted_dcp_checkpoint_is_refused_and_the_payload_never_runs(
    trained_run, tmp_path, capsys
):
    """Export reads a DCP checkpoint's model on one process: through the same restricted reader as resume."""
    pytest.importorskip("safetensors")
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    target = tmp_path / "payload-ran"
    _rewrite_marker(_newest_step_dir(run_dir), {".metadata": pickle.dumps(_TouchOnLoad(target)),
                                                "__0_0.distcp": b"x"}, storage="torch_dcp")
    line = _refused_in_one_line(capsys, ["export", str(run_dir), "--out", str(tmp_path / "hf")])
    assert not target.exists()
    assert ".metadata" in line and "refused" in line
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_the_verdict_never_hashes_a_file_a_marker_names_outside_its_step_folder(
    trained_run, tmp_path, capsys
):
    """The verdict's final-checkpoint rule rehashes a marker's files without loading them; a name that leaves
    the step folder is refused there too, not opened."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not part of the run")
    step_dir = _newest_step_dir(run_dir)
    marker = json.loads((step_dir / MARKER_NAME).read_text())
    marker["files"] = {"../../../outside.txt": {"sha256": hashlib.sha256(outside.read_bytes()).hexdigest(),
                                                "bytes": outside.stat().st_size}}
    (step_dir / MARKER_NAME).write_text(json.dumps(marker))
    capsys.readouterr()
    code = main(["verdict", str(run_dir), "--json", "--no-resume-required"])
    rules = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rules"]}
    assert code == 1 and rules["final_checkpoint"]["status"] == "FAIL"
    assert "not a plain file name inside the step folder" in rules["final_checkpoint"]["figure"]


def test_a_dcp_bytes_entry_payload_is_refused_and_never_runs(tmp_path):
    folder = tmp_path / "dcp"
    folder.mkdir()
    target = tmp_path / "payload-ran"
    DCPStorage().write({"weights": {"w": torch.ones(2)}, "extra": _TouchOnLoad(target)}, folder)
    with pytest.raises(CheckpointError, match="extra"):
        DCPStorage().read(folder, sorted(p.name for p in folder.iterdir()))
    with pytest.raises(CheckpointError, match="extra"):
        DCPStorage().read(folder, [], template={"weights": {"w": torch.zeros(2)}, "extra": None})
    assert not target.exists()


def test_a_real_dcp_checkpoint_still_reads_through_the_restricted_reader(tmp_path):
    folder = tmp_path / "dcp"
    folder.mkdir()
    state = {
        "model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
        "trainer": {"step": 7, "losses": [1.5, 2.25], "name": "x"},
        "rng": {"cpu": torch.get_rng_state()},
    }
    DCPStorage().write(state, folder)
    loaded = DCPStorage().read(folder, sorted(p.name for p in folder.iterdir()))
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert torch.equal(loaded["model"]["b"], state["model"]["b"])
    assert torch.equal(loaded["rng"]["cpu"], state["rng"]["cpu"])
    assert loaded["trainer"] == state["trainer"]
    template = {"model": {"w": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)},
                "trainer": {"step": 0, "losses": [0.0, 0.0], "name": ""}, "rng": {"cpu": torch.zeros_like(
                    state["rng"]["cpu"])}}
    into = DCPStorage().read(folder, [], template=template)
    assert torch.equal(into["model"]["w"], state["model"]["w"]) and into["trainer"] == state["trainer"]


def test_the_restricted_unpickler_refuses_any_other_global(tmp_path):
    with pytest.raises(CheckpointError, match="os.system|posix.system"):
        unpickle_dcp_metadata(pickle.dumps(os.system), tmp_path / ".metadata")
    with pytest.raises(CheckpointError, match="not torch.distributed.checkpoint Metadata"):
        unpickle_dcp_metadata(pickle.dumps({"a": 1}), tmp_path / ".metadata")
    with pytest.raises(CheckpointError):
        unpickle_dcp_metadata(b"\x80\x04garbage", tmp_path / ".metadata")


def test_a_marker_naming_a_file_outside_the_step_folder_is_refused(
    builtin_data_dir, trained_run, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    outside = tmp_path / "outside.txt"
    outside.write_text("not a checkpoint")
    step_dir = _newest_step_dir(run_dir)
    marker = json.loads((step_dir / MARKER_NAME).read_text())
    data = outside.read_bytes()
    marker["files"] = {
        "../../../outside.txt": {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    }
    (step_dir / MARKER_NAME).write_text(json.dumps(marker))
    line = _refused_in_one_line(capsys, train_argv(builtin_data_dir, run_dir, "--resume", "--set",
                                                   "train.max_steps=6"))
    assert "../../../outside.txt" in line and "plain file name" in line
    marker["files"] = {"/etc/passwd": {"sha256": "0" * 64, "bytes": 1}}
    (step_dir / MARKER_NAME).write_text(json.dumps(marker))
    assert "plain file name" in _refused_in_one_line(
        capsys, train_argv(builtin_data_dir, run_dir, "--resume")
    )


@pytest.mark.slow
def test_a_symlinked_step_folder_is_refused_and_never_pruned_through(
    builtin_data_dir, trained_run, tmp_path, capsys
):
    other = tmp_path / "other-run"
    shutil.copytree(trained_run, other)
    other_marker = _newest_step_dir(other) / MARKER_NAME
    other_bytes = other_marker.read_bytes()
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    newest = _newest_step_dir(run_dir)
    link = run_dir / "checkpoints" / step_folder_name(int(newest.name.split("-")[1]) + 100)
    link.symlink_to(_newest_step_dir(other), target_is_directory=True)
    line = _refused_in_one_line(capsys, train_argv(builtin_data_dir, run_dir, "--resume", "--set",
                                                   "train.max_steps=6"))
    assert "symbolic link" in line and link.name in line
    # Resuming from the real step below the link saves and prunes (keep=1): the link and the other run stay.
    step = int(newest.name.split("-")[1])
    assert main(train_argv(builtin_data_dir, run_dir, "--resume", "--from-step", str(step), "--set",
                           "train.max_steps=6")) == 0
    assert other_marker.read_bytes() == other_bytes
    assert link.is_symlink()
    capsys.readouterr()


def test_a_linked_checkpoints_folder_is_refused_and_never_pruned(
    builtin_data_dir, trained_run, tmp_path, capsys
):
    other = tmp_path / "other-run"
    shutil.copytree(trained_run, other)
    before = sorted(str(p.relative_to(other)) for p in other.rglob("*"))
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "checkpoints").symlink_to(other / "checkpoints", target_is_directory=True)
    line = _refused_in_one_line(capsys, train_argv(builtin_data_dir, run_dir, "--resume", "--set",
                                                   "train.max_steps=6"))
    assert "symbolic link" in line
    assert sorted(str(p.relative_to(other)) for p in other.rglob("*")) == before


def test_dcp_metadata_naming_a_data_file_outside_the_folder_is_refused(tmp_path):
    folder = tmp_path / "dcp"
    folder.mkdir()
    DCPStorage().write({"model": {"w": torch.ones(2)}}, folder)
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../outside.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="outside.distcp"):
        DCPStorage().read(folder, [], template={"model": {"w": torch.zeros(2)}})
