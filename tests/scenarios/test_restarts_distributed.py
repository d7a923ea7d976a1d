"""Two gloo ranks under torchrun's own agent, a rank faulty through a test seam
(tests/training/faulty_rank.py): a worker SIGKILLed mid-run, or one stalled until the hang watchdog fires.
With `--max-restarts 1` torchrun restarts the group, `--resume auto` continues from the newest committed
checkpoint, and the finished run equals one that never stopped, bit for bit (every update's loss, the final
weights torch.equal), with each session on the record under its reason."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pilotrun.common.stop_signals import HUNG_EXIT_CODE
from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer
from tests.exactness import assert_exactly_equal

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 40
FAULT_AT = 25  # before the update after step 25: checkpoint 20 is the newest committed one


def command(data: Path, run_dir: Path, *launcher: str, fault: list[str] | None = None) -> list[str]:
    program = (
        [str(ROOT / "tests" / "training" / "faulty_rank.py"), *fault, "--"] if fault else ["-m", "pilotrun"]
    )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        *launcher,
        *program,
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
        f"optim.schedule.horizon={MAX_STEPS}",
        "--set",
        "train.batch_size=2",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.checkpoint_every=10",
        "--set",
        "train.keep_checkpoints=20",
        "--set",
        "train.num_threads=1",
        "--hang-timeout",
        "20,600",
    ]


def run(argv: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(run_dir) if e["event"] == "train"}


def final_weights(run_dir: Path) -> dict:
    return DistributedCheckpointer(run_dir, keep=20).load()[0]["model"]


@pytest.fixture(scope="module")
def straight(builtin_data_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    done = run(command(builtin_data_dir, run_dir))
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def assert_same_as_straight(run_dir: Path, straight: Path) -> None:
    assert losses(run_dir) == losses(straight)
    assert sorted(losses(run_dir)) == list(range(1, MAX_STEPS + 1))
    assert_exactly_equal(final_weights(run_dir), final_weights(straight), "final weights")


def test_a_worker_sigkilled_mid_run_is_restarted_by_torchrun_and_the_run_continues_exactly(
    builtin_data_dir, tmp_path, straight
):
    run_dir = tmp_path / "run"
    done = run(command(builtin_data_dir, run_dir, "--max-restarts", "1",
                       fault=["kill", "1", str(FAULT_AT), str(tmp_path / "killed-once")]))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exitcode: -9" in done.stderr  # torchrun saw the SIGKILL, then restarted the group
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert [s["resumed_from"] for s in sessions] == [None, 20]
    ends = [e for e in events(run_dir) if e["event"] == "session_end"]
    # Rank 0 learns of its peer's death in the gradients' all-reduce: its session ends as an error, at the
    # step it had reached; the restarted group's session completes.
    assert [e["reason"] for e in ends] == ["error", "completed"] and ends[0]["step"] == FAULT_AT
    assert_same_as_straight(run_dir, straight)


def test_a_stalled_rank_is_ended_hung_on_every_rank_and_torchrun_restarts_it_exactly(
    builtin_data_dir, tmp_path, straight
):
    run_dir = tmp_path / "run"
    done = run(command(builtin_data_dir, run_dir, "--max-restarts", "1",
                       fault=["stall", "1", str(FAULT_AT), str(tmp_path / "stalled-once")]))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exitcode: {HUNG_EXIT_CODE}" in done.stderr
    stacks = sorted((run_dir / "hangs").iterdir())
    assert sorted(p.name.rsplit("-", 1)[1] for p in stacks) == ["rank0.txt", "rank1.txt"]
    stalled = next(p for p in stacks if p.name.endswith("rank1.txt")).read_text()
    waiting = next(p for p in stacks if p.name.endswith("rank0.txt")).read_text()
    assert "in faulty" in stalled and "time.sleep(3600)" in stalled
    assert "in train_one_update" in waiting  # rank 0 waits in the update's collective for rank 1
    ends = [e for e in events(run_dir) if e["event"] == "session_end"]
    assert [e["reason"] for e in ends] == ["hung", "completed"] and ends[0]["step"] == FAULT_AT
    # Rank 0 fired itself (rank 1 waits before it exits), or its collective broke first and it found rank 1's
    # file.
    assert (
        re.search(r"^rank 0: no progress for \d+ s in update after step 25 \(bound 20 s", ends[0]["message"])
        or "another rank hung" in ends[0]["message"]
    )
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert [s.get("end_reason") for s in sessions] == ["hung", "completed"]
    assert [s["resumed_from"] for s in sessions] == [None, 20]
    assert_same_as_straight(run_dir, straight)


def test_rank_0_stuck_is_recorded_hung_by_the_next_start_and_the_rerun_finishes_exactly(
    builtin_data_dir, tmp_path, straight
):
    """Rank 0 SIGSTOPped (its watchdog stopped with it): rank 1's watchdog writes its stacks and exits 124,
    rank 0 records nothing and is killed (as SLURM's KillWait would). The same argv run again records, before
    it trains, that the first session hung (`hang_found`: the session, rank 1, the stack file), and finishes
    the run bit for bit as one that never stopped."""
    from tests.scenarios.test_scheduler_endings import alive, children, rank_of, wait_for
    from tests.scenarios.test_scheduler_endings import events as events_so_far

    run_dir = tmp_path / "run"
    argv = command(builtin_data_dir, run_dir) + ["--hang-timeout", "5,600"]  # the last given is the one taken
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    launcher = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    wait_for(lambda: sum(e["event"] == "train" for e in events_so_far(run_dir)) >= 12, 300, "12 updates",
             launcher)
    ranks = {rank_of(pid): pid for pid in children(launcher.pid)}
    os.kill(ranks[0], signal.SIGSTOP)
    wait_for(lambda: not alive(ranks[1]), 120, "rank 1's exit", launcher)
    os.kill(ranks[0], signal.SIGKILL)
    out = launcher.communicate(timeout=120)[0]
    assert launcher.returncode != 0 and "exiting with 124" in out, out[-3000:]
    (stacks,) = sorted((run_dir / "hangs").iterdir())
    first = events(run_dir)[0]["session_id"]
    assert not any(e["event"] == "session_end" for e in events(run_dir))

    done = run(argv)
    assert done.returncode == 0, done.stderr[-3000:]
    found = [e for e in events(run_dir) if e["event"] == "hang_found"]
    assert [(e["hung_session"], e["rank"], e["stack_file"]) for e in found] == [
        (first, 1, f"hangs/{stacks.name}")]
    kinds = [(e["event"], e["session_id"]) for e in events(run_dir)]
    at = kinds.index(("hang_found", found[0]["session_id"]))
    assert kinds[at - 1] == ("session_start", found[0]["session_id"]) and found[0]["session_id"] != first
    assert f"note: session {first} has no session_end, but rank 1 wrote its stacks" in done.stdout
    summary = run([sys.executable, "-m", "pilotrun", "summarize", str(run_dir), "--json"])
    assert summary.returncode == 0, summary.stdout[-3000:]
    assert json.loads(summary.stdout)["overall"]["session_ends"]["hung"] == 1
    assert_same_as_straight(run_dir, straight)
