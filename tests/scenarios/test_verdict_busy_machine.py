"""A pilot on a machine that gets busy halfway: GO with the contention WARN, not NO-GO.

Both training sessions run as child processes pinned to one CPU. The first trains to step 20; before the
second (the resume, to step 40) starts, three busy-looping processes are pinned to the same CPU, so the
scheduler gives the trainer a quarter of it. Its training-only tokens/s falls far below the rule's 0.6 ratio.
Its tokens per CPU second are no steady figure on a shared core (each switch to another task evicts the
trainer's caches: on this project's 2-core machine they came out at 0.15-1.01 of the first session's rate),
but its CPU seconds per training second, which the scheduler makes certain, fall to a quarter, and the rule
reads that share too. Three competitors, not two, so that the share still falls clearly when the machine is
busy already: under two more busy loops on the 2 cores the first session itself got half the CPU and the
share ratio came out at 0.49 (0.50 -> 0.25); with two competitors it was 0.6-0.7 there, and the WARN became a
FAIL in 2 of 3 runs. Measured: idle, 1.00 -> 0.25 and 68 s for the test; four competitors take 2 min."""

import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from pilotrun.run.record import read_metrics_strict

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
OVERRIDES = ["train.num_threads=1", "train.log_every=2", "train.eval_every=10", "train.checkpoint_every=10",
             "optim.schedule.horizon=40", "optim.grad_clip=10", "model.bias_update_speed=0.01"]
BUSY_PROCESSES = 3


def _pin(cpu):
    return lambda: os.sched_setaffinity(0, {cpu})


def _train_child(data_dir, run_dir, cpu, *extra):
    command = [sys.executable, "-m", "pilotrun", "train", "--config", str(SMOKE), "--data", str(data_dir),
               "--run-dir", str(run_dir), *extra]
    for override in OVERRIDES:
        command += ["--set", override]
    done = subprocess.run(command, preexec_fn=_pin(cpu), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_pilot_on_a_machine_made_busy_halfway_is_go_with_the_contention_warning(
    builtin_data_dir, tmp_path, capsys
):
    cpu = min(os.sched_getaffinity(0))
    run_dir = tmp_path / "run"
    _train_child(builtin_data_dir, run_dir, cpu, "--set", "train.max_steps=20")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=_pin(cpu))
            for _ in range(BUSY_PROCESSES)]
    try:
        _train_child(builtin_data_dir, run_dir, cpu, "--resume", "--set", "train.max_steps=40")
    finally:
        for process in busy:
            process.send_signal(signal.SIGKILL)
            process.wait()
    capsys.readouterr()
    code = main(["verdict", str(run_dir), "--json", "--threshold", "max_imbalance=3"])
    data = json.loads(capsys.readouterr().out)
    rules = {r["name"]: r for r in data["rules"]}
    throughput = rules["throughput_steady"]
    assert throughput["status"] == "WARN", throughput
    assert throughput["figure"].startswith("the machine got busier")
    # The resumed session's CPU seconds per training second, from the record itself: about a third.
    resumed = [e["window"] for e in read_metrics_strict(run_dir) if e["event"] == "train" and e["step"] > 22]
    share = statistics.median(w["cpu_seconds"] / w["train_seconds"] for w in resumed)
    assert share < 0.5, (share, throughput["figure"])
    assert code == 0 and data["decision"] == "GO" and data["failed"] == [], data["statement"]
    assert "throughput_steady" in [w["name"] for w in data["warnings"]]
    assert rules["resumed"]["status"] == "PASS" and rules["loss_decreased"]["status"] == "PASS"
