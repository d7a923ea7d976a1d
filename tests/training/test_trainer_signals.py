"""SIGTERM / SIGINT: the update in flight finishes, a checkpoint is committed, session_end says interrupted,
and the process exits 143 / 130. Then `inspect-batch` reconstructs what an update read from the record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from pilotrun.commands.inspect_batch import attempt_for_step
from pilotrun.data.reader import BatchLoader, open_dataset
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.run.record import read_metrics_strict
from pilotrun.training.checkpoint.checkpointer import Checkpointer

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"


def _wait_for_train_events(
    run_dir: Path, count: int, process: subprocess.Popen, timeout: float = 180.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"trainer exited early with {process.returncode}: {process.stderr.read()[-2000:]}")
        if sum(1 for e in read_metrics_strict(run_dir) if e["event"] == "train") >= count:
            return
        time.sleep(0.05)
    process.kill()
    pytest.fail("trainer did not log its first train events in time")


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, exit_code", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)]
)
def test_signal_finishes_the_update_saves_and_exits_with_the_documented_code(
    builtin_data_dir, tmp_path, signum, exit_code
):
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "pilotrun",
        "train",
        "--config",
        str(SMOKE),
        "--data",
        str(builtin_data_dir),
        "--run-dir",
        str(run_dir),
        "--set",
        "train.max_steps=100000",
        "--set",
        "train.checkpoint_every=0",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.num_threads=1",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _wait_for_train_events(run_dir, 2, process)
    process.send_signal(signum)
    out, err = process.communicate(timeout=180)
    assert process.returncode == exit_code, err[-2000:]
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    end = events[-1]
    assert end["event"] == "session_end" and end["reason"] == "interrupted"
    assert signal.Signals(signum).name in end["message"]
    checkpoint = events[-2]
    assert checkpoint["event"] == "checkpoint" and checkpoint["step"] == end["step"] >= 2
    assert Checkpointer(run_dir, keep=1).committed_steps() == [end["step"]]
    last_train = [e for e in events if e["event"] == "train"][-1]
    assert last_train["step"] == end["step"] and last_train["tokens_seen"] == end["tokens_seen"]
    assert end["tokens_seen"] == end["step"] * 128  # the update in flight was finished, not abandoned
    assert "session_end: interrupted" in out


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_every", [0, 2])
def test_ctrl_c_outside_the_stop_signals_is_an_interruption_said_in_one_line(
    builtin_data_dir, tmp_path, checkpoint_every
):
    """`--stop-signals SIGTERM` leaves SIGINT to Python: a Ctrl-C raises KeyboardInterrupt mid-update. The
    session ends `interrupted` (the person asked), not `error`: exit 130, one line naming what was and was not
    saved, no traceback; the record stays valid, the last committed checkpoint (or none) what a resume
    finds."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "pilotrun", "train", "--config", str(SMOKE), "--data",
               str(builtin_data_dir), "--run-dir", str(run_dir), "--stop-signals", "SIGTERM", "--set",
               "train.max_steps=100000", "--set", f"train.checkpoint_every={checkpoint_every}", "--set",
               "train.eval_every=0",
               "--set", "train.num_threads=1", "--set", "train.log_every=1", "--progress", "none"]
    process = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_train_events(run_dir, 5, process)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=180)
    assert process.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err + out
    (line,) = [line for line in err.splitlines() if line.startswith("pilotrun train:")]
    assert line.startswith("pilotrun train: stopped at once by SIGINT (Ctrl-C), not one of --stop-signals, "
                           "without saving the work since the last checkpoint; continue the run with `")
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    end = events[-1]
    assert end["event"] == "session_end" and end["reason"] == "interrupted"
    committed = Checkpointer(run_dir, keep=1).committed_steps()
    said = "SIGINT (Ctrl-C), not one of this session's stop signals (--stop-signals): stopped at once"
    assert end["message"].startswith(f"{said}, no checkpoint for step {end['step']:,}; ")
    if checkpoint_every:
        assert committed
        assert end["message"].endswith(f"the newest committed checkpoint is step {committed[-1]:,}")
    else:
        assert committed == []
        assert end["message"].endswith("nothing of this run is saved (no checkpoint committed yet)")
    assert f"session_end: interrupted at step {end['step']:,} (SIGINT (Ctrl-C)" in out
    summary = summarize_run(run_dir)
    assert summary.sessions[-1].end_reason == "interrupted" and not any("error" in r for r in summary.reasons)


@pytest.mark.slow
def test_inspect_batch_names_the_windows_and_decodes_them(builtin_data_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["train", "--config", str(SMOKE), "--data", str(builtin_data_dir), "--run-dir", str(run_dir),
                 "--set", "train.max_steps=3", "--set", "train.gradient_accumulation_steps=2",
                 "--set", "train.num_threads=1"])
    assert code == 0
    capsys.readouterr()
    assert main(["inspect-batch", str(run_dir), "--step", "2", "--max-chars", "100000"]) == 0
    out = capsys.readouterr().out
    # Update 2 is attempt 2 (no skips): microbatches 2 and 3 of the training split, 4 rows each.
    assert "update 2 read 2 microbatch(es) [2, 3]" in out
    dataset = open_dataset(builtin_data_dir)
    split = dataset.split("train")
    tokenizer = dataset.load_tokenizer()
    loader = BatchLoader(split, 4, 32)
    for row in loader.describe_batch(3):
        text = tokenizer.decode([int(t) for t in split.read(row["start"], row["length"])])
        assert repr(text) in out
        shard, offset, length = row["pieces"][0]
        assert f"{shard}[{offset}:{offset + length}]" in out
    assert main(["inspect-batch", str(run_dir), "--step", "4"]) == 2
    assert "reaches step 3 only" in capsys.readouterr().err
    # An edited log (its skipped attempts decide which batches an update read) is refused, naming the line.
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    first_train = next(i for i, line in enumerate(lines) if '"event":"train"' in line)
    lines[first_train] = lines[first_train].replace('"event":"train"', '"event":"train" ', 1)
    metrics.write_text("\n".join(lines) + "\n")
    assert main(["inspect-batch", str(run_dir), "--step", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and f"metrics.jsonl line {first_train + 1} " in err[0] and "hash chain broken" in err[0]
    )


def test_attempt_arithmetic_skips_the_overflowed_attempts():
    assert attempt_for_step(1, set()) == 1
    assert attempt_for_step(1, {1, 2, 3}) == 4
    assert attempt_for_step(3, {2, 5}) == 4
    assert attempt_for_step(4, {2, 5}) == 6
