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

Goals: background blocking <= 0.2x the synchronous save; background total <= 1.3x the synchronous save.
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
BLOCKING_GOAL, TOTAL_GOAL = 0.2, 1.3


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


def run() -> str:
    from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer

    objects, state = _build_state()
    dcp_state = _dcp_state(objects, state)
    work = Path(tempfile.mkdtemp(prefix="bench_background_", dir=os.environ.get("PILOTRUN_BENCH_DIR")))
    load_before = os.getloadavg()[0]
    try:
        checkpointer = DistributedCheckpointer(work / "run", keep=2)
        # Warm-up of both paths; the first background save also allocates the host copy its stager keeps.
        checkpointer.save(0, state, {"bench": True})
        _background(checkpointer, 1, dcp_state)
        sync_s, blocking_s, total_s, plain_s = [], [], [], []
        step = 2
        for _ in range(REPEATS):
            started = time.perf_counter()
            folder = checkpointer.save(step, state, {"bench": True})
            sync_s.append(time.perf_counter() - started)
            sync_bytes = _size(folder)
            blocking, total = _background(checkpointer, step + 1, dcp_state)
            blocking_s.append(blocking)
            total_s.append(total)
            background_bytes = _size(checkpointer.root / f"step-{step + 1:08d}")
            plain_s.append(_plain(state, work / "plain.pt"))
            plain_bytes = (work / "plain.pt").stat().st_size
            (work / "plain.pt").unlink()
            step += 2
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()[0]
    sync, blocking, total, plain = (statistics.median(v) for v in (sync_s, blocking_s, total_s, plain_s))
    # Ratios of medians of paired repeats: each repeat ran the three one after the other.
    blocking_ratio, total_ratio = blocking / sync, total / sync
    mb = sync_bytes / 1e6

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    def mbs(count: int, seconds: float) -> str:
        return f"{count / 1e6 / seconds:,.0f}"

    return "\n".join(
        [
            "## Background checkpoints: what the loop waits for",
            "",
            f"State: `gpu-100m` at vocab 32,768 with Muon+AdamW state after one step, on the CPU: {mb:,.1f} "
            "MB "
            f"(torch.save storage), {background_bytes / 1e6:,.1f} MB (DCP, the background storage). Median "
            "of "
            f"{REPEATS} alternating repeats on "
            f"{os.environ.get('PILOTRUN_BENCH_DIR') or tempfile.gettempdir()}; "
            f"{os.cpu_count()} CPU cores, 1-minute load average {load_before:.1f} before and "
            f"{load_after:.1f} after. "
            "Nothing trains beside the background write here (on a CPU-only run it would share the cores).",
            "",
            "| save | loop blocked s | whole save s | MB/s of the whole save | vs plain torch.save |",
            "|---|---:|---:|---:|---:|",
            f"| synchronous (`train.checkpoint.mode=sync`) | {sync:.3f} | {sync:.3f} | "
            f"{mbs(sync_bytes, sync)} | "
            f"{plain / sync:.2f}x |",
            f"| background (`train.checkpoint.mode=background`) | {blocking:.3f} | {total:.3f} | "
            f"{mbs(background_bytes, total)} | {plain / total:.2f}x |",
            f"| plain torch.save + fsync, one file (no hash, no marker) | | {plain:.3f} | "
            f"{mbs(plain_bytes, plain)} | "
            "1.00x |",
            "",
            f"Goals: loop blocked by a background save <= {BLOCKING_GOAL}x a synchronous save: "
            f"**{met(blocking_ratio <= BLOCKING_GOAL)}** "
            f"({blocking_ratio:.3f}x); the background save's whole time <= {TOTAL_GOAL}x the synchronous "
            "one: "
            f"**{met(total_ratio <= TOTAL_GOAL)}** ({total_ratio:.2f}x). Throughput against plain torch.save "
            "(how close "
            f"the hashing and fsyncs come to the write itself): synchronous {plain / sync:.2f}x, background "
            f"{plain / total:.2f}x. All synchronous (s): {', '.join(f'{v:.3f}' for v in sync_s)}; background "
            "blocked "
            f"(s): {', '.join(f'{v:.3f}' for v in blocking_s)}; background whole (s): "
            f"{', '.join(f'{v:.3f}' for v in total_s)}; plain (s): {', '.join(f'{v:.3f}' for v in plain_s)}.",
            "",
            "Command: `python -m benchmarks.run_all bench_background_checkpoint`",
            "",
        ]
    )


if __name__ == "__main__":
    print(run())
