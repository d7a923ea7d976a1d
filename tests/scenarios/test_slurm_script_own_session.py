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
