"""Spikes under `torchrun --nproc_per_node=2` on the CPU (gloo): every rank makes the same decision.

One 2-rank run with policy skip meets two spikes that start on rank 1 alone: a poisoned microbatch in rank 1's
rows (its loss, and through the all-reduce the global gradient norm, jump) and, later, rank 1's gradient
corrupted once after the all-reduce (only its norm jumps). Both ranks skip both updates: had they decided
apart, the DDP replicas would differ and the checkpoint's replica check would refuse to save (or a collective
hang). The first spike's replay recurs on its batch and not on the next: "batch"; the second is not
reproduced, with rank 1 named.

The factor is 4, not the default 6, and each rank's batch 8 x 32 (512 tokens an update): a poisoned microbatch
on one rank of two lifts the global gradient norm to about 6x the window's median there (3.9x at 2 x 32 a
rank: inside the 5-7x that healthy norms reach at 128 tokens an update, and under that batch's floor,
spike_bound.grad_norm_floor_share), above the 3x floor of factor 4 at 512 tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pilotrun.report.record_check.summarize import summarize_run
from tests.training.test_distributed_trainer import _env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_two_ranks_decide_alike_and_the_corrupted_rank_is_named(builtin_data_dir, tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "tests.training.spike_faults", "--poison-batch", "16", "--poison-rank", "1",
               "--corrupt-rank", "1", "--corrupt-call", "21", "--",
               "train", "--config", str(ROOT / "configs" / "smoke.yaml"), "--data", str(builtin_data_dir),
               "--run-dir", str(run_dir)]
    for setting in (
        "train.batch_size=8",
        "train.max_steps=24",
        "train.checkpoint_every=8",
        "train.eval_every=0",
        "train.log_every=1",
        "train.num_threads=1",
        "optim.schedule.horizon=24",
        "optim.muon.lr=0.02",
        "optim.adamw.lr=0.01",
        "train.spike.min_history=8",
        "train.spike.window=20",
        "train.spike.factor=4",
        "train.spike.policy=skip",
    ):
        command += ["--set", setting]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    spikes = [e for e in events if e["event"] == "spike"]
    assert [s["spike_step"] for s in spikes] == [17, 20], spikes  # attempt 21 would have made step 20
    poisoned, corrupted = spikes
    assert poisoned["batches"] == [16] and poisoned["action"] == "skipped" and len(poisoned["per_rank"]) == 2
    assert poisoned["per_rank"][1][1] > poisoned["per_rank"][0][1]  # rank 1's loss
    assert poisoned["cause"] == "batch" and poisoned["replay"]["ranks_differing"] == []
    assert corrupted["cause"] == "not_reproducible" and corrupted["replay"]["ranks_differing"] == [1]
    assert corrupted["per_rank"][1][0] > 100 * corrupted["per_rank"][0][0]
    end = events[-1]
    assert end["event"] == "session_end" and end["reason"] == "completed" and end["updates_skipped"] == 2
    summary = summarize_run(run_dir)
    assert summary.valid, summary.reasons
