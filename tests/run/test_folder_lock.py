"""pilotrun/run/folder_lock.py: one writer per run folder, through real `pilotrun train` processes.

- a second `pilotrun train` (fresh, or --resume) on a folder whose session is running exits 2 with one line
  naming the holder's pid and host, and the running session's record stays valid;
- a SIGKILLed session leaves no stale lock: --resume starts at once;
- under torchrun rank 0 takes the lock and every rank refuses together;
- a fresh session refused for bad input after taking the lock leaves no folder behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.run import folder_lock as run_lock
from pilotrun.run.folder_lock import LOCK_NAME, RunFolderBusy, RunFolderLock
from tests.training.checkpoint import checkpoint_faults

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ["--set", "train.num_threads=1", "--set", "train.max_steps=4", "--set", "train.checkpoint_every=2",
          "--set", "train.eval_every=0", "--set", "optim.schedule.horizon=4"]


def _command(data: Path, run_dir: Path, *extra: str, launcher: list[str] | None = None) -> list[str]:
    return (launcher or [sys.executable, "-m", "pilotrun"]) + [
        "train",
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--data",
        str(data),
        "--run-dir",
        str(run_dir),
        *RECIPE,
        *extra,
    ]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _start_held_session(data: Path, run_dir: Path, hold: Path, step: int) -> subprocess.Popen:
    """A session kept inside its checkpoint write of `step` (after the rename, before the marker) for as long
    as `hold` exists (a fault the test injects into the child,
    tests/training/checkpoint/checkpoint_faults.py), so the session holds its lock however slow or fast the
    machine is. Deleting `hold` lets it finish."""
    hold.write_text(str(step))
    launcher = checkpoint_faults.command("--hold-file", str(hold))
    process = subprocess.Popen(_command(data, run_dir, launcher=launcher), cwd=ROOT, env=_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    folder = run_dir / "checkpoints" / f"step-{step:08d}"
    deadline = time.monotonic() + 300  # a hang guard only: the wait ends when the session reaches the hold
    while time.monotonic() < deadline and process.poll() is None:
        if folder.is_dir() and not (folder / "COMMITTED.json").exists():
            return process
        time.sleep(0.05)
    process.kill()
    raise AssertionError(
        f"the session never reached its checkpoint write of step {step}: {process.communicate()[1]}"
    )


@pytest.mark.slow
def test_a_second_writer_is_refused_naming_the_holder_and_the_first_record_stays_valid(
    builtin_data_dir, tmp_path
):
    run_dir, hold = tmp_path / "run", tmp_path / "hold"
    first = _start_held_session(builtin_data_dir, run_dir, hold, step=2)
    try:
        for extra in ((), ("--resume",)):
            second = subprocess.run(_command(builtin_data_dir, run_dir, *extra), cwd=ROOT, env=_env(),
                                    capture_output=True, text=True, timeout=300)
            lines = second.stderr.strip().splitlines()
            assert second.returncode == 2, second.stderr
            assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
            assert f"in use by pid {first.pid} on host {socket.gethostname()} since " in lines[0]
        hold.unlink()
        _, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr
    summary = summarize_run(run_dir, require_step=4)
    assert summary.valid, summary.reasons
    assert len(summary.sessions) == 1


@pytest.mark.slow
def test_two_fresh_sessions_started_together_one_trains_the_other_is_refused(builtin_data_dir, tmp_path):
    run_dir = tmp_path / "run"
    processes = [
        subprocess.Popen(
            _command(builtin_data_dir, run_dir),
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in processes]
    assert sorted(code for code, _ in results) == [0, 2], results
    refusal = next(err for code, err in results if code == 2).strip().splitlines()
    assert len(refusal) == 1 and ("in use by pid" in refusal[0] or "already exists" in refusal[0]), refusal
    summary = summarize_run(run_dir, require_step=4)
    assert summary.valid and len(summary.sessions) == 1, summary.reasons


@pytest.mark.slow
def test_a_sigkilled_session_leaves_no_stale_lock(builtin_data_dir, tmp_path):
    run_dir, hold = tmp_path / "run", tmp_path / "hold"
    first = _start_held_session(builtin_data_dir, run_dir, hold, step=4)  # step 2 is committed by then
    with pytest.raises(RunFolderBusy):
        RunFolderLock.acquire(run_dir)  # the session holds it
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    assert first.returncode == -signal.SIGKILL
    assert (run_dir / LOCK_NAME).is_file()  # the file stays; the kernel released the lock with the process
    resumed = subprocess.run(_command(builtin_data_dir, run_dir, "--resume"), cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    summary = summarize_run(run_dir, require_step=4)
    assert summary.valid and summary.sessions[1].resumed_from == 2, summary.reasons


@pytest.mark.slow
def test_under_torchrun_rank0_holds_the_lock_and_every_rank_refuses(builtin_data_dir, tmp_path):
    run_dir = tmp_path / "run"
    holder = RunFolderLock.acquire(run_dir)  # this test process plays the running session
    try:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    "-m", "pilotrun"]
        refused = subprocess.run(_command(builtin_data_dir, run_dir, launcher=launcher), cwd=ROOT, env=_env(),
                                 capture_output=True, text=True, timeout=300)
    finally:
        holder.release()
    assert refused.returncode != 0
    # Rank 0 tells every rank, so none waits in a collective: each exits 2 with the line, unless torchrun has
    # already stopped it after the first rank's exit (it sends the others SIGTERM), so one or two lines.
    busy = [line for line in refused.stderr.splitlines() if f"in use by pid {os.getpid()}" in line]
    assert 1 <= len(busy) <= 2, refused.stderr
    # torchrun reports a failed child with its own ChildFailedError traceback; no pilotrun frame is in it.
    assert f'File "{ROOT / "pilotrun"}' not in refused.stderr, refused.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]  # nothing written by the refused run


def test_a_refused_fresh_session_leaves_no_folder(builtin_data_dir, tmp_path):
    from pilotrun.commands.cli import main

    run_dir = tmp_path / "new-run"
    code = main(["train", "--config", str(ROOT / "configs" / "smoke.yaml"), "--data", str(builtin_data_dir),
                 "--run-dir", str(run_dir), "--set", "train.batch_size=100000"])  # the data cannot fit it
    assert code == 2
    assert not run_dir.exists()


def test_lock_in_process_refuses_a_second_holder_and_is_free_after_release(tmp_path):
    first = RunFolderLock.acquire(tmp_path / "run")
    with pytest.raises(RunFolderBusy, match=f"in use by pid {os.getpid()} on host "):
        RunFolderLock.acquire(tmp_path / "run")
    first.release()
    second = RunFolderLock.acquire(tmp_path / "run")
    second.release()


@contextlib.contextmanager
def _lock_held_without_a_holder_line(run_dir: Path):
    """What a second process sees in the moment between a holder's flock and its holder line: a locked, empty
    file (flock locks of two open files conflict within one process too)."""
    run_dir.mkdir(parents=True)
    with open(run_dir / LOCK_NAME, "a+", encoding="utf-8") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield handle


def test_a_holder_line_written_just_after_the_lock_is_still_named(tmp_path):
    run_dir = tmp_path / "run"
    with _lock_held_without_a_holder_line(run_dir) as handle:
        late_line = threading.Timer(
            0.3,
            lambda: (
                handle.write(
                    json.dumps({"pid": 424242, "host": "late-host", "since": "2026-12-01T00:00:00+00:00"})
                    + "\n"
                ),
                handle.flush(),
            ),
        )
        late_line.start()
        try:
            with pytest.raises(
                RunFolderBusy, match="in use by pid 424242 on host late-host since 2026-12-01"
            ):
                RunFolderLock.acquire(run_dir)
        finally:
            late_line.join()


def test_a_holder_that_never_writes_its_line_is_reported_as_unreadable(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HOLDER_LINE_WAIT_SECONDS", 0.1)
    run_dir = tmp_path / "run"
    with _lock_held_without_a_holder_line(run_dir) as handle:
        handle.write('{"pid": 1, "host": "half-writ')  # a line cut short: no newline, not JSON
        handle.flush()
        with pytest.raises(RunFolderBusy, match="in use by a process whose details could not be read"):
            RunFolderLock.acquire(run_dir)


def test_a_lock_file_that_is_a_link_is_refused_and_the_linked_file_is_untouched(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    users_file = tmp_path / "notes.txt"
    users_file.write_text("a user's file\n" * 1000)
    (run_dir / LOCK_NAME).symlink_to(users_file)
    with pytest.raises(run_lock.PilotrunError, match="a symbolic link; refused"):
        RunFolderLock.acquire(run_dir)
    assert users_file.read_text() == "a user's file\n" * 1000
    dangling = tmp_path / "run2"
    dangling.mkdir()
    (dangling / LOCK_NAME).symlink_to(tmp_path / "nowhere.txt")
    with pytest.raises(run_lock.PilotrunError, match="a symbolic link"):
        RunFolderLock.acquire(dangling)
    assert not (tmp_path / "nowhere.txt").exists()  # nothing created through the dangling link


def test_a_lock_file_of_binary_or_deeply_nested_content_is_taken_without_a_traceback(tmp_path):
    for content in (bytes(range(256)) * 20, b"[" * 200_000 + b"\n"):
        run_dir = tmp_path / f"run-{len(content)}"
        run_dir.mkdir()
        (run_dir / LOCK_NAME).write_bytes(content)
        lock = RunFolderLock.acquire(run_dir)
        assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == os.getpid()
        lock.release(refused=True)
        assert (run_dir / LOCK_NAME).read_bytes() == content[:4096]  # the previous bytes put back as read


def test_live_holder_sees_the_holder_without_taking_the_lock(tmp_path):
    run_dir = tmp_path / "run"
    assert run_lock.live_holder(run_dir) is None
    lock = RunFolderLock.acquire(run_dir)
    try:
        holder = run_lock.live_holder(run_dir)
        assert holder is not None and holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        # Reading it took nothing: a second writer is still refused, and the holder is still named.
        with pytest.raises(RunFolderBusy):
            RunFolderLock.acquire(run_dir)
    finally:
        lock.release()
    assert run_lock.live_holder(run_dir) is None  # the file stays, the lock is gone
    assert (run_dir / LOCK_NAME).is_file()
