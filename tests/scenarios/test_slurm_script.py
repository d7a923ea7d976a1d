"""scripts/slurm/train.sbatch run locally: sbatch is not here, so `srun` runs its command in place, `scontrol`
names this host and writes down a requeue, and SLURM's variables are faked. A SIGUSR1 to the batch shell (what
`--signal=B:USR1@300` sends) reaches the training worker through srun and torchrun, the session saves and ends
`interrupted`, and the script requeues the job; the requeued run completes and the script exits 0; once more,
nothing to do, exit 0, no requeue."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "slurm" / "train.sbatch"

pytestmark = pytest.mark.slow


def fake_slurm(bin_dir: Path, log: Path) -> None:
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\ncase "$1" in\n  show) echo localhost ;;\n'
                                      f'  requeue) echo "requeue $2" >> {log} ;;\nesac\n')
    for name in ("srun", "scontrol"):
        (bin_dir / name).chmod(0o755)


def events(metrics: Path) -> list[str]:
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return [json.loads(line)["event"] for line in lines[:-1]]  # the last may be half-written yet


def session_ends(run_dir: Path) -> list[str]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line)["reason"] for line in lines if '"session_end"' in line]


def test_the_script_requeues_a_pre_empted_run_and_stops_when_it_is_complete(builtin_data_dir, tmp_path):
    log, run_dir = tmp_path / "requeued.log", tmp_path / "run"
    fake_slurm(tmp_path / "bin", log)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", SLURM_JOB_ID="4242",
               SLURM_JOB_NODELIST="node[1]", SLURM_NNODES="1", NPROC_PER_NODE="1", MAX_RESTARTS="0",
               PYTHON=sys.executable, CONFIG=str(ROOT / "configs" / "smoke.yaml"), DATA=str(builtin_data_dir),
               RUN_DIR=str(run_dir), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
               EXTRA="--set train.max_steps=400 --set train.checkpoint_every=0 --set train.eval_every=0 "
                     "--set train.num_threads=1 --set train.device=cpu")
    env.pop("SLURM_JOB_END_TIME", None)
    with socket.socket() as probe:  # other tests may hold torchrun's default port
        probe.bind(("127.0.0.1", 0))
        env["RDZV_PORT"] = str(probe.getsockname()[1])
    first = subprocess.Popen(["bash", str(SCRIPT)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    until = time.monotonic() + 300
    while sum(event == "train" for event in events(metrics)) < 2:
        assert first.poll() is None, first.stdout.read()[-3000:]
        assert time.monotonic() < until, "no train events"
        time.sleep(0.2)
    first.send_signal(signal.SIGUSR1)  # SLURM's warning to the batch shell
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out[-3000:]
    assert session_ends(run_dir) == ["interrupted"], out[-3000:]
    assert "SIGUSR1" in metrics.read_text().splitlines()[-1]
    assert log.read_text() == "requeue 4242\n"

    stopped = json.loads(metrics.read_text().splitlines()[-1])["step"]
    # the requeued job, less to do
    env["EXTRA"] = env["EXTRA"].replace("max_steps=400", f"max_steps={stopped + 3}")
    again = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert session_ends(run_dir)[-1] == "completed" and log.read_text() == "requeue 4242\n"

    done = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "nothing to do" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert log.read_text() == "requeue 4242\n"
