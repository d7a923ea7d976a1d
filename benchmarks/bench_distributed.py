"""Data-parallel scaling on the CPU: training tokens/s of 1 process against 2 torchrun ranks (DDP over gloo).

Every configuration is a real `pilotrun train` (the CPU stability model of configs/stability.yaml, seq_len 64,
the built-in corpus, fp32, one intra-op thread per rank so that 2 ranks use the 2 cores and 1 rank uses 1),
measured from its own metrics.jsonl: training tokens / training seconds over every `train` window after the
first (the first holds the warm-up). Side by side, alternating, REPEATS rounds; the median of each.

- weak scaling: 2 ranks x batch 8 (global 16) against 1 process x batch 8: efficiency = T2 / (2 T1).
- strong scaling: 2 ranks x batch 4 (global 8, the same global batch) against 1 process x batch 8:
  speedup = T2 / T1, ideal 2.

Limits: 2 cores on one machine, gloo over loopback, a small model (the gradient all-reduce is large relative
to its compute), and a machine shared with other work while this runs. These are not GPU/NCCL figures.
`python -m benchmarks.run_all bench_distributed`
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 2
STEPS = 20
TARGET_WEAK_EFFICIENCY = 0.7


def _train(data: Path, run_dir: Path, world_size: int, batch_size: int) -> dict[str, float]:
    launcher = [sys.executable, "-m", "pilotrun"] if world_size == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
         "-m", "pilotrun"]
    command = launcher + [
        "train", "--config", str(ROOT / "configs" / "stability.yaml"), "--data", str(data), "--run-dir", str(run_dir),
        "--set", f"train.batch_size={batch_size}", "--set", f"train.max_steps={STEPS}", "--set", "train.log_every=5",
        "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0", "--set", "train.num_threads=1",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark run failed ({world_size} rank(s)): {done.stderr[-2000:]}")
    windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [e["window"] for e in windows if e["event"] == "train"][1:]  # the first window holds the warm-up
    tokens = sum(w["tokens"] for w in windows)
    seconds = sum(w["train_seconds"] for w in windows)
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds}


def run() -> str:
    from pilotrun.data.prepare import prepare_corpus

    configurations = [("1 process, batch 8", 1, 8), ("2 ranks x batch 8 (weak)", 2, 8),
                      ("2 ranks x batch 4 (strong)", 2, 4)]
    measured: dict[str, list[float]] = {name: [] for name, _, _ in configurations}
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "data"
        prepare_corpus(data, source="builtin", tokenizer="bpe:4096", progress=False)
        for round_index in range(REPEATS):
            for name, world_size, batch_size in configurations:
                run_dir = Path(scratch) / f"run-{round_index}-{world_size}-{batch_size}"
                measured[name].append(_train(data, run_dir, world_size, batch_size)["tokens_per_s"])
    median = {name: statistics.median(values) for name, values in measured.items()}
    one = median["1 process, batch 8"]
    weak = median["2 ranks x batch 8 (weak)"] / (2 * one)
    strong = median["2 ranks x batch 4 (strong)"] / one
    rows = "\n".join(
        f"| {name} | {median[name]:,.0f} | {', '.join(f'{v:,.0f}' for v in measured[name])} | "
        f"{median[name] / one:.2f}x |" for name, _, _ in configurations)
    met = "met" if weak >= TARGET_WEAK_EFFICIENCY else "NOT met"
    return (
        "## Data-parallel scaling, 1 -> 2 ranks on the CPU (DDP, gloo)\n\n"
        f"`pilotrun train` on configs/stability.yaml's model (seq_len 64, fp32, {STEPS} updates, one thread per "
        "rank), training tokens/s from each run's own metrics.jsonl (windows after the first). Median of "
        f"{REPEATS} alternating rounds.\n\n"
        "| configuration | train tokens/s (median) | each round | vs 1 process |\n|---|---:|---|---:|\n"
        f"{rows}\n\n"
        f"- Weak scaling efficiency (global batch doubles): {weak:.2f} of ideal (ideal 1.00). "
        f"Target >= {TARGET_WEAK_EFFICIENCY}: **{met}**.\n"
        f"- Strong scaling (same global batch of 8): speedup {strong:.2f}x (ideal 2.00x).\n\n"
        "Limits: 2 CPU cores on one machine (2 ranks leave no core for anything else), gloo all-reduce over "
        "loopback, a small model whose gradient all-reduce is large relative to its compute, and a machine "
        "shared with other work during the run. These say nothing about NCCL on GPUs.\n\n"
        "Command: `python -m benchmarks.run_all bench_distributed`\n"
    )
