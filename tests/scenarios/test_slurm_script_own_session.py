"""scripts/slurm/train.sbatch judges this job's own session, not the last ending on the record: a start that
fails before training (here a data folder that is gone) after another job's interrupted session asks a person
(exit 1, no requeue); a rank's stack file written in this job, with no ending on the record (rank 0 was the
stuck one), is a hung session and requeued. SLURM faked as in test_slurm_script.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.scenarios.test_slurm_script import SCRIPT, fake_slurm

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def script_env(tmp_path: Path, data: Path, run_dir: Path) -> dict[str, str]:
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", SLURM_JOB_ID="4343",
               SLURM_JOB_NODELIST="node[1]", SLURM_NNODES="1", NPROC_PER_NODE="1", MAX_RESTARTS="0",
               PYTHON=sys.executable, CONFIG=str(ROOT / "configs" / "smoke.yaml"), DATA=str(data),
               RUN_DIR=str(run_dir), PYTHONPATH=str(ROOT), EXTRA="--set train.num_threads=1")
    env.pop("SLURM_JOB_END_TIME", None)
    with socket.socket() as probe:  # other tests may hold torchrun's default port
        probe.bind(("127.0.0.1", 0))
        env["RDZV_PORT"] = str(probe.getsockname()[1])
    return env


def earlier_job_interrupted(run_dir: Path) -> None:
    """The record an earlier job left: its session ended interrupted (a requeue's reason)."""
    run_dir.mkdir()
    then = time.time() - 3600
    lines = [{"event": "session_start", "time": then, "session_id": "earlier", "step": 0},
             {"event": "session_end", "time": then + 60, "session_id": "earlier", "step": 30,
              "reason": "interrupted"}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_failed_start_after_another_jobs_interrupted_session_asks_a_person(tmp_path):
    log, run_dir = tmp_path / "requeued.log", tmp_path / "run"
    fake_slurm(tmp_path / "bin", log)
    earlier_job_interrupted(run_dir)
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=tmp_path,
        env=script_env(tmp_path, tmp_path / "moved", run_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "this job's session ended: none" in out and not log.exists(), out[-3000:]


def test_a_stack_file_of_this_job_without_an_ending_is_requeued_as_hung(tmp_path):
    """The step fails (the data folder is gone) but a rank left its stacks in this job: hung, requeued."""
    log, run_dir = tmp_path / "requeued.log", tmp_path / "run"
    fake_slurm(tmp_path / "bin", log)
    earlier_job_interrupted(run_dir)
    bin_dir, real = tmp_path / "bin", tmp_path / "bin" / "srun"
    (bin_dir / "srun").write_text(f'#!/bin/bash\nmkdir -p {run_dir}/hangs && echo stacks > '
                                  f'{run_dir}/hangs/20990101T000000Z-rank1.txt\nexit 1\n')
    real.chmod(0o755)
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=tmp_path,
        env=script_env(tmp_path, tmp_path / "moved", run_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "this job's session ended: hung" in out, out[-3000:]
    assert log.read_text() == "requeue 4343\n"


def run_script(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def needed_seconds(run_dir: Path) -> float:
    """What the start check counts from the record: the fastest set-up and update, and the last save."""
    from pilotrun.run.start_costs import read_start_costs

    recorded = read_start_costs(run_dir)
    return min(recorded.setup_seconds) + min(recorded.seconds_per_update) + (recorded.last_save or 0.0)


def test_a_planned_stop_is_said_so_after_torchrun_s_report_and_a_start_too_late_asks_a_person(
    builtin_data_dir, tmp_path
):
    """A job whose session meets its deadline: torchrun reports the worker's 75 as a failure
    (ChildFailedError, FAILED), then the script's one line names the recorded ending and its code, a planned
    stop, and requeues. The next job's start cannot keep its deadline (fewer seconds than the record's set-up,
    update and save): refused with 79 through torchrun, and the script asks a person (a requeue would be
    refused the same way)."""
    log, run_dir = tmp_path / "requeued.log", tmp_path / "run"
    fake_slurm(tmp_path / "bin", log)
    env = script_env(tmp_path, builtin_data_dir, run_dir)
    env["EXTRA"] += " --set train.max_steps=100000 --set optim.schedule.horizon=100000 --stop-by 40s"
    done = run_script(tmp_path, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "exitcode: 75" in done.stderr and "FAILED" in done.stderr  # torchrun's report of a planned stop
    said = done.stdout.rstrip().splitlines()[-1]
    assert said == (
        "pilotrun: this job's session ended: deadline (exit 75), a planned stop, resumable (torchrun's "
        "FAILED report above is how it passes on a worker's code other than 0): requeued"
    ), done.stdout[-3000:]
    assert log.read_text() == "requeue 4343\n"

    before = (run_dir / "metrics.jsonl").read_bytes()
    seconds = int(needed_seconds(run_dir))  # the deadline's budget counts from the command's start
    assert seconds >= 1, "a set-up in a child process takes more than a second (torch's import alone)"
    env["EXTRA"] = env["EXTRA"].replace("--stop-by 40s", f"--stop-by {seconds}s")
    done = run_script(tmp_path, env)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    refusals = [line for line in done.stderr.splitlines()
                if "not started in this allocation (exit 79)" in line]
    assert len(refusals) == 1
    assert refusals[0].startswith(f"pilotrun: error: --stop-by: {seconds:.1f} s remain")
    assert done.stdout.rstrip().splitlines()[-1].startswith(
        "pilotrun: this job's session ended: none: its start was refused, too late to keep the deadline "
        "(exit 79)"), done.stdout[-3000:]
    assert log.read_text() == "requeue 4343\n"  # not requeued
    assert (run_dir / "metrics.jsonl").read_bytes() == before  # the refused start wrote nothing


def test_a_start_too_late_is_exit_79_in_one_line_writing_nothing(builtin_data_dir, tmp_path):
    """One process, no launcher: the code itself, from a record of real sessions."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "pilotrun", "train", "--config", str(ROOT / "configs" / "smoke.yaml"),
            "--data", str(builtin_data_dir), "--run-dir", str(run_dir), "--resume", "auto",
            "--progress", "none", "--set", "train.num_threads=1", "--set", "train.max_steps=20"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    first = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    seconds = int(needed_seconds(run_dir))
    assert seconds >= 1
    late = subprocess.run([*args[:-1], "train.max_steps=40", "--stop-by", f"{seconds}s"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert late.returncode == 79, late.stderr[-3000:]
    assert late.stderr.strip().splitlines() == [late.stderr.strip()] and "Traceback" not in late.stderr
    assert "not started in this allocation (exit 79)" in late.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
