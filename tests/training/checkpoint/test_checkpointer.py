"""Checkpointer policy and torch.save storage: commit marker, hashes, pruning, damaged and uncommitted
folders."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from pilotrun.common.errors import CheckpointError
from pilotrun.run.marker import MARKER_NAME, step_folder_name
from pilotrun.training.checkpoint import checkpointer as checkpoint_module
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.checkpoint.rng_state import capture_rng_state
from pilotrun.training.checkpoint.single_file import TorchSaveStorage
from tests.exactness import assert_exactly_equal

ROOT = Path(__file__).resolve().parents[3]


def realistic_state(seed: int) -> dict:
    """The shape of what the trainer saves: model, a stepped optimizer, a scaler, counters and RNG."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 8)).square().mean().backward()
    optimizer.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=True)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "trainer": {"step": seed, "tokens_seen": 128 * seed, "loader": {"train": {"batch_index": seed}},
                    "qk_clip": {"cumulative": torch.zeros(2, 4, dtype=torch.int64)}},
        "rng": capture_rng_state(),
    }


def test_save_load_round_trip_is_exact(tmp_path):
    state = realistic_state(3)
    meta = {"recipe": {"train": {"max_steps": 10}}, "world_size": 1, "loss": 2.5}
    path = Checkpointer(tmp_path, keep=2).save(3, state, meta)
    assert path == tmp_path / "checkpoints" / "step-00000003"
    loaded, loaded_meta = Checkpointer(tmp_path, keep=2).load()
    assert_exactly_equal(state, loaded)
    assert loaded_meta == meta


def test_marker_lists_every_file_with_its_true_sha256(tmp_path):
    # The hashes are computed while writing; check them against an independent reread of each file.
    path = Checkpointer(tmp_path, keep=1).save(7, realistic_state(7), {"a": 1})
    marker = json.loads((path / MARKER_NAME).read_text())
    assert marker["step"] == 7 and marker["meta"] == {"a": 1}
    files_on_disk = sorted(p.name for p in path.iterdir() if p.name != MARKER_NAME)
    assert sorted(marker["files"]) == files_on_disk == ["model.pt", "optimizer.pt", "rng.pt", "scaler.pt",
                                                        "trainer.pt"]
    for name, entry in marker["files"].items():
        data = (path / name).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["bytes"] == len(data)


def test_marker_is_written_after_the_rename(tmp_path, monkeypatch):
    # Record the order of renames: every data file lands (via the folder rename) before the marker appears.
    events = []
    real_rename = os.rename

    def recording_rename(src, dst):
        events.append((os.path.basename(str(src)), os.path.basename(str(dst))))
        return real_rename(src, dst)

    monkeypatch.setattr(checkpoint_module.os, "rename", recording_rename)
    Checkpointer(tmp_path, keep=1).save(1, {"model": {"w": torch.ones(2)}}, {})
    assert events[0][1] == "step-00000001" and events[0][0].startswith(".tmp-")
    assert events[-1] == (MARKER_NAME + ".tmp", MARKER_NAME)


def test_committed_steps_and_pruning_keep_the_newest(tmp_path):
    checkpointer = Checkpointer(tmp_path, keep=2)
    for step in (10, 20, 30, 40):
        checkpointer.save(step, {"trainer": {"step": step}}, {"step": step})
    assert checkpointer.committed_steps() == [30, 40]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000030", "step-00000040"]


class ExplodingStorage(TorchSaveStorage):
    """Writes one file, then fails like a full disk would."""

    def write(self, state, folder):
        super().write({"model": state["model"]}, folder)
        raise OSError("No space left on device (simulated)")


def test_failed_save_commits_nothing_and_prunes_nothing(tmp_path):
    good = Checkpointer(tmp_path, keep=2)
    good.save(1, {"model": {"w": torch.zeros(3)}}, {})
    good.save(2, {"model": {"w": torch.ones(3)}}, {})
    failing = Checkpointer(tmp_path, keep=2, storage=ExplodingStorage())
    with pytest.raises(OSError, match="simulated"):
        failing.save(3, {"model": {"w": torch.full((3,), 2.0)}}, {})
    assert failing.committed_steps() == [1, 2]  # step 1 not pruned: the new one never committed
    assert failing.uncommitted_folders() == []  # the temp folder was removed
    state, _ = failing.load()
    assert torch.equal(state["model"]["w"], torch.ones(3))


def test_folder_without_marker_is_never_loaded_and_cleaned_by_next_save(tmp_path):
    checkpointer = Checkpointer(tmp_path, keep=3)
    checkpointer.save(5, {"model": {"w": torch.zeros(2)}}, {})
    # What a crash between the folder rename and the marker leaves: complete-looking files, no marker.
    checkpointer.save(6, {"model": {"w": torch.ones(2)}}, {})
    (tmp_path / "checkpoints" / step_folder_name(6) / MARKER_NAME).unlink()
    (tmp_path / "checkpoints" / ".tmp-step-00000007-123").mkdir()
    assert checkpointer.committed_steps() == [5]
    state, _ = checkpointer.load()
    assert torch.equal(state["model"]["w"], torch.zeros(2))
    with pytest.raises(CheckpointError, match="no committed checkpoint at step 6"):
        checkpointer.load(step=6)
    assert len(checkpointer.uncommitted_folders()) == 2
    checkpointer.save(8, {"model": {"w": torch.ones(2)}}, {})
    assert checkpointer.uncommitted_folders() == []
    assert checkpointer.committed_steps() == [5, 8]
    assert any("uncommitted" in note for note in checkpointer.notes)


def test_no_committed_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "checkpoints" / "step-00000004").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"no committed checkpoint in .*\(1 uncommitted folder"):
        Checkpointer(tmp_path, keep=1).load()


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete"])
def test_damaged_file_is_named_and_an_earlier_step_suggested(tmp_path, damage):
    checkpointer = Checkpointer(tmp_path, keep=3)
    checkpointer.save(10, realistic_state(1), {})
    checkpointer.save(20, realistic_state(2), {})
    victim = tmp_path / "checkpoints" / step_folder_name(20) / "optimizer.pt"
    data = bytearray(victim.read_bytes())
    if damage == "flip_byte":
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[:-10]))
    else:
        victim.unlink()
    with pytest.raises(CheckpointError, match=r"step-00000020/optimizer\.pt .*--from-step 10"):
        checkpointer.load()
    state, _ = checkpointer.load(step=10)  # the earlier checkpoint is still intact and loadable
    assert_exactly_equal(state, realistic_state(1) | {"rng": state["rng"]})


def test_load_of_a_missing_step_lists_the_committed_ones(tmp_path):
    checkpointer = Checkpointer(tmp_path, keep=3)
    for step in (1, 2):
        checkpointer.save(step, {"trainer": {"step": step}}, {})
    with pytest.raises(CheckpointError, match=r"step 9 .*committed: 1, 2"):
        checkpointer.load(step=9)
    state, _ = checkpointer.load(step=1)
    assert state["trainer"]["step"] == 1


def test_saving_an_earlier_step_drops_the_abandoned_later_timeline(tmp_path):
    # A resume with --from-step 10 continues a different timeline than steps 20 and 30; a later plain --resume
    # must not pick those up as "newest".
    checkpointer = Checkpointer(tmp_path, keep=5)
    for step in (10, 20, 30):
        checkpointer.save(step, {"trainer": {"step": step}}, {})
    checkpointer.save(15, {"trainer": {"step": 15}}, {})
    assert checkpointer.committed_steps() == [10, 15]
    assert any("later than the resumed timeline" in note for note in checkpointer.notes)


def test_same_step_saved_again_is_replaced_atomically(tmp_path):
    checkpointer = Checkpointer(tmp_path, keep=2)
    checkpointer.save(4, {"model": {"w": torch.zeros(2)}}, {"session": 1})
    checkpointer.save(4, {"model": {"w": torch.ones(2)}}, {"session": 2})
    state, meta = checkpointer.load()
    assert torch.equal(state["model"]["w"], torch.ones(2)) and meta == {"session": 2}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000004"]


def test_interrupted_replacement_is_recovered(tmp_path):
    checkpointer = Checkpointer(tmp_path, keep=2)
    checkpointer.save(4, {"model": {"w": torch.zeros(2)}}, {"session": 1})
    root = tmp_path / "checkpoints"
    # A crash after moving the old step-4 aside and renaming the new one in, before its marker was written.
    os.rename(root / "step-00000004", root / ".replaced-step-00000004")
    (root / "step-00000004").mkdir()
    (root / "step-00000004" / "model.pt").write_bytes(b"half")
    before = sorted(p.name for p in root.iterdir())
    reader = Checkpointer(tmp_path, keep=2)
    assert reader.committed_steps() == [4]  # the old copy is still step 4's committed checkpoint
    state, meta = reader.load()
    assert torch.equal(state["model"]["w"], torch.zeros(2)) and meta == {"session": 1}
    assert sorted(p.name for p in root.iterdir()) == before  # reading repaired nothing behind a writer's back
    writer = Checkpointer(tmp_path, keep=2)
    writer.save(5, {"model": {"w": torch.ones(2)}}, {"session": 2})
    assert any("restored step-00000004" in note for note in writer.notes)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000005"]
    assert torch.equal(writer.load(step=4)[0]["model"]["w"], torch.zeros(2))


def test_meta_must_be_json(tmp_path):
    with pytest.raises(TypeError, match="JSON"):
        Checkpointer(tmp_path, keep=1).save(1, {"model": {}}, {"bad": object()})
    assert Checkpointer(tmp_path, keep=1).committed_steps() == []




KILLED_WRITER = """
import sys, torch
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from tests.training.checkpoint import checkpoint_faults
getattr(checkpoint_faults, sys.argv[3])(30)
checkpointer = Checkpointer(sys.argv[1], keep=1)
checkpointer.save(int(sys.argv[2]), {"model": {"w": torch.full((1000,), float(sys.argv[2]))},
                                     "trainer": {"step": int(sys.argv[2])}}, {"step": int(sys.argv[2])})
"""


def _wait_for(predicate, timeout_s: float = 300.0) -> None:
    # Only a guard against a hang: the child imports torch first, which takes tens of seconds on a busy
    # machine.
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the writer never reached the expected phase"
        time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["writing_files", "renamed_before_marker"])
def test_sigkill_during_a_write_leaves_nothing_loadable_half_written(tmp_path, phase):
    import signal
    import subprocess
    import sys

    root = tmp_path / "checkpoints"
    Checkpointer(tmp_path, keep=1).save(1, {"model": {"w": torch.full((1000,), 1.0)}, "trainer": {"step": 1}},
                                        {"step": 1})
    # Pause 30 s inside the chosen phase, so the kill lands there (the writer never gets to sleep it out).
    fault = "delay_each_file" if phase == "writing_files" else "delay_commit"
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path), "2", fault], cwd=ROOT)
    try:
        if phase == "writing_files":
            _wait_for(
                lambda: any(p.name.startswith(".tmp-") and (p / "model.pt").exists() for p in root.iterdir())
            )
        else:
            _wait_for(lambda: (root / "step-00000002").is_dir())
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    checkpointer = Checkpointer(tmp_path, keep=1)
    assert checkpointer.committed_steps() == [1]  # keep=1 did not prune step 1: step 2 never committed
    assert len(checkpointer.uncommitted_folders()) == 1
    state, meta = checkpointer.load()
    assert meta == {"step": 1} and torch.equal(state["model"]["w"], torch.full((1000,), 1.0))
    checkpointer.save(3, {"model": {"w": torch.zeros(1)}}, {})
    assert checkpointer.uncommitted_folders() == [] and checkpointer.committed_steps() == [3]






def test_damaged_marker_is_named_and_other_steps_stay_loadable(tmp_path):
    checkpointer = Checkpointer(tmp_path, keep=3)
    checkpointer.save(1, {"model": {"w": torch.zeros(2)}}, {"step": 1})
    checkpointer.save(2, {"model": {"w": torch.ones(2)}}, {"step": 2})
    marker = tmp_path / "checkpoints" / step_folder_name(2) / MARKER_NAME
    marker.write_text(marker.read_text()[:40])
    assert checkpointer.committed_steps() == [1, 2]  # still counted: --resume must not silently skip it
    with pytest.raises(CheckpointError, match=r"step-00000002/COMMITTED\.json is unreadable.*--from-step 1"):
        checkpointer.load()
    with pytest.raises(CheckpointError, match="COMMITTED.json is unreadable"):
        checkpointer.meta(2)
    state, meta = checkpointer.load(step=1)
    assert torch.equal(state["model"]["w"], torch.zeros(2)) and meta == {"step": 1}


def test_a_later_checkpoint_that_cannot_be_moved_aside_is_refused_before_training(tmp_path, monkeypatch):
    """--from-step 3 with a committed step 4 that cannot be moved (immutable, read-only): refused at once,
    naming it, every folder as it was; a movable one passes the probe and is back in place."""
    import os as os_module

    from pilotrun.common.errors import CheckpointError
    from pilotrun.training.checkpoint import checkpointer as module

    checkpointer = Checkpointer(tmp_path, keep=5)
    for step in (2, 3, 4):
        checkpointer.save(step, {"model": {"w": torch.full((2,), float(step))}}, {"step": step})
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    checkpointer.check_later_removable(3)  # movable: probed and put back
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    real = os_module.rename

    def immutable(src, dst, *args, **kwargs):
        if "step-00000004" in str(src):
            raise PermissionError(1, "Operation not permitted", str(src))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(module.os, "rename", immutable)
    with pytest.raises(
        CheckpointError,
        match=r"step-00000004: a checkpoint after the resumed step 3 cannot be moved "
        r"aside or removed \(Operation not permitted\)",
    ):
        checkpointer.check_later_removable(3)
    checkpointer.check_later_removable(4)  # nothing after step 4
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
