"""How a scheduler ends a job, with real processes: SLURM's SIGTERM to every process of a two-rank torchrun
step (torchrun's forwarded copy landing during the save), and a stop signal moments after launch, during the
set-up. Each ends with the stop's exit code, a committed checkpoint at the stop step and one session_end on
the record; every process is gone well within SLURM's KillWait (30 s by default)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SEAMS = Path(__file__).resolve().parent / "stop_seams.py"
KILL_WAIT = 30.0  # SLURM's default KillWait: SIGKILL follows SIGTERM after this many seconds
SLOW_SAVE = 3.0  # the seam's wait inside the stop's save, for torchrun's late copy to land in


def train_args(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--data",
        str(data),
        "--run-dir",
        str(run_dir),
        "--resume",
        "auto",
        "--progress",
        "none",
        "--set",
        "train.max_steps=5000",
        "--set",
        "optim.schedule.horizon=5000",
        "--set",
        "train.batch_size=2",
        "--set",
        "train.eval.every=0",
        "--set",
        "train.checkpoint.every=10",
        "--set",
        "train.num_threads=1",
        *extra,
    ]


def environment() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines[:-1]]  # the last may be half-written yet


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, seconds: float, what: str, process: subprocess.Popen) -> None:
    until = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, f"ended before {what}: " + process.stdout.read()[-3000:]
        assert time.monotonic() < until, f"no {what} within {seconds} s"
        time.sleep(0.05)


def test_slurm_sigterm_to_every_process_and_torchrun_forward_during_the_save_is_one_stop(builtin_data_dir,
                                                                                         tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "saving"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SEAMS),
         "slow-save", str(SLOW_SAVE), str(marker), "--", *train_args(builtin_data_dir, run_dir)],
        cwd=ROOT, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    wait_for(lambda: sum(e["event"] == "train" for e in events(run_dir)) >= 12, 300, "12 updates", launcher)
    workers = children(launcher.pid)
    assert len(workers) == 2
    started = time.monotonic()
    for pid in workers:  # SLURM's SIGTERM reaches every process of the step; torchrun's is held back ...
        os.kill(pid, signal.SIGTERM)
    wait_for(marker.exists, 60, "the stop's save", launcher)
    launcher.send_signal(signal.SIGTERM)  # ... so that its forwarded copy reaches the ranks during the save
    wait_for(lambda: not any(map(alive, [launcher.pid, *workers])), KILL_WAIT, "end", launcher)
    gone = time.monotonic() - started
    out = launcher.communicate(timeout=60)[0]
    ends = [
        e
        for e in events(run_dir) + [json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])]
        if e["event"] == "session_end"
    ]
    assert len(ends) == 1 and ends[0]["reason"] == "interrupted", out[-3000:]
    assert ends[0]["message"].startswith("SIGTERM received: finished the update, saved checkpoint step")
    stop_step = ends[0]["step"]
    assert stop_step == int(marker.read_text()) and stop_step % 10 != 0  # past the last cadence save
    assert Checkpointer(run_dir, keep=100).committed_steps()[-1] == stop_step
    assert "second SIGTERM" not in out and "stopped with a committed checkpoint" in out
    # The bound (README, next to the sbatch script's --signal advice): the update in flight, the save, and the
    # teardown; here the save is held SLOW_SAVE seconds on purpose.
    print(f"every process gone {gone:.1f} s after SIGTERM (save held {SLOW_SAVE} s)")
    assert gone < KILL_WAIT


def test_a_stop_signal_moments_after_launch_ends_with_its_code_and_one_line(builtin_data_dir, tmp_path):
    """SIGUSR1 0.5, 1.5 and 3 s after launch (three commands at once: during the interpreter's start, torch's
    import, the set-up): each stops with a committed checkpoint, exit 138, one line, no traceback."""
    delays = (0.5, 1.5, 3.0)
    launched = time.monotonic()
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "pilotrun", *train_args(builtin_data_dir, tmp_path / f"{d}")],
            cwd=ROOT,
            env=environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for d in delays
    ]
    for delay, process in zip(delays, processes, strict=True):
        time.sleep(max(0.0, launched + delay - time.monotonic()))
        process.send_signal(signal.SIGUSR1)
    for delay, process in zip(delays, processes, strict=True):
        out, err = process.communicate(timeout=300)
        assert process.returncode == 128 + signal.SIGUSR1, (delay, err[-3000:])
        assert "Traceback" not in err and err.count("pilotrun train: stopped") == 1, err[-3000:]
        run_dir = tmp_path / f"{delay}"
        end = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        assert (
            end["event"] == "session_end" and end["reason"] == "interrupted" and "SIGUSR1" in end["message"]
        )
        assert Checkpointer(run_dir, keep=100).committed_steps()[-1] == end["step"]


def tmpfs_allowed() -> bool:
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m none /mnt"],
                           capture_output=True)
    return probe.returncode == 0


def test_a_disk_filled_during_a_background_save_stops_the_session_in_one_line(builtin_data_dir, tmp_path):
    """Another writer fills the run folder's file system (a 48 MiB tmpfs in a user namespace where one may be
    mounted, else the save's writes fail with ENOSPC at the storage) right after a background save began:
    `stopped`, exit 1, no traceback, nothing of that save committed, the previous checkpoint intact."""
    mount, kept = tmp_path / "fs", tmp_path / "kept"
    mount.mkdir()
    train = [sys.executable, str(SEAMS), "fill-disk", "20", "--",
             *train_args(builtin_data_dir, mount / "run", "--set", "train.max_steps=40",
                         "--set", "train.checkpoint.mode=background")]
    script = f'"$@"; code=$?; cp -a {mount / "run"} {kept}; exit $code'
    if tmpfs_allowed():
        argv = [
            "unshare",
            "-rm",
            "sh",
            "-c",
            f"mount -t tmpfs -o size=48m none {mount} && {script}",
            "sh",
            *train,
        ]
    else:
        argv = ["sh", "-c", script, "sh", *train]
    done = subprocess.run(argv, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "Exception in thread" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(
        "error: checkpoint step 20 could not be written, the disk is full (No space left on device"
    ), out[-3000:]
    end = json.loads((kept / "metrics.jsonl").read_text().splitlines()[-1])
    assert (
        end["event"] == "session_end" and end["reason"] == "stopped" and "the disk is full" in end["message"]
    )
    checkpoints = DistributedCheckpointer(kept, keep=100)
    assert checkpoints.committed_steps() == [10]
    checkpoints.verify(10)
    assert not any("00000020" in p.name for p in (kept / "checkpoints").iterdir())  # nor a temp folder left


def test_a_kill_between_a_commit_and_its_record_is_reconciled_from_the_marker(builtin_data_dir, tmp_path):
    """SIGKILL right after a background save's commit, before its `checkpoint` event: the next session resumes
    from it and records what its marker says; summarize names the gap and the run is valid."""
    run_dir = tmp_path / "run"
    args = train_args(builtin_data_dir, run_dir, "--set", "train.max_steps=30", "--set",
                      "train.checkpoint.mode=background")
    killed = subprocess.run([sys.executable, str(SEAMS), "kill-after-commit", "20", "--", *args], cwd=ROOT,
                            env=environment(), capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not any(e["event"] == "checkpoint" and e["step"] == 20 for e in events(run_dir))
    assert Checkpointer(run_dir, keep=100).committed_steps()[-1] == 20
    done = subprocess.run([sys.executable, "-m", "pilotrun", *args], cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = subprocess.run([sys.executable, "-m", "pilotrun", "summarize", str(run_dir)], cwd=ROOT,
                             env=environment(), capture_output=True, text=True, timeout=300)
    assert summary.returncode == 0, summary.stdout[-3000:]
    assert "committed (its marker says so" in summary.stdout and "killed between the commit and its record" \
        in summary.stdout


def rank_of(pid: int) -> int:
    variables = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return int(next(v for v in variables if v.startswith(b"RANK="))[5:])


def test_rank_0_stuck_leaves_rank_1_s_stacks_and_summarize_counts_the_session_hung(
    builtin_data_dir, tmp_path
):
    """Rank 0 stopped (SIGSTOP) and left: rank 1's watchdog writes its stacks and exits 124; rank 0 records
    nothing (it is killed, as SLURM's KillWait would). The stack file is the session's ending: summarize
    counts it hung, not killed."""
    from pilotrun.report.record_check.summarize import summarize_run

    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "pilotrun",
            *train_args(builtin_data_dir, run_dir, "--hang-timeout", "5,600"),
        ],
        cwd=ROOT,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    wait_for(lambda: sum(e["event"] == "train" for e in events(run_dir)) >= 12, 300, "12 updates", launcher)
    ranks = {rank_of(pid): pid for pid in children(launcher.pid)}
    os.kill(ranks[0], signal.SIGSTOP)
    wait_for(lambda: not alive(ranks[1]), 120, "rank 1's exit", launcher)
    stacks = sorted((run_dir / "hangs").iterdir())
    assert [p.name.rsplit("-", 1)[1] for p in stacks] == ["rank1.txt"]
    os.kill(ranks[0], signal.SIGKILL)
    out = launcher.communicate(timeout=120)[0]
    # Rank 1 ends itself 124; which failure torchrun reports first (rank 1's 124 or rank 0 killed by torchrun)
    # depends on the machine's load, so rank 1's exit is read from its own last line.
    assert launcher.returncode != 0 and "pilotrun: hung: rank 1" in out and "exiting with 124" in out, out[
        -3000:
    ]
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["event"] != "session_end"
    summary = summarize_run(run_dir)
    assert [s.end_reason for s in summary.sessions] == ["hung"]
    assert any(
        "a rank wrote its stacks during it" in note and stacks[0].name in note for note in summary.notes
    )


def test_a_stall_that_ends_after_the_watchdog_fired_writes_nothing_after_the_hung_end(
    builtin_data_dir, tmp_path
):
    """The stall ends the moment the stacks are written: the session is already ended `hung` on the record,
    and nothing of it follows (no update, event or save) before the exit, 124."""
    from pilotrun.report.record_check.summarize import summarize_run

    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, str(SEAMS), "stall", "12", str(run_dir), "--",
                           *train_args(builtin_data_dir, run_dir, "--hang-timeout", "4,600")],
                          cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 124, done.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ends = [i for i, e in enumerate(lines) if e["event"] == "session_end"]
    assert len(ends) == 1 and ends[0] == len(lines) - 1 and lines[-1]["reason"] == "hung", lines[-3:]
    assert lines[-1]["step"] == 12
    assert summarize_run(run_dir).valid
