"""Two gloo ranks under torchrun, the same argv run again and again with SLURM_JOB_END_TIME faked ahead at
each start: every session ends either with its deadline (reason `deadline`, exit 75, a committed checkpoint at
its step, or at step 0 with nothing trained when its set-up left no room for a save) or with the run complete,
the finished run equals a run that never stopped bit for bit, and one more run exits 0 with nothing to do.

What is asserted holds however many sessions the machine's speed at that moment makes it take: the deadline is
not measured from this machine's speed but doubled at each session from a first one too short for the whole
run, so a slow or busy machine only adds sessions. A session started so late that its deadline is already past
(or too close for the record's set-up, one update and a save) is refused, writing nothing, and the next one
has twice the time. Whether a
session commits before its deadline is not asserted: on a busy machine a stall can land an update late, which
no margin rules out; the decision against the deadline is tested with injected clocks, two ranks' included, in
tests/training/test_loop.py, tests/scenarios/test_unattended.py and
tests/training/callbacks/test_deadline_stop.py."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer
from tests.exactness import assert_exactly_equal

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 300
# The first session's seconds ahead: past a Python start-up (the deadline is read as the command starts),
# short of the whole run (measured 18 s from launch to the end on a quiet 2-core machine, 5 s of it before the
# first update). Each session after it has twice its predecessor's time, so the sessions needed grow only as
# the log of the machine's slowdown.
FIRST_AHEAD = 8.0


def command(data: Path, run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "pilotrun",
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
        f"train.max_steps={MAX_STEPS}",
        "--set",
        "optim.schedule.horizon=300",
        "--set",
        "train.batch_size=2",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.checkpoint_every=50",
        "--set",
        "train.keep_checkpoints=20",
        "--set",
        "train.num_threads=1",
    ]


def run(argv: list[str], end_time: int | None, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("SLURM_JOB_END_TIME", None)
    if end_time is not None:
        env["SLURM_JOB_END_TIME"] = str(end_time)
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def record_digest(run_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in run_dir.glob("*.json*")}


def outcome(result: subprocess.CompletedProcess, before: dict[str, str], run_dir: Path) -> str:
    """What one session did, with what holds for it: `completed` (exit 0); `deadline` (torchrun reports the
    workers' own codes and exits 1 itself; the first rank out with 75 makes torchrun SIGTERM the other,
    already past the barrier after session_end: each says 75 or that SIGTERM, -15); `refused` (a rank exits 2
    on a deadline already past, or 79 on one closer than the record's set-up, one update and a save; each rank
    checks on its own clock before the process group exists, so the other may be refused too or be ended by
    torchrun's SIGTERM in its set-up, 143 or -15; the record is as it was)."""
    if result.returncode == 0:
        return "completed"
    codes = dict(
        re.findall(r"rank\s*:\s*(\d) \(local_rank: \d\)\s*\n\s*exitcode\s*:\s*(-?\d+)", result.stderr)
    )
    assert set(codes) == {"0", "1"}, result.stderr[-3000:]
    if set(codes.values()) & {"2", "79"}:
        assert set(codes.values()) <= {"2", "79", "143", "-15"}, result.stderr[-3000:]
        assert re.search(r"already past|not started in this allocation", result.stderr), result.stderr[-3000:]
        assert record_digest(run_dir) == before
        return "refused"
    assert "75" in codes.values() and set(codes.values()) <= {"75", "-15"}, result.stderr[-3000:]
    return "deadline"


def sessions_until_done(data: Path, run_dir: Path) -> list[str]:
    """Each session's outcome, the same argv run with twice the time ahead each time until it exits 0."""
    outcomes, ahead = [], FIRST_AHEAD
    while not outcomes or outcomes[-1] != "completed":
        assert len(outcomes) < 16, outcomes  # 8 s doubled 15 times is three days: only a loop that never ends
        before = record_digest(run_dir)
        result = run(command(data, run_dir), int(time.time() + ahead), timeout=ahead + 900)
        outcomes.append(outcome(result, before, run_dir))
        ahead *= 2
    return outcomes


def test_two_ranks_run_again_and_again_before_each_deadline_then_nothing_to_do(builtin_data_dir, tmp_path):
    straight, run_dir = tmp_path / "straight", tmp_path / "run"
    done = run(command(builtin_data_dir, straight), None)
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = sessions_until_done(builtin_data_dir, run_dir)

    record = events(run_dir)
    ends = [e for e in record if e["event"] == "session_end"]
    assert [e["reason"] for e in ends] == [o for o in outcomes if o != "refused"]
    # a session with room for a start-up but not for 300 updates: none jumps to the end
    assert "deadline" in outcomes
    committed = DistributedCheckpointer(run_dir, keep=20).committed_steps()
    # A session whose set-up left no room for a save trains nothing (deadline_stop.too_late_to_start): at step
    # 0 there is no checkpoint for it to name, and none is needed.
    assert all(
        end["step"] in committed or (end["step"] == 0 and end["reason"] == "deadline") for end in ends
    ), ([e["step"] for e in ends], committed, outcomes)
    losses = {e["step"]: e["loss"] for e in record if e["event"] == "train"}
    assert losses == {e["step"]: e["loss"] for e in events(straight) if e["event"] == "train"}
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    assert_exactly_equal(DistributedCheckpointer(run_dir, keep=20).load()[0]["model"],
                         DistributedCheckpointer(straight, keep=20).load()[0]["model"], "final weights")

    again = run(command(builtin_data_dir, run_dir), int(time.time()) + 3600)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr[-3000:]
    assert events(run_dir) == record
