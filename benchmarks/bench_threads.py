"""train.num_threads: the CPU stability recipe at 1, 2 and N intra-op threads and at the default, side by
side.

Each run is a fresh `pilotrun train` process (a thread pool is set once per process, as a real run sets it),
UPDATES updates of configs/stability.yaml with no evaluation or checkpoint, and the figure is the session's
own training seconds (wall clock: what a person waits on, and what a descheduled OpenMP thread costs) per
update. Rounds alternate the settings so that the machine's load drifts over all of them alike. The ratio is
each setting's median seconds per update over the 1-thread median (above 1: slower). "default" is
`train.num_threads: 0`, which pilotrun resolves per process (training/environment.py default_threads).
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
UPDATES = 10
ROUNDS = 3


def settings() -> list[tuple[str, int]]:
    """(label, train.num_threads): 1, 2, N (every logical CPU: torch's own default), and pilotrun's
    default."""
    logical = os.cpu_count() or 1
    chosen = {1: "1", 2: "2", logical: f"N = {logical} (all logical CPUs, torch's default)"}
    return [(label, threads) for threads, label in sorted(chosen.items())] + [("default (0)", 0)]


def seconds_per_update(data_dir: Path, run_dir: Path, threads: int) -> tuple[float, int]:
    """(training seconds per update, the threads the session ran with) of one fresh process."""
    command = [sys.executable, "-m", "pilotrun", "train", "--config", "stability", "--data", str(data_dir),
               "--run-dir", str(run_dir), "--progress", "none", "--set", f"train.num_threads={threads}",
               "--set", f"train.max_steps={UPDATES}", "--set", "train.eval.every=0", "--set",
               "train.checkpoint.every=0", "--set", "train.log.every=5"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the recipe decides, not the shell
    subprocess.run(
        command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    end = [e for e in events if e["event"] == "session_end"][-1]
    used = json.loads((run_dir / "run.json").read_text())["sessions"][-1]["hardware"]["torch_threads"]
    return end["time_split"]["train_seconds"] / UPDATES, used


def run() -> str:
    from pilotrun.data.prepare import prepare_corpus
    from pilotrun.training.environment import default_threads, physical_cores

    chosen = settings()
    times: dict[str, list[float]] = {label: [] for label, _ in chosen}
    used: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data_dir = work / "data"
        prepare_corpus(data_dir, source="builtin", tokenizer="bpe:4096", progress=False)
        # the kernels' build and first-call costs, not measured
        seconds_per_update(data_dir, work / "warm-up", 1)
        for index in range(ROUNDS):
            for label, threads in chosen:
                seconds, used[label] = seconds_per_update(data_dir, work / f"{index}-{threads}", threads)
                times[label].append(seconds)
    base = statistics.median(times["1"])
    lines = [
        "## Intra-op threads (train.num_threads) on the CPU stability recipe",
        "",
        f"configs/stability.yaml, {UPDATES} updates per run (no eval, no checkpoint), a fresh process per "
        "run, "
        f"{ROUNDS} rounds alternating the settings; the session's training seconds (wall clock) per update. "
        f"This machine: {os.cpu_count()} logical CPUs, {physical_cores()} physical cores; the default "
        "resolves "
        f"to {default_threads(1)} thread(s) for one process, {default_threads(2)} per rank for two.",
        "",
        "| setting | threads used | s/update per round | median s/update | ratio to 1 thread |",
        "|---|---|---|---|---|",
    ]
    for label, _threads in chosen:
        median = statistics.median(times[label])
        rounds = ", ".join(f"{value:.3f}" for value in times[label])
        lines.append(f"| {label} | {used[label]} | {rounds} | {median:.3f} | {median / base:.2f} |")
    fastest = min(chosen, key=lambda item: statistics.median(times[item[0]]))[0]
    lines += [
        "",
        f"Fastest here: {fastest}. On a machine that other work keeps busy, fewer threads than cores can "
        "be far faster (spinning OpenMP threads that lose their time slice stall every matmul), so the "
        "default "
        "(0) is chosen by each run from what it can use: the CPUs free at start and a short timing of this "
        "comparison on the recipe's own update (training/thread_choice.py), kept on resume; the built-in "
        "demo "
        "pilot pins 1. Every session records the threads it ran with and how they were chosen (run.json "
        "hardware.torch_threads and hardware.threads).",
        "",
        "Command: `python -m benchmarks.run_all bench_threads`",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run())
