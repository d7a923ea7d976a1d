"""Checkpoint write throughput against a raw write of the same bytes, and the time to resume.

The state is what the trainer saves for the GPU pilot model (the `gpu-100m` preset at vocab 32,768):
model, the combined Muon+AdamW optimizer after one real step (so its momentum and Adam moments exist), a
GradScaler, trainer counters and every RNG. Side by side, alternating, in one run:

- raw: the same number of bytes written to ONE file on the same disk, then fsync (the disk's own speed);
- checkpoint: `Checkpointer.save` (temp folder, torch.save per part, sha256 of every byte, fsync of every
  file and folder, rename, marker, prune);
- resume: `Checkpointer.load` (sha256 of every file, torch.load) then load_state_dict into a fresh model,
  optimizer and scaler, and the RNG restore: what `--resume` does before the first update.

Target: checkpoint throughput >= 0.7x raw. `python -m benchmarks.run_all bench_checkpoint`
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPEATS = 5
TARGET_RATIO = 0.7


def _build_state(seed: int = 0):
    from pilotrun.config import OptimConfig
    from pilotrun.model.presets import model_preset
    from pilotrun.model.transformer import build_model
    from pilotrun.optim.muon_adamw import build_optimizer
    from pilotrun.training.checkpoint.rng_state import capture_rng_state
    from pilotrun.training.precision import build_grad_scaler

    torch.manual_seed(seed)
    model_cfg = model_preset("gpu-100m", vocab_size=32768)
    model = build_model(model_cfg)
    optimizer = build_optimizer(model, OptimConfig())
    tokens = torch.randint(0, model_cfg.vocab_size, (1, 16))
    model(tokens, tokens).loss.backward()  # one real update, so that every optimizer state buffer exists
    optimizer.step()
    scaler = build_grad_scaler("fp16", "cpu", 65536.0, 2000)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
             "trainer": {"step": 1, "tokens_seen": 16, "updates_attempted": 1, "updates_skipped": 0},
             "rng": capture_rng_state()}
    return (model, optimizer, scaler), state


def _raw_write(path: Path, payload: memoryview) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) to write the payload to one file and fsync it."""
    started, cpu = time.perf_counter(), time.process_time()
    with open(path, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    return time.perf_counter() - started, time.process_time() - cpu


def _resume(objects, root: Path) -> tuple[float, float]:
    """Load the newest checkpoint and restore it into the (already built) model, optimizer and scaler: the
    work `--resume` adds to building them, which a fresh run does too."""
    from pilotrun.training.checkpoint.checkpointer import Checkpointer
    from pilotrun.training.checkpoint.rng_state import restore_rng_state

    model, optimizer, scaler = objects
    started = time.perf_counter()
    state, _meta = Checkpointer(root, keep=REPEATS + 2).load()
    loaded = time.perf_counter()
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    restore_rng_state(state["rng"])
    finished = time.perf_counter()
    return loaded - started, finished - started


def run() -> str:
    from pilotrun.training.checkpoint.checkpointer import Checkpointer

    objects, state = _build_state()
    work = Path(tempfile.mkdtemp(prefix="bench_checkpoint_", dir=os.environ.get("PILOTRUN_BENCH_DIR")))
    try:
        # keep: no pruning inside the timed saves, as the raw file's deletion is outside its timing.
        checkpointer = Checkpointer(work / "run", keep=REPEATS + 2)
        folder = checkpointer.save(0, state, {"bench": True})  # warm-up, and the byte count to match
        checkpoint_bytes = sum(f.stat().st_size for f in folder.iterdir() if f.name.endswith(".pt"))
        payload = memoryview(os.urandom(1024) * (checkpoint_bytes // 1024 + 1))[:checkpoint_bytes]
        raw_seconds, save_seconds, raw_cpu, save_cpu = [], [], [], []
        load_before = os.getloadavg()[0]
        for repeat in range(REPEATS):
            wall, cpu = _raw_write(work / "raw.bin", payload)
            raw_seconds.append(wall)
            raw_cpu.append(cpu)
            (work / "raw.bin").unlink()
            started, cpu_started = time.perf_counter(), time.process_time()
            checkpointer.save(repeat + 1, state, {"bench": True})
            save_seconds.append(time.perf_counter() - started)
            save_cpu.append(time.process_time() - cpu_started)
        # Pruning (done by save once `keep` checkpoints exist) is deletion, not writing: timed apart.
        started = time.perf_counter()
        shutil.rmtree(folder)
        prune_seconds = time.perf_counter() - started
        started = time.perf_counter()
        hashlib.sha256(payload).hexdigest()
        sha256_seconds = time.perf_counter() - started
        load_after = os.getloadavg()[0]
        del payload
        resumes = [_resume(objects, work / "run") for _ in range(REPEATS)]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    raw_s, save_s = statistics.median(raw_seconds), statistics.median(save_seconds)
    load_s = statistics.median(r[0] for r in resumes)
    resume_s = statistics.median(r[1] for r in resumes)
    mb = checkpoint_bytes / 1e6
    ratio = raw_s / save_s
    met = "met" if ratio >= TARGET_RATIO else "NOT met"
    cores = os.cpu_count()
    return "\n".join(
        [
            "## Checkpoint write throughput and time to resume",
            "",
            "State: `gpu-100m` model at vocab 32,768 with Muon+AdamW state after one step, scaler, counters "
            "and RNG: "
            f"{mb:,.1f} MB. Median of {REPEATS} alternating repeats; raw = the same byte count written to "
            "one file "
            "and fsynced, on the same disk "
            f"({os.environ.get('PILOTRUN_BENCH_DIR') or tempfile.gettempdir()}). "
            f"{cores} CPU cores; 1-minute load average {load_before:.1f} before and {load_after:.1f} after "
            "the write "
            "runs (other work on the machine competes for the CPU that sha256 needs, not for the disk).",
            "",
            "| measure | wall s | MB/s | vs raw | CPU s (this process) |",
            "|---|---:|---:|---:|---:|",
            f"| raw write + fsync (one file) | {raw_s:.3f} | {mb / raw_s:,.0f} | 1.00x | "
            f"{statistics.median(raw_cpu):.2f} |",
            f"| `Checkpointer.save` (sha256 + fsync + rename + marker) | {save_s:.3f} | {mb / save_s:,.0f} | "
            f"{ratio:.2f}x | {statistics.median(save_cpu):.2f} |",
            "| pruning one old checkpoint (rmtree; part of a save once `keep` is reached) | "
            f"{prune_seconds:.3f} | | | |",
            f"| sha256 of the same bytes alone, one thread | {sha256_seconds:.3f} | "
            f"{mb / sha256_seconds:,.0f} | | |",
            f"| `Checkpointer.load` (sha256 verify + torch.load) | {load_s:.3f} | {mb / load_s:,.0f} | | |",
            f"| resume: load + restore model, optimizer, scaler, RNG | {resume_s:.3f} | {mb / resume_s:,.0f} "
            "| | |",
            "",
            f"Target: checkpoint write throughput >= {TARGET_RATIO}x raw: **{met}** ({ratio:.2f}x). "
            f"All raw runs (s): {', '.join(f'{s:.3f}' for s in raw_seconds)}; all saves (s): "
            f"{', '.join(f'{s:.3f}' for s in save_seconds)}.",
            "",
            "Command: `python -m benchmarks.run_all bench_checkpoint`",
        ]
    )


if __name__ == "__main__":
    print(run())
