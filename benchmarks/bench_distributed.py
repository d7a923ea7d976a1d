"""Data-parallel scaling on the CPU: training tokens/s of 1 process against 2 torchrun ranks (DDP over gloo).

Every configuration is a real `pilotrun train` (the CPU stability model of configs/stability.yaml, seq_len 64,
the built-in corpus, fp32, one intra-op thread per rank so that 2 ranks use the 2 cores and 1 rank uses 1),
measured from its own metrics.jsonl: training tokens / training seconds over every `train` window after the
first (the first holds the warm-up). Side by side, alternating, REPEATS rounds; the best of each, because
other work on the machine can only slow a run down (a shared machine makes the median drift from run to run).

- weak scaling: 2 ranks x batch 8 (global 16) against 1 process x batch 8: efficiency = T2 / (2 T1).
- strong scaling: 2 ranks x batch 4 (global 8, the same global batch) against 1 process x batch 8:
  speedup = T2 / T1, ideal 2.

Beside them, one gloo all-reduce of a buffer the size of the model's gradients between 2 processes and one
optimizer step (replicated on every rank under DDP) are timed on their own, to show what an update's time is
made of beyond the per-rank forward and backward.

Limits: 2 cores on one machine, gloo over loopback, a small model, and a machine that may be shared with other
work while this runs. These are not GPU/NCCL figures.
`python -m benchmarks.run_all bench_distributed`
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pilotrun.run.record import read_metrics_strict

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 3
STEPS = 20
TARGET_WEAK_EFFICIENCY = 0.7


def _train(
    data: Path, run_dir: Path, world_size: int, batch_size: int, sets: tuple[str, ...] = ()
) -> dict[str, float]:
    launcher = [sys.executable, "-m", "pilotrun"] if world_size == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
         "-m", "pilotrun"]
    command = (
        launcher
        + [
            "train",
            "--config",
            str(ROOT / "configs" / "stability.yaml"),
            "--data",
            str(data),
            "--run-dir",
            str(run_dir),
            "--set",
            f"train.batch_size={batch_size}",
            "--set",
            f"train.max_steps={STEPS}",
            "--set",
            "train.log.every=5",
            "--set",
            "train.eval.every=0",
            "--set",
            "train.checkpoint.every=0",
            "--set",
            "train.num_threads=1",
        ]
        + [argument for item in sets for argument in ("--set", item)]
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark run failed ({world_size} rank(s)): {done.stderr[-2000:]}")
    events = read_metrics_strict(run_dir)  # a damaged record must not become a benchmark figure
    windows = [e["window"] for e in events if e["event"] == "train"][1:]  # the first window holds the warm-up
    tokens = sum(w["tokens"] for w in windows)
    seconds = sum(w["train_seconds"] for w in windows)
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds}


def _allreduce_worker(rank: int, port: int, numel: int, repeats: int, out: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # connect to the parent's store, as under torchrun
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffer = torch.ones(numel)
    timings = []
    for _ in range(repeats + 2):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(buffer)
        timings.append(time.perf_counter() - started)
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(timings[2:]))


def _allreduce_seconds(numel: int, repeats: int = 20) -> float:
    """Best-of seconds of one gloo all-reduce of `numel` fp32 values between 2 processes on this machine."""
    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    # The rendezvous store lives here, on a port the OS picked and that stays bound: no free-port race.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as scratch:
        out = str(Path(scratch) / "timings.json")
        mp.start_processes(_allreduce_worker, args=(store.port, numel, repeats, out), nprocs=2,
                           start_method="spawn")
        return min(json.loads(Path(out).read_text()))


def _optimizer_step_seconds(repeats: int = 5) -> float:
    """Best-of seconds of one Muon+AdamW step of the stability model on one thread: work that DDP repeats on
    every rank and that does not shrink when the per-rank batch does."""
    import time

    import torch

    from pilotrun.config import load_run_config
    from pilotrun.model.transformer import build_model
    from pilotrun.optim.muon_adamw import build_optimizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = load_run_config(ROOT / "configs" / "stability.yaml", ["model.vocab_size=4096"])
        torch.manual_seed(0)
        model = build_model(config.model)
        optimizer = build_optimizer(model, config.optim)
        tokens = torch.randint(0, 4096, (8, 65), generator=torch.Generator().manual_seed(0))
        model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
        timings = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            optimizer.step()
            timings.append(time.perf_counter() - started)
        return min(timings[1:])
    finally:
        torch.set_num_threads(threads)


def run() -> str:
    from pilotrun.data.prepare import prepare_corpus

    replicated = ("optim.muon.distribute_newton_schulz=false",)
    configurations = [("1 process, batch 8", 1, 8, ()), ("2 ranks x batch 8 (weak)", 2, 8, ()),
                      ("2 ranks x batch 4 (strong)", 2, 4, ()),
                      ("2 ranks x batch 8 (weak), Newton-Schulz replicated", 2, 8, replicated),
                      ("2 ranks x batch 4 (strong), Newton-Schulz replicated", 2, 4, replicated)]
    measured: dict[str, list[float]] = {name: [] for name, _, _, _ in configurations}
    # The 1-minute load average before each run: on 2 cores, any other runnable process takes a share of the
    # cores the 2 ranks need, so a figure is only meaningful next to the load it was measured under.
    load_before: dict[str, list[float]] = {name: [] for name, _, _, _ in configurations}
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch) / "data"
        prepare_corpus(data, source="builtin", tokenizer="bpe:4096", progress=False)
        for round_index in range(REPEATS):
            for index, (name, world_size, batch_size, sets) in enumerate(configurations):
                run_dir = Path(scratch) / f"run-{round_index}-{index}"
                load_before[name].append(os.getloadavg()[0])
                measured[name].append(_train(data, run_dir, world_size, batch_size, sets)["tokens_per_s"])
    from pilotrun.config import load_run_config
    from pilotrun.model.accounting import count_parameters

    parameters, _ = count_parameters(load_run_config(ROOT / "configs" / "stability.yaml",
                                                     ["model.vocab_size=4096"]).model)
    allreduce = _allreduce_seconds(parameters)
    optimizer_step = _optimizer_step_seconds()
    best = {name: max(values) for name, values in measured.items()}
    one = best["1 process, batch 8"]
    weak = best["2 ranks x batch 8 (weak)"] / (2 * one)
    strong = best["2 ranks x batch 4 (strong)"] / one
    update_seconds = 8 * 64 / one  # one 1-process update: its tokens / its tokens per second
    predicted_strong = update_seconds / ((update_seconds - optimizer_step) / 2 + optimizer_step + allreduce)
    rows = "\n".join(
        f"| {name} | {best[name]:,.0f} | "
        f"{', '.join(f'{v:,.0f} ({load:.1f})' for v, load in zip(measured[name], load_before[name]))} | "
        f"{best[name] / one:.2f}x |" for name, _, _, _ in configurations)
    weak_replicated = best["2 ranks x batch 8 (weak), Newton-Schulz replicated"] / (2 * one)
    strong_replicated = best["2 ranks x batch 4 (strong), Newton-Schulz replicated"] / one
    met = "met" if weak >= TARGET_WEAK_EFFICIENCY else "NOT met"
    return (
        "## Data-parallel scaling, 1 -> 2 ranks on the CPU (DDP, gloo)\n\n"
        f"`pilotrun train` on configs/stability.yaml's model (seq_len 64, fp32, {STEPS} updates, one thread "
        "per "
        "rank), training tokens/s from each run's own metrics.jsonl (windows after the first). Best of "
        f"{REPEATS} alternating rounds.\n\n"
        "| configuration | train tokens/s (best) | each round (load average before it) | vs 1 process "
        "|\n|---|---:|---|---:|\n"
        f"{rows}\n\n"
        f"- Weak scaling efficiency (global batch doubles): {weak:.2f} of ideal (ideal 1.00). "
        f"Target >= {TARGET_WEAK_EFFICIENCY}: **{met}**.\n"
        f"- Strong scaling (same global batch of 8): speedup {strong:.2f}x (ideal 2.00x).\n"
        "- Newton-Schulz shared out (the default, `optim.muon.distribute_newton_schulz`: each rank "
        "orthogonalizes "
        "half of the Muon matrices, one all_gather shares them; the same update bit for bit) against every "
        "rank "
        f"orthogonalizing every matrix, measured side by side: weak {weak:.2f} vs {weak_replicated:.2f}, "
        "strong "
        f"{strong:.2f}x vs {strong_replicated:.2f}x.\n"
        f"- Communication: one gloo all-reduce of the model's {parameters:,} fp32 gradients between 2 "
        "processes "
        f"took {allreduce * 1e3:.1f} ms (best of 20), against {1e3 * update_seconds:.0f} ms of training per "
        "update for 1 process at batch 8 (its tokens / its tokens/s): "
        f"{allreduce / update_seconds:.1%} of an update. Whatever the shortfall from ideal above this share "
        "is, it is not the all-reduce; two compute processes on a 2-core machine share its memory bandwidth "
        "and "
        "caches and any other load on it (not separately measured here).\n"
        f"- Replicated work: one Muon+AdamW step of this model took {optimizer_step * 1e3:.0f} ms on one "
        "thread "
        f"(best of 5), {optimizer_step / update_seconds:.0%} of a 1-process update. DDP runs the whole "
        "optimizer step on every rank, so it does not shrink when the per-rank batch halves (except the "
        "Newton-Schulz "
        "part, now shared out, see above). If everything else halved, strong scaling would be update / "
        "((update - step) / 2 + step + all-reduce) = "
        f"{predicted_strong:.2f}x; the measured {strong:.2f}x falls short of that too, and the rest "
        "(fixed per-microbatch costs of small batches, two processes on two cores) is not separated here.\n\n"
        "These figures are only as good as the machine was idle: with 2 cores, every other runnable process "
        "(a load average above 0) takes from the 2 ranks' cores, twice as hard as from the 1 process, so on "
        "a "
        "shared machine the scaling figures swing from run to run; rerun on an idle machine before trusting "
        "them.\n\n"
        "Limits: 2 CPU cores on one machine (2 ranks leave no core for anything else), gloo all-reduce over "
        "loopback, a small model, and a machine that may be shared with other work during the run (the load "
        f"average when this section was written: {os.getloadavg()[0]:.1f}). These say nothing about NCCL on "
        "GPUs.\n\n"
        "Command: `python -m benchmarks.run_all bench_distributed`\n"
    )
