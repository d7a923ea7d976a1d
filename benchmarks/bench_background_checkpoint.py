"""Background checkpoints against synchronous ones: what the loop waits for, the whole save, and the write's
throughput against a plain torch.save of the same state.

The state is the trainer's for the GPU pilot model (the `gpu-100m` preset at vocab 32,768, its Muon+AdamW
state after one real step, scaler, counters, RNG), on the CPU. Side by side, alternating, in one process:

- synchronous: `DistributedCheckpointer.save` as one process saves (torch.save per part, sha256, fsync,
  rename, marker): the loop waits for all of it;
- background: `start_background_save` (the copy to host memory: what the loop waits for), then the write, its
  hashes and fsyncs in DCP's thread, then `finish_background_save`'s commit on the loop's thread (rename,
  marker: also waited for). Blocking = the copy + the commit; total = start to committed. Nothing trains
  beside the write here: on a CPU-only run the write would share the cores with training, on a GPU run it does
  not;
- plain torch.save of the same state to one file, then fsync: the write alone.

Beside it, the cost to training: a small model (the `tiny` preset, Muon+AdamW) trains on the same cores, and
its updates per second while a background write of the big state runs are compared with its steady rate (the
mean of the rates just before and just after, same process, same threads). It trains with one intra-op thread
(TRAINING_THREADS): what `train.num_threads: 0` chooses on a loaded 2-core machine, where torch's default of
two threads makes every update 10-50x slower and its rate noise (bench_threads). The training time a save
costs is its wait plus the updates the write held back (the time beside the write less the updates done at the
steady rate): where the background save's is not below the synchronous save's, `auto` keeps `sync` on a CPU.

Goals (at the default thread count): background blocking <= 0.05x the synchronous save; the background save's
whole time <= 1.3x the synchronous one in every round (not the median); training throughput while a background
write runs >= 95% of steady.
`python -m benchmarks.run_all bench_background_checkpoint`
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_checkpoint import _build_state

REPEATS = 3
BLOCKING_GOAL, TOTAL_GOAL, THROUGHPUT_GOAL = 0.05, 1.3, 0.95
STEADY_UPDATES = 30  # the steady rate: this many updates of the small model, timed, before and after a write
TRAINING_THREADS = 1


def _trainer_beside():
    """A small model and its optimizer, and one update of it (the training that shares the cores)."""
    from pilotrun.config import OptimConfig
    from pilotrun.model.presets import model_preset
    from pilotrun.model.transformer import build_model
    from pilotrun.optim.muon_adamw import build_optimizer

    torch.manual_seed(1)
    config = model_preset("tiny", vocab_size=512)
    model = build_model(config)
    optimizer = build_optimizer(model, OptimConfig())
    tokens = torch.randint(0, config.vocab_size, (8, 64))

    def update() -> None:
        model(tokens, tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        update()
    return update


def _throughput_beside_write(checkpointer, step: int, state, update) -> tuple[float, float, int, float]:
    """(steady updates/s, updates/s while a background write runs, updates during the write, training time
    the save cost: what the loop waited for plus the updates the write's share of the CPU held back)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(TRAINING_THREADS)
    try:
        return _rates(checkpointer, step, state, update)
    finally:
        torch.set_num_threads(previous)


def _rates(checkpointer, step: int, state, update) -> tuple[float, float, int, float]:
    from pilotrun.training.checkpoint.background import finish_background_save, start_background_save

    def steady_rate() -> float:
        started = time.perf_counter()
        for _ in range(STEADY_UPDATES):
            update()
        return STEADY_UPDATES / (time.perf_counter() - started)

    before = steady_rate()
    pending = start_background_save(checkpointer, step, state, {"bench": True})
    started, count = time.perf_counter(), 0
    while not pending.done():
        update()
        count += 1
    elapsed = time.perf_counter() - started
    beside = count / elapsed if count else 0.0
    committing = time.perf_counter()
    finish_background_save(checkpointer, pending)
    blocked = pending.staged_seconds + time.perf_counter() - committing
    checkpointer.wait_for_prune()
    # The steady rate on both sides of the write: the shared machine's load drifts within a round.
    steady = (before + steady_rate()) / 2
    return steady, beside, count, blocked + max(0.0, elapsed - count / steady)


def _dcp_state(objects, state):
    from pilotrun.training.checkpoint.dcp_storage import model_and_optimizer_state

    model, optimizer, _scaler = objects
    model_state, optimizer_state = model_and_optimizer_state(model, optimizer)
    return {**state, "model": model_state, "optimizer": optimizer_state}


def _plain(state, path: Path) -> float:
    started = time.perf_counter()
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return time.perf_counter() - started


def _background(checkpointer, step: int, state) -> tuple[float, float]:
    from pilotrun.training.checkpoint.background import finish_background_save, start_background_save

    pending = start_background_save(checkpointer, step, state, {"bench": True})
    pending.future.result()  # the write, beside the loop: not waited for by it
    committing = time.perf_counter()
    finish_background_save(checkpointer, pending)
    finished = time.perf_counter()
    return pending.staged_seconds + (finished - committing), finished - pending.started


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def _measure(work: Path) -> dict:
    from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer

    objects, state = _build_state()
    dcp_state = _dcp_state(objects, state)
    update = _trainer_beside()
    checkpointer = DistributedCheckpointer(work / "run", keep=2)
    # Warm-up of both paths; the first background save also allocates the host copy its stager keeps.
    checkpointer.save(0, state, {"bench": True})
    _background(checkpointer, 1, dcp_state)
    found: dict = {key: [] for key in ("sync", "blocking", "total", "plain", "steady", "beside", "updates",
                                       "lost")}
    step = 2
    for _ in range(REPEATS):
        started = time.perf_counter()
        folder = checkpointer.save(step, state, {"bench": True})
        found["sync"].append(time.perf_counter() - started)
        found["sync_bytes"] = _size(folder)
        blocking, total = _background(checkpointer, step + 1, dcp_state)
        found["blocking"].append(blocking)
        found["total"].append(total)
        found["background_bytes"] = _size(checkpointer.root / f"step-{step + 1:08d}")
        found["plain"].append(_plain(state, work / "plain.pt"))
        found["plain_bytes"] = (work / "plain.pt").stat().st_size
        (work / "plain.pt").unlink()
        steady, beside, count, lost = _throughput_beside_write(checkpointer, step + 2, dcp_state, update)
        found["lost"].append(lost)
        found["steady"].append(steady)
        found["beside"].append(beside)
        found["updates"].append(count)
        step += 3
    checkpointer.wait_for_prune()
    return found


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _seconds(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def _report(found: dict, load_before: float, load_after: float) -> list[str]:
    sync, blocking, total, plain = (
        statistics.median(found[key]) for key in ("sync", "blocking", "total", "plain")
    )
    sync_bytes, background_bytes, plain_bytes = found["sync_bytes"], found["background_bytes"], \
        found["plain_bytes"]
    # Ratios of medians of paired repeats: each repeat ran the three one after the other.
    blocking_ratio = blocking / sync
    round_ratios = [t / s for t, s in zip(found["total"], found["sync"])]
    kept = [b / s for b, s in zip(found["beside"], found["steady"])]

    def mbs(count: int, seconds: float) -> str:
        return f"{count / 1e6 / seconds:,.0f}"

    return [
        "## Background checkpoints: what the loop waits for",
        "",
        f"State: `gpu-100m` at vocab 32,768 with Muon+AdamW state after one step, on the CPU: "
        f"{sync_bytes / 1e6:,.1f} MB (torch.save storage), {background_bytes / 1e6:,.1f} MB (DCP, the "
        f"background storage). Median of {REPEATS} alternating repeats on "
        f"{os.environ.get('PILOTRUN_BENCH_DIR') or tempfile.gettempdir()}; {os.cpu_count()} CPU cores, "
        f"{torch.get_num_threads()} torch threads (the default), 1-minute load average {load_before:.1f} "
        f"before and {load_after:.1f} after.",
        "",
        "| save | loop blocked s | whole save s | MB/s of the whole save | vs plain torch.save |",
        "|---|---:|---:|---:|---:|",
        f"| synchronous (`train.checkpoint.mode=sync`) | {sync:.3f} | {sync:.3f} | {mbs(sync_bytes, sync)} | "
        f"{plain / sync:.2f}x |",
        f"| background (`train.checkpoint.mode=background`) | {blocking:.3f} | {total:.3f} | "
        f"{mbs(background_bytes, total)} | {plain / total:.2f}x |",
        f"| plain torch.save + fsync, one file (no hash, no marker) | | {plain:.3f} | "
        f"{mbs(plain_bytes, plain)} | 1.00x |",
        "",
        f"Goals: loop blocked by a background save <= {BLOCKING_GOAL}x a synchronous save: "
        f"**{_met(blocking_ratio <= BLOCKING_GOAL)}** ({blocking_ratio:.3f}x); the background save's whole "
        f"time <= {TOTAL_GOAL}x the synchronous one in every round: "
        f"**{_met(max(round_ratios) <= TOTAL_GOAL)}** (rounds {', '.join(f'{r:.2f}x' for r in round_ratios)})"
        f"; training throughput while a background write runs >= {THROUGHPUT_GOAL:.0%} of steady: "
        f"**{_met(min(kept) >= THROUGHPUT_GOAL)}** (rounds {', '.join(f'{k:.0%}' for k in kept)}: "
        f"{', '.join(f'{b:.2f}' for b in found['beside'])} updates/s beside the write, "
        f"{', '.join(str(n) for n in found['updates'])} updates, against "
        f"{', '.join(f'{s:.2f}' for s in found['steady'])} steady; the `tiny` preset, batch 8 x 64, "
        f"{TRAINING_THREADS} thread). "
        f"Training time a save costs (the wait, plus the updates the write held back: elapsed beside the "
        f"write minus updates done / steady rate): synchronous {_seconds(found['sync'])} s, background "
        f"{_seconds(found['lost'])} s. "
        f"All synchronous (s): {_seconds(found['sync'])}; background blocked (s): "
        f"{_seconds(found['blocking'])}; background whole (s): {_seconds(found['total'])}; plain (s): "
        f"{_seconds(found['plain'])}.",
        "",
        "Command: `python -m benchmarks.run_all bench_background_checkpoint`",
        "",
    ]


def run() -> str:
    work = Path(tempfile.mkdtemp(prefix="bench_background_", dir=os.environ.get("PILOTRUN_BENCH_DIR")))
    load_before = os.getloadavg()[0]
    try:
        found = _measure(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return "\n".join(_report(found, load_before, os.getloadavg()[0]))


if __name__ == "__main__":
    print(run())
