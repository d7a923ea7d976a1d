"""Exact continuation across processes, through the command line (cases 2 and 3; case 1 is
test_resume.py).

2. `pilotrun train` to K, then `--resume --set train.max_steps=N`, against a straight run to N: identical
   `loss` values in metrics.jsonl and identical final checkpoint tensors (RNG states included).
3. SIGKILL at several moments chosen by a seeded RNG, one of them inside a checkpoint write (held open by the
   checkpointer's test-only delay hook): every loss any session logged equals the straight run's loss for that
   step, the final checkpoint is identical, and no half-written checkpoint is ever loaded.
Also: an incompatible --resume and a damaged checkpoint file are one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pilotrun.run.marker import MARKER_NAME
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from tests.exactness import assert_exactly_equal
from tests.training.checkpoint import checkpoint_faults

ROOT = Path(__file__).resolve().parents[2]
N_STEPS = 10
RECIPE = [
    "train.num_threads=1", "train.log_every=1", "train.eval_every=5", "train.eval_batches=1",
    "train.checkpoint_every=2", "train.keep_checkpoints=2", "optim.qk_clip.tau=0.005",
    "optim.schedule.horizon=20", "train.loss_scale_init=2097152", "train.loss_scale_growth_interval=1",
]


def train_command(data_dir: Path, run_dir: Path, *extra: str, resume: bool = False,
                  launcher: list[str] | None = None) -> list[str]:
    command = (launcher or [sys.executable, "-m", "pilotrun"]) + [
        "train",
        "--config",
        str(ROOT / "configs" / "smoke.yaml"),
        "--data",
        str(data_dir),
        "--run-dir",
        str(run_dir),
    ]
    for item in RECIPE:
        command += ["--set", item]
    if resume:
        command.append("--resume")
    return command + list(extra)


def run_train(
    data_dir: Path, run_dir: Path, *extra: str, resume: bool = False
) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_command(data_dir, run_dir, *extra, resume=resume),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses_by_step(run_dir: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for event in events(run_dir):
        if event["event"] == "train":
            out.setdefault(event["step"], []).append(event["loss"])
    return out


@pytest.fixture(scope="module")
def straight_run(builtin_data_dir, tmp_path_factory):
    """The uninterrupted fp16 run to N that every interrupted one is compared with."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    result = run_train(builtin_data_dir, run_dir, "--set", f"train.max_steps={N_STEPS}", "--set",
                       "train.precision=fp16")
    assert result.returncode == 0, result.stderr
    losses = {step: values[0] for step, values in losses_by_step(run_dir).items()}
    assert sorted(losses) == list(range(1, N_STEPS + 1))
    # the scaler's skips are part of the test
    assert sum(e["event"] == "overflow" for e in events(run_dir)) > 0
    state, _ = Checkpointer(run_dir, keep=2).load()
    return losses, state, run_dir


def assert_matches_straight(run_dir: Path, straight_run) -> None:
    losses, state, _ = straight_run
    logged = losses_by_step(run_dir)
    assert sorted(logged) == sorted(losses)
    for step, values in logged.items():
        assert all(value == losses[step] for value in values), f"step {step}: {values} vs {losses[step]}"
    final, _ = Checkpointer(run_dir, keep=2).load()
    assert final["trainer"]["step"] == N_STEPS
    assert_exactly_equal(state, final, "final checkpoint")


@pytest.mark.slow
def test_cli_resume_matches_a_straight_run(builtin_data_dir, tmp_path, straight_run):
    run_dir = tmp_path / "run"
    first = run_train(
        builtin_data_dir, run_dir, "--set", "train.max_steps=3", "--set", "train.precision=fp16"
    )
    assert first.returncode == 0, first.stderr
    second = run_train(builtin_data_dir, run_dir, "--set", f"train.max_steps={N_STEPS}", "--set",
                       "train.precision=fp16", resume=True)
    assert second.returncode == 0, second.stderr
    assert_matches_straight(run_dir, straight_run)
    record = json.loads((run_dir / "run.json").read_text())
    assert [s["resumed_from"] for s in record["sessions"]] == [None, 3]
    assert record["recipe"]["train"]["max_steps"] == N_STEPS  # the effective recipe, with the free change
    assert [e.get("resumed_from") for e in events(run_dir) if e["event"] == "session_start"] == [None, 3]


def _committed(run_dir: Path) -> list[int]:
    """Read-only look at the folder while the trainer writes into it (a Checkpointer here could race it)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(
        int(f.name[5:]) for f in root.iterdir() if f.name.startswith("step-") and (f / MARKER_NAME).exists()
    )


def _unfinished_writes(run_dir: Path) -> set[str]:
    """Temp folders and step folders without a marker: a write in progress, or left by an earlier kill."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return set()
    return {
        folder.name
        for folder in root.iterdir()
        if folder.name.startswith(".tmp-")
        or (folder.name.startswith("step-") and not (folder / MARKER_NAME).exists())
    }


def _wait(predicate, process: subprocess.Popen, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        if process.poll() is not None:
            return False
        time.sleep(0.01)
    raise AssertionError("the training process never reached the awaited moment")


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_matches(builtin_data_dir, tmp_path, straight_run):
    run_dir = tmp_path / "run"
    chooser = random.Random(20261130)  # fixed seed: the same kill schedule every time
    extra = ("--set", f"train.max_steps={N_STEPS}", "--set", "train.precision=fp16")
    kills = 0
    killed_inside_write = False
    for attempt in range(8):
        resume = (run_dir / "run.json").exists()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        during_write = attempt == 1  # the second session is killed inside a checkpoint write
        # The second session's folder is renamed and its marker waits 2 s: the kill lands before it.
        launcher = checkpoint_faults.command("--commit-delay", "2") if during_write else None
        process = subprocess.Popen(
            train_command(builtin_data_dir, run_dir, *extra, resume=resume, launcher=launcher),
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            if attempt < 3:
                start_steps = set(_committed(run_dir))
                # Leftovers of an earlier kill (which may itself have landed inside a write) are not this
                # session's write: only a folder that appears after the start counts.
                leftovers = _unfinished_writes(run_dir)
                if during_write:
                    reached = _wait(lambda old=leftovers: bool(_unfinished_writes(run_dir) - old), process)
                else:
                    # After at least one new commit (so the next session has something to resume), at a random
                    # moment of the following updates.
                    reached = _wait(
                        lambda before=start_steps: bool(set(_committed(run_dir)) - before), process
                    )
                    time.sleep(chooser.uniform(0.0, 0.4))
                if reached and process.poll() is None:
                    uncommitted_before_kill = bool(_unfinished_writes(run_dir) - leftovers)
                    process.send_signal(signal.SIGKILL)
                    kills += 1
                    killed_inside_write = killed_inside_write or (during_write and uncommitted_before_kill)
            _, stderr = process.communicate(timeout=300)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        if process.returncode == 0:
            break
        assert process.returncode == -signal.SIGKILL, stderr
        # Whatever the kill left, only committed checkpoints count and each one loads intact.
        checkpointer = Checkpointer(run_dir, keep=2)
        for step in checkpointer.committed_steps():
            checkpointer.verify(step)
    assert process.returncode == 0, stderr
    assert kills >= 2 and killed_inside_write, f"kills={kills}, killed_inside_write={killed_inside_write}"
    assert_matches_straight(run_dir, straight_run)
    starts = [e for e in events(run_dir) if e["event"] == "session_start"]
    assert len(starts) == kills + 1, [(s["session_id"], s["step"], s["resumed_from"]) for s in starts]
    assert all(s["resumed_from"] is not None for s in starts[1:])
    # The hash chain held through every kill (torn tails cut, sessions appended) and the claim is complete.
    from pilotrun.report.record_check.summarize import summarize_run

    summary = summarize_run(run_dir, require_step=N_STEPS)
    assert summary.valid, summary.reasons


@pytest.mark.slow
def test_cli_refuses_an_incompatible_resume_and_names_a_damaged_file(
    builtin_data_dir, tmp_path, straight_run
):
    run_dir = tmp_path / "run"
    shutil.copytree(straight_run[2], run_dir)
    refused = run_train(
        builtin_data_dir,
        run_dir,
        "--set",
        "train.max_steps=12",
        "--set",
        "train.precision=fp16",
        "--set",
        "train.batch_size=2",
        resume=True,
    )
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.batch_size: 4 -> 2" in lines[0] and "Traceback" not in refused.stderr

    victim = run_dir / "checkpoints" / f"step-{N_STEPS:08d}" / "optimizer.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    damaged = run_train(
        builtin_data_dir, run_dir, "--set", "train.max_steps=12", "--set", "train.precision=fp16", resume=True
    )
    assert damaged.returncode == 2
    assert (
        f"step-{N_STEPS:08d}/optimizer.pt" in damaged.stderr
        and f"--from-step {N_STEPS - 2}" in damaged.stderr
    )
    assert len(damaged.stderr.strip().splitlines()) == 1
    # (--from-step past a damaged checkpoint continuing exactly is tested in process, in test_resume.py.)
