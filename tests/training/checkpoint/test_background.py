"""pilotrun/training/checkpoint/background.py and the checkpoint callback's background saves
(`train.checkpoint_mode=background`): the state is staged before the call returns (the loop may change it at
once), the write commits behind the same marker, a run with background saves equals one with synchronous saves
bit for bit (1 process and 2 gloo ranks), a SIGKILL inside the background write leaves no marker and the
resume is bit-exact, a save due while one writes waits and says so, and a full disk ends the session
cleanly. The parameters and the optimizer's state may be copied beside the next update (held until its
optimizer step): equal to a synchronous save of the same step bit for bit, and a SIGKILL or a failure during
that copy leaves no marker."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem

from pilotrun.common.errors import CheckpointError
from pilotrun.common.thread_priority import BACKGROUND_NICENESS
from pilotrun.config import load_run_config
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.run.marker import MARKER_NAME
from pilotrun.training.checkpoint import background, host_staging
from pilotrun.training.checkpoint.background import (
    finish_background_save,
    out_of_space,
    start_background_save,
)
from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer
from pilotrun.training.trainer import Trainer
from tests.exactness import assert_exactly_equal
from tests.training.checkpoint import checkpoint_faults

ROOT = Path(__file__).resolve().parents[3]


def recipe(mode: str, *overrides: str):
    return load_run_config(
        ROOT / "configs" / "smoke.yaml",
        [
            "train.num_threads=1",
            "train.max_steps=6",
            "train.log_every=2",
            "train.checkpoint_every=2",
            "train.eval_every=0",
            "train.keep_checkpoints=5",
            "optim.schedule.horizon=10",
            "optim.qk_clip.tau=0.005",
            f"train.checkpoint_mode={mode}",
            *overrides,
        ],
    )


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for event in events(run_dir):
        if event["event"] == "train":
            out.setdefault(event["step"], []).append(event["loss"])
    return out


def train(config, data_dir: Path, run_dir: Path, **kwargs):
    out = io.StringIO()
    result = Trainer(config, data_dir, run_dir, progress=False, out=out, **kwargs).run()
    return result, out.getvalue()


# ---------------------------------------------------------------------------------------------- the save
# itself
def test_the_state_is_staged_before_the_call_returns_and_commits_behind_the_marker(tmp_path):
    checkpointer = DistributedCheckpointer(tmp_path / "run", keep=2)
    weights = torch.randn(64, 64)
    before = weights.clone()
    state = {
        "model": {"w": weights},
        "trainer": {"step": 3, "cursor": [1, 2]},
        "rng": torch.arange(4, dtype=torch.uint8),
    }
    pending = start_background_save(checkpointer, 3, state, {"run_id": "r"})
    weights.add_(1.0)  # the loop trains on at once
    state["trainer"]["cursor"].append(3)
    assert not (checkpointer.root / "step-00000003" / MARKER_NAME).exists() or pending.done()
    path = finish_background_save(checkpointer, pending)
    assert (path / MARKER_NAME).is_file() and checkpointer.committed_steps() == [3]
    checkpointer.verify(3)  # every file's hash, computed in DCP's thread, matches a rehash
    loaded, meta = checkpointer.load(3)
    assert torch.equal(loaded["model"]["w"], before) and loaded["trainer"] == {"step": 3, "cursor": [1, 2]}
    assert meta == {"run_id": "r"} and checkpointer.storage_name(3) == "torch_dcp"


def test_stable_tensors_are_staged_beside_the_loop_until_wait_staged(tmp_path, monkeypatch):
    checkpointer = DistributedCheckpointer(tmp_path / "run", keep=2)
    weights, bias = torch.randn(64, 64), torch.randn(8)
    before = {"w": weights.clone(), "b": bias.clone()}
    released, copy_later = threading.Event(), host_staging.copy_later

    def held(pairs, staged, future):
        released.wait()
        copy_later(pairs, staged, future)

    monkeypatch.setattr(host_staging, "copy_later", held)
    state = {"model": {"w": weights, "b": bias}, "trainer": {"step": 3}}
    pending = start_background_save(checkpointer, 3, state, {"run_id": "r"},
                                    stable=frozenset({weights.untyped_storage().data_ptr()}))
    assert not pending.staged_and_waited() and not pending.done()
    bias.add_(1.0)  # not stable: copied before the call returned
    released.set()
    assert pending.wait_staged() >= 0 and pending.staged_and_waited() and pending.held_seconds >= 0
    weights.add_(1.0)  # the optimizer steps once the copy is done
    finish_background_save(checkpointer, pending)
    loaded, _ = checkpointer.load(3)
    assert torch.equal(loaded["model"]["w"], before["w"]) and torch.equal(loaded["model"]["b"], before["b"])


def test_a_failure_during_staging_leaves_no_marker_and_no_folder(tmp_path, monkeypatch):
    def failing(buffer, source):
        raise OSError(errno.EIO, "staging copy failed")

    monkeypatch.setattr(host_staging, "copy_bytes", failing)
    checkpointer = DistributedCheckpointer(tmp_path / "run", keep=2)
    weights = torch.randn(16, 16)
    pending = start_background_save(checkpointer, 1, {"model": {"w": weights}}, {},
                                    stable=frozenset({weights.untyped_storage().data_ptr()}))
    pending.wait_staged()  # the failure is the write's, told by the commit
    with pytest.raises(CheckpointError, match="staging copy failed"):
        finish_background_save(checkpointer, pending)
    assert checkpointer.committed_steps() == [] and checkpointer.uncommitted_folders() == []


def test_the_files_are_hashed_as_they_are_written_and_never_read_again(tmp_path, monkeypatch):
    """One process: every file of the folder (the data and .metadata) has its sha256 from the write itself;
    the writer reads none of them back (the marker's hashes still match a rehash)."""
    read_back: list[str] = []
    monkeypatch.setattr(background, "sha256_of_file", lambda path: read_back.append(str(path)) or "x")
    checkpointer = DistributedCheckpointer(tmp_path / "run", keep=2)
    state = {"model": {"w": torch.randn(128, 64), "b": torch.randn(64)}, "trainer": {"step": 1}}
    path = finish_background_save(checkpointer, start_background_save(checkpointer, 1, state, {}))
    assert read_back == []
    marker = json.loads((path / MARKER_NAME).read_text())
    assert set(marker["files"]) == {p.name for p in path.iterdir() if p.name != MARKER_NAME}
    assert ".metadata" in marker["files"]
    checkpointer.verify(1)  # the hashes taken while writing match the files on disk


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_the_write_runs_in_threads_that_yield_the_cpu_to_the_loop(tmp_path, monkeypatch):
    writers: list[int] = []
    write = background._HashingStream.write

    def noting(self, data):
        writers.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return write(self, data)

    monkeypatch.setattr(background._HashingStream, "write", noting)
    checkpointer = DistributedCheckpointer(tmp_path / "run", keep=2)
    state = {"model": {"w": torch.randn(64, 64), "v": torch.randn(64, 64)}}
    finish_background_save(checkpointer, start_background_save(checkpointer, 1, state, {}))
    loop = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert writers and all(nice == min(19, loop + BACKGROUND_NICENESS) for nice in writers)


def test_the_prune_runs_beside_the_loop_and_the_next_save_waits_for_it(tmp_path, monkeypatch):
    checkpointer = DistributedCheckpointer(tmp_path / "run", keep=1)
    release, pruning = threading.Event(), threading.Event()
    prune = type(checkpointer)._prune

    def held_prune(self, newest_step):
        pruning.set()
        release.wait(60)
        return prune(self, newest_step)

    monkeypatch.setattr(type(checkpointer), "_prune", held_prune)
    state = {"model": {"w": torch.randn(16, 16)}}
    release.set()
    finish_background_save(checkpointer, start_background_save(checkpointer, 1, state, {}))
    release.clear()
    pruning.clear()
    finish_background_save(checkpointer, start_background_save(checkpointer, 2, state, {}))
    assert pruning.wait(60)
    # Committed, and the loop is back, while the prune of step 1 still waits: step 1 is still there.
    assert (checkpointer.root / "step-00000002" / MARKER_NAME).is_file()
    assert (checkpointer.root / "step-00000001" / MARKER_NAME).is_file()
    release.set()
    checkpointer.wait_for_prune()
    assert checkpointer.committed_steps() == [2]


def test_a_failed_background_prune_is_raised_where_the_loop_next_waits(tmp_path, monkeypatch):
    checkpointer = DistributedCheckpointer(tmp_path / "run", keep=1)

    def failing_prune(self, newest_step):
        raise PermissionError(errno.EACCES, "Permission denied", "step-00000001")

    monkeypatch.setattr(type(checkpointer), "_prune", failing_prune)
    finish_background_save(checkpointer, start_background_save(checkpointer, 1, {"w": torch.ones(2)}, {}))
    with pytest.raises(PermissionError):
        start_background_save(checkpointer, 2, {"w": torch.ones(2)}, {})
    checkpointer.wait_for_prune()  # raised once, then nothing is pending


def test_a_failed_background_write_leaves_no_folder_and_is_told_as_a_full_disk(tmp_path, monkeypatch):
    checkpointer = DistributedCheckpointer(tmp_path / "run", keep=2)

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(background._HashingFileSystemWriter, "write_data", full)
    pending = start_background_save(checkpointer, 1, {"model": {"w": torch.ones(3)}}, {})
    with pytest.raises(CheckpointError) as raised:
        finish_background_save(checkpointer, pending)
    assert out_of_space(raised.value)
    assert list(checkpointer.root.iterdir()) == [] and checkpointer.committed_steps() == []


@pytest.mark.parametrize("failing_write", [1, 3, 8])
def test_a_full_disk_inside_a_files_torch_save_is_told_as_a_full_disk(tmp_path, monkeypatch, failing_write):
    """The disk fills at the n-th write of the writer's streams: one made from Python raises through, one of a
    tensor's bytes made from inside the archive writer it may swallow and replace with a position mismatch of
    its own; either way the save fails as a full disk, and nothing of it is left."""
    create_stream, writes = dcp_filesystem.FileSystem.create_stream, []

    class FillingFile:
        def __init__(self, raw) -> None:
            self.raw = raw

        def write(self, data) -> int:
            writes.append(len(data))
            if len(writes) == failing_write:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.raw.write(data)

        def __getattr__(self, name):
            return getattr(self.raw, name)

    @contextlib.contextmanager
    def filling(self, path, mode):
        with create_stream(self, path, mode) as stream:
            yield FillingFile(stream) if "w" in mode else stream

    monkeypatch.setattr(dcp_filesystem.FileSystem, "create_stream", filling)
    checkpointer = DistributedCheckpointer(tmp_path / "run", keep=2)
    # Tensors of 64 KB: their bytes are written from inside the archive writer (dcp_file_writer.py).
    state = {"model": {f"w{i}": torch.randn(128, 128) for i in range(4)}, "trainer": {"step": 1}}
    with pytest.raises(CheckpointError) as failed:
        finish_background_save(checkpointer, start_background_save(checkpointer, 1, state, {}))
    assert len(writes) >= failing_write and out_of_space(failed.value)
    assert checkpointer.committed_steps() == [] and checkpointer.uncommitted_folders() == []


def test_out_of_space_looks_through_causes_and_per_rank_failures():
    class Wrapped(Exception):
        def __init__(self, failures):
            super().__init__("checkpoint failed")
            self.failures = failures

    assert out_of_space(OSError(errno.ENOSPC, "full"))
    assert out_of_space(Wrapped({1: OSError(errno.EDQUOT, "quota")}))
    try:
        try:
            raise OSError(errno.ENOSPC, "full")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        assert out_of_space(outer)
    assert not out_of_space(OSError(errno.EACCES, "denied")) and not out_of_space(None)


# ---------------------------------------------------------------------------------------------- in a session
@pytest.mark.slow
def test_background_saves_equal_synchronous_ones_bit_for_bit_and_record_what_the_loop_waited(builtin_data_dir,
                                                                                              tmp_path):
    sync_dir, background_dir = tmp_path / "sync", tmp_path / "background"
    assert train(recipe("sync"), builtin_data_dir, sync_dir)[0].reason == "completed"
    result, said = train(recipe("background"), builtin_data_dir, background_dir)
    assert result.reason == "completed"
    assert losses(background_dir) == losses(sync_dir)
    checkpointers = [DistributedCheckpointer(d, keep=5) for d in (sync_dir, background_dir)]
    assert checkpointers[0].committed_steps() == checkpointers[1].committed_steps() == [2, 4, 6]
    for step in (2, 4, 6):  # the two formats key the optimizer differently: the resumes below restore it
        sync_state, _ = checkpointers[0].load(step)
        background_state, _ = checkpointers[1].load(step)
        for part in ("model", "trainer", "rng"):
            assert_exactly_equal(sync_state[part], background_state[part], f"step {step} {part}")
    assert [checkpointers[1].storage_name(s) for s in (2, 4, 6)] == ["torch_dcp", "torch_dcp", "torch_save"]
    saved = [e for e in events(background_dir) if e["event"] == "checkpoint"]
    assert [e["step"] for e in saved] == [2, 4, 6]
    for event in saved[:2]:  # the cadence's: staged, written beside training, committed later
        assert event["background"] is True and event["seconds"] == event["blocking_seconds"]
        assert event["total_seconds"] >= event["blocking_seconds"] >= 0 and event["background_seconds"] >= 0
    assert "background" not in saved[2]  # the last round's save is synchronous
    assert "checkpoints:" in said and "each (measured by this save)" in said
    summary = summarize_run(background_dir, require_step=6)
    assert summary.valid, summary.reasons
    # A resume from a background checkpoint continues bit for bit: step 4 -> 6 again, against the straight
    # run.
    resumed = tmp_path / "resumed"
    train(recipe("background", "train.max_steps=4"), builtin_data_dir, resumed)
    assert train(recipe("background"), builtin_data_dir, resumed, resume=True)[0].reason == "completed"
    final, _ = DistributedCheckpointer(resumed, keep=5).load(6)
    assert_exactly_equal(checkpointers[0].load(6)[0], final, "resumed final")
    assert summarize_run(resumed, require_step=6).valid


def optimizer_by_name(position_keyed: dict, name_keyed: dict) -> dict:
    """torch.save's optimizer state (keyed by position) keyed by parameter name, as DCP's is."""
    names = {}
    for by_position, by_name in zip(position_keyed["param_groups"], name_keyed["param_groups"]):
        names.update(zip(by_position["params"], by_name["params"]))
    return {names[index]: values for index, values in position_keyed["state"].items()}


@pytest.mark.slow
def test_staging_beside_the_next_update_equals_a_synchronous_save_of_the_same_step(builtin_data_dir, tmp_path,
                                                                                   monkeypatch):
    """The staging thread of step 2's save is held until the loop reaches update 3's optimizer step, so the
    copy of the parameters and the optimizer's state runs after that update's forward and backward: the
    checkpoint still equals the synchronous one of step 2 bit for bit."""
    sync_dir, background_dir = tmp_path / "sync", tmp_path / "background"
    assert train(recipe("sync", "train.max_steps=4"), builtin_data_dir, sync_dir)[0].reason == "completed"
    released, copy_later = threading.Event(), host_staging.copy_later
    wait_staged = background.PendingSave.wait_staged
    seen = []

    def held(pairs, staged, future):
        released.wait(timeout=300)
        copy_later(pairs, staged, future)

    def waiting(self):
        seen.append((self.step, self.staging.done()))
        released.set()
        return wait_staged(self)

    monkeypatch.setattr(host_staging, "copy_later", held)
    monkeypatch.setattr(background.PendingSave, "wait_staged", waiting)
    result, _ = train(recipe("background", "train.max_steps=4"), builtin_data_dir, background_dir)
    assert result.reason == "completed"
    assert seen[0] == (2, False)  # the loop reached the next step with the copy still to do
    first = next(e for e in events(background_dir) if e["event"] == "checkpoint")
    assert first["step"] == 2 and first["background"] is True
    sync_state, _ = DistributedCheckpointer(sync_dir, keep=5).load(2)
    background_state, _ = DistributedCheckpointer(background_dir, keep=5).load(2)
    for part in ("model", "trainer", "rng"):
        assert_exactly_equal(sync_state[part], background_state[part], part)
    assert_exactly_equal(optimizer_by_name(sync_state["optimizer"], background_state["optimizer"]),
                         background_state["optimizer"]["state"], "optimizer")
    assert losses(background_dir) == losses(sync_dir)
    assert summarize_run(background_dir, require_step=4).valid


@pytest.mark.slow
def test_a_save_due_while_one_writes_waits_for_it_says_so_and_both_commit_in_order(builtin_data_dir, tmp_path,
                                                                                     monkeypatch):
    gate = threading.Event()
    finish, settle = background._HashingFileSystemWriter.finish, background.finish_background_save

    def held_finish(self, metadata, results):
        gate.wait(timeout=300)  # the write of step 2 goes on until the loop waits for it
        return finish(self, metadata, results)

    def waiting(checkpointer, pending):
        gate.set()
        return settle(checkpointer, pending)

    monkeypatch.setattr(background._HashingFileSystemWriter, "finish", held_finish)
    monkeypatch.setattr("pilotrun.training.callbacks.checkpointing.finish_background_save", waiting)
    run_dir = tmp_path / "run"
    result, said = train(recipe("background"), builtin_data_dir, run_dir)
    assert result.reason == "completed"
    saved = [e for e in events(run_dir) if e["event"] == "checkpoint"]
    assert [e["step"] for e in saved] == [2, 4, 6]
    assert saved[0].get("waited_for_step") is None and saved[1]["waited_for_step"] == 2
    assert saved[1]["waited_seconds"] >= 0
    assert "checkpoint step 4: waited" in said and "for the background save of step 2" in said
    markers = [
        json.loads((run_dir / "checkpoints" / f"step-0000000{s}" / MARKER_NAME).read_text()) for s in (2, 4)
    ]
    assert markers[0]["committed_at"] <= markers[1]["committed_at"]
    assert summarize_run(run_dir, require_step=6).valid


@pytest.mark.slow
def test_a_full_disk_during_a_background_write_ends_the_session_cleanly(
    builtin_data_dir, tmp_path, monkeypatch
):
    """The disk fills inside the write of step 4 (simulated in-process: the writer raises ENOSPC)."""
    write_data = background._HashingFileSystemWriter.write_data

    def filling(self, plan, planner):
        if "step-00000004" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_data(self, plan, planner)

    monkeypatch.setattr(background._HashingFileSystemWriter, "write_data", filling)
    _assert_ended_cleanly_at_full_disk(builtin_data_dir, tmp_path / "run")


def _assert_ended_cleanly_at_full_disk(data_dir: Path, run_dir: Path, *overrides: str) -> None:
    result, said = train(recipe("background", *overrides), data_dir, run_dir)
    assert (result.reason, result.exit_code) == ("stopped", 1)
    assert "the disk is" in result.message and "step 2 is still the newest" in result.message
    checkpointer = DistributedCheckpointer(run_dir, keep=5)
    assert checkpointer.committed_steps() == [2] and checkpointer.uncommitted_folders() == []
    checkpointer.verify(2)
    end = [e for e in events(run_dir) if e["event"] == "session_end"][-1]
    assert end["reason"] == "stopped" and end["message"] == result.message
    summary = summarize_run(run_dir)
    assert summary.valid, summary.reasons


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    path.mkdir(parents=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                 capture_output=True).returncode == 0
    except OSError:
        mounted = False
    if not mounted:
        pytest.skip(
            "mounting a tmpfs needs privileges this machine does not give (the in-process ENOSPC test "
            "covers the same path)"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.slow
def test_a_real_small_tmpfs_ends_the_session_cleanly_before_the_disk_fills(builtin_data_dir, tmp_path):
    """The run folder on a 12 MiB tmpfs: step 2's checkpoint (about 7.5 MiB) fits, step 4's beside it does
    not. The save of step 4 is refused by the room check before it writes (a real ENOSPC under a background
    write would race the record's own appends, which is what the check prevents); the in-process test above
    has the write itself fail."""
    with small_tmpfs(tmp_path / "small", "12m") as small:
        _assert_ended_cleanly_at_full_disk(builtin_data_dir, small / "run", "train.keep_checkpoints=1")


@contextlib.contextmanager
def _killed_where_held(fault: str, hold_at: str, data_dir: Path, run_dir: Path):
    """A background run (smoke, 6 updates, a save every 2) started under checkpoint_faults' `fault`, which
    holds where `hold_at` says; yields the marker the fault writes on reaching the hold, then SIGKILLs it."""
    hold = run_dir.parent / "hold"
    hold.write_text(hold_at)
    command = checkpoint_faults.command(fault, str(hold)) + [
        "train", "--config", str(ROOT / "configs" / "smoke.yaml"), "--data", str(data_dir),
        "--run-dir", str(run_dir)]
    for item in ("train.num_threads=1", "train.max_steps=6", "train.log_every=2", "train.checkpoint_every=2",
                 "train.eval_every=0", "train.keep_checkpoints=5", "optim.schedule.horizon=10",
                 "optim.qk_clip.tau=0.005", "train.checkpoint_mode=background"):
        command += ["--set", item]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    reached = Path(f"{hold}.reached")
    try:
        while not reached.exists() and process.poll() is None:
            threading.Event().wait(0.05)
        assert reached.exists(), process.communicate()[1][-3000:]
        yield reached
        process.send_signal(signal.SIGKILL)
        process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_sigkill_inside_a_background_write_leaves_no_marker_and_the_resume_is_bit_exact(
    builtin_data_dir, tmp_path
):
    straight = tmp_path / "straight"
    train(recipe("sync"), builtin_data_dir, straight)
    run_dir = tmp_path / "run"
    # step 2's write goes through; step 4's holds inside DCP
    with _killed_where_held("--hold-background", "step-00000004", builtin_data_dir, run_dir) as reached:
        temp = Path(reached.read_text())
        # Step 4's data files are written; its .metadata, hashes and marker are not.
        assert temp.name.startswith(".tmp-step-00000004") and any(temp.glob("*.distcp"))
        assert not (temp / ".metadata").exists()
    checkpointer = DistributedCheckpointer(run_dir, keep=5)
    assert checkpointer.committed_steps() == [2]
    assert not (temp / MARKER_NAME).exists() and not (run_dir / "checkpoints" / "step-00000004").exists()
    result, _ = train(recipe("background"), builtin_data_dir, run_dir, resume=True)
    assert result.reason == "completed"
    straight_losses = {step: values[0] for step, values in losses(straight).items()}
    for step, values in losses(run_dir).items():  # the killed session's and the resumed one's
        assert all(value == straight_losses[step] for value in values), step
    final, _ = DistributedCheckpointer(run_dir, keep=5).load(6)
    assert_exactly_equal(DistributedCheckpointer(straight, keep=5).load(6)[0], final, "final")
    assert summarize_run(run_dir, require_step=6).valid


@pytest.mark.slow
def test_sigkill_during_staging_leaves_no_marker_and_the_resume_is_bit_exact(builtin_data_dir, tmp_path):
    """The second background save's (step 4's) staging thread holds before copying; the process is killed
    there: step 4 has a temp folder and no marker, and the resume from step 2 ends as a straight run."""
    straight = tmp_path / "straight"
    train(recipe("sync"), builtin_data_dir, straight)
    run_dir = tmp_path / "run"
    with _killed_where_held("--hold-staging", "2", builtin_data_dir, run_dir):
        pass
    checkpointer = DistributedCheckpointer(run_dir, keep=5)
    assert checkpointer.committed_steps() == [2]
    left = checkpointer.uncommitted_folders()
    assert [folder.name.startswith(".tmp-step-00000004") for folder in left] == [True]
    assert not (left[0] / MARKER_NAME).exists() and not (run_dir / "checkpoints" / "step-00000004").exists()
    result, _ = train(recipe("background"), builtin_data_dir, run_dir, resume=True)
    assert result.reason == "completed"
    final, _ = DistributedCheckpointer(run_dir, keep=5).load(6)
    assert_exactly_equal(DistributedCheckpointer(straight, keep=5).load(6)[0], final, "final")
    assert summarize_run(run_dir, require_step=6).valid


@pytest.mark.slow
def test_two_gloo_ranks_with_background_saves_equal_synchronous_ones_bit_for_bit(builtin_data_dir, tmp_path):
    from tests.training.test_distributed_trainer import _final_weights, _losses_by_step, _run, _train_command

    runs = {}
    for mode in ("sync", "background"):
        runs[mode] = tmp_path / mode
        done = _run(
            _train_command(builtin_data_dir, runs[mode], 2, 2, "--set", f"train.checkpoint_mode={mode}")
        )
        assert done.returncode == 0, done.stderr[-3000:]
    assert _losses_by_step(runs["background"]) == _losses_by_step(runs["sync"])
    for name, value in _final_weights(runs["sync"]).items():
        assert torch.equal(_final_weights(runs["background"])[name], value), name
    sync, back = (DistributedCheckpointer(runs[m], keep=5) for m in ("sync", "background"))
    assert sync.committed_steps() == back.committed_steps() == [3, 6, 9]
    for step in (3, 6):
        for part in ("model", "optimizer", "trainer", "rng"):
            assert_exactly_equal(sync.load(step)[0][part], back.load(step)[0][part], f"step {step} {part}")
    saved = [e for e in events(runs["background"]) if e["event"] == "checkpoint"]
    assert [e.get("background") for e in saved] == [True, True, None]
    assert summarize_run(runs["background"], require_step=9).valid
