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
its updates per second while a background write of the big state runs are compared with its steady rate. The
machine's other load drifts (steady rates 10-54 updates/s within minutes on the shared 2-core machine), so the
comparison is made in pairs of short windows: the benchmark holds the write between 4 MB pieces (_WriteGate, a
wrapper of the writer's stream) for WINDOW_SECONDS, then lets it run as long, alternately until it is done,
and the goal reads the median of the pairs' ratios. Where the loop's time per update went (CPU, waiting on the
run queue, blocked on the GIL) is read from the kernel's per-thread schedstat: it tells the writer's share of
the CPU (run-queue wait) from the GIL (blocked) and from memory bandwidth (CPU time).
It trains with one intra-op thread (TRAINING_THREADS): what `train.num_threads: 0` chooses on a loaded 2-core
machine, where torch's default of two threads makes every update 10-50x slower and its rate noise
(bench_threads). The training time a save costs is its wait plus the updates the write held back (the time
beside the write less the updates done at the steady rate): where the background save's is not below the
synchronous save's, `auto` keeps `sync` on a CPU.

Goals (at the default thread count): background blocking <= 0.05x the synchronous save; the background save's
whole time <= 1.3x the synchronous one in every round (not the median); training throughput while a background
write runs >= 95% of steady (the median of the pairs' ratios).
`python -m benchmarks.run_all bench_background_checkpoint`; the writer's nice values side by side (paired
throughput, whole save alone): `python -m benchmarks.bench_background_checkpoint --niceness 10,19`; DCP's own
file writer against dcp_file_writer.py (whole save, user and system CPU): `... --writers`
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.bench_checkpoint import _build_state
from pilotrun.common.thread_priority import BACKGROUND_NICENESS

REPEATS = 3  # rounds of the plain save and of the throughput beside a write
PAIRS = 8  # synchronous and background saves timed adjacently, the order swapped every pair
VOCAB = 32768  # _build_state's vocabulary
BLOCKING_GOAL, TOTAL_GOAL, THROUGHPUT_GOAL = 0.05, 1.3, 0.95
WINDOW_SECONDS = 0.5  # the write paused this long, then running this long, alternately, until done
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


def _loop_thread_times() -> tuple[float, float, float] | None:
    """(wall, CPU, run-queue wait) seconds so far of the calling thread, from the kernel's schedstat: what
    the loop's time beside a write went to (Linux only; None elsewhere)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as handle:
            cpu, waited, _slices = handle.read().split()
    except OSError:
        return None
    return time.perf_counter(), int(cpu) / 1e9, int(waited) / 1e9


def _per_update(before, after, count: int) -> tuple[float, float, float] | None:
    """Milliseconds per update: CPU, waiting on the run queue (another thread or process had the core), and
    blocked (the rest of the wall time: the loop does no I/O, so waits for the GIL)."""
    if before is None or after is None or not count:
        return None
    wall, cpu, waited = (b - a for a, b in zip(before, after))
    return cpu / count * 1e3, waited / count * 1e3, (wall - cpu - waited) / count * 1e3


class _WriteGate:
    """Holds the background write between pieces of what it writes, so that windows with the write paused
    (steady) and running (beside) alternate within one write: pairs close in time, which the shared
    machine's drifting load reaches alike. Benchmark only: it wraps the writer's stream (the save's code is
    unchanged)."""

    PIECE = 4 << 20  # bytes hashed and written between two looks at the gate

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.inside = 0  # writer threads between two looks (hashing or writing a piece)
        self.lock = threading.Lock()

    def wrapping(self, write):
        def gated(stream, data) -> int:
            view, written = memoryview(data).cast("B"), 0
            for start in range(0, len(view), self.PIECE):
                self._enter()
                try:
                    written += write(stream, view[start:start + self.PIECE])
                finally:
                    with self.lock:
                        self.inside -= 1
            return written

        return gated

    def _enter(self) -> None:
        while True:
            self.open.wait()
            with self.lock:  # the gate is looked at and the piece counted at once: close() sees every one
                if self.open.is_set():
                    self.inside += 1
                    return

    def close(self, update) -> None:
        """Pause the write: train on until no writer thread is inside a piece."""
        with self.lock:
            self.open.clear()
        while self.inside:
            update()


def _throughput_beside_write(checkpointer, step: int, state, update) -> dict:
    """One round: one background write, paused and resumed every WINDOW_SECONDS while the small model trains;
    per pair of windows (paused, running) the updates per second and where the loop's time went."""
    from pilotrun.training.checkpoint import background

    previous, stream_write = torch.get_num_threads(), background._HashingStream.write
    gate = _WriteGate()
    torch.set_num_threads(TRAINING_THREADS)
    background._HashingStream.write = gate.wrapping(stream_write)
    try:
        return _pairs(checkpointer, step, state, update, gate)
    finally:
        background._HashingStream.write = stream_write
        gate.open.set()
        torch.set_num_threads(previous)


def _window(update, until) -> tuple[float, int, tuple[float, float, float] | None]:
    times, started, count = _loop_thread_times(), time.perf_counter(), 0
    while time.perf_counter() - started < WINDOW_SECONDS and not until():
        update()
        count += 1
    elapsed = time.perf_counter() - started
    return elapsed, count, _per_update(times, _loop_thread_times(), count)


def _paired_windows(update, gate: _WriteGate, done) -> tuple[list, float, float]:
    """Windows of WINDOW_SECONDS, the write paused then running, until `done()`: the pairs (steady rate, rate
    beside, and the loop's time per update in each), the seconds the write ran, and the updates it held back
    (in seconds at the paused window's rate)."""
    pairs, lost, running = [], 0.0, 0.0
    while not done():
        gate.close(update)
        paused = _window(update, lambda: False)
        gate.open.set()
        beside = _window(update, done)
        running += beside[0]
        if paused[1] and beside[1] and beside[0] >= WINDOW_SECONDS / 2:  # not the write's short tail
            steady = paused[1] / paused[0]
            pairs.append((steady, beside[1] / beside[0], paused[2], beside[2]))
            lost += max(0.0, beside[0] - beside[1] / steady)
    return pairs, running, lost


def _pairs(checkpointer, step: int, state, update, gate: _WriteGate) -> dict:
    from pilotrun.training.checkpoint.background import finish_background_save, start_background_save

    pending = start_background_save(checkpointer, step, state, {"bench": True})
    pairs, running, lost = _paired_windows(update, gate, pending.done)
    committing = time.perf_counter()
    finish_background_save(checkpointer, pending)
    blocked = pending.staged_seconds + time.perf_counter() - committing
    checkpointer.wait_for_prune()
    return {"pairs": pairs, "write": running, "lost": blocked + lost}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


def _control_pairs(state, path: Path, update) -> list:
    """The control: the same bytes hashed and written by one thread at the writer's nice value, in 4 MB
    pieces that release the GIL (no per-tensor serialization, no planning), then fsynced; paired the same
    way. What the loop keeps beside it is what writing the bytes costs; the rest of the gap is the writer's
    Python work and thread count."""
    from pilotrun.common.thread_priority import yield_to_training

    gate, finished = _WriteGate(), threading.Event()
    pieces = [t.detach().contiguous().reshape(-1).view(torch.uint8).numpy() for t in _tensors(state)]

    def write_all() -> None:
        yield_to_training()
        digest = hashlib.sha256()

        def write(handle, piece) -> int:
            digest.update(piece)
            return handle.write(piece)

        gated = gate.wrapping(write)
        try:
            with open(path, "wb") as handle:
                for piece in pieces:
                    gated(handle, memoryview(piece))
                handle.flush()
                os.fsync(handle.fileno())
        finally:
            finished.set()

    previous = torch.get_num_threads()
    torch.set_num_threads(TRAINING_THREADS)
    writer = threading.Thread(target=write_all, name="bench-control-writer")
    writer.start()
    try:
        return _paired_windows(update, gate, finished.is_set)[0]
    finally:
        gate.open.set()
        writer.join()
        path.unlink(missing_ok=True)
        torch.set_num_threads(previous)


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


def _cpu_seconds() -> float:
    """User + system CPU seconds of the whole process so far, every thread's (those that ended too)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _background(checkpointer, step: int, state, stable=(), beside=None) -> dict:
    """One background save as the checkpoint callback makes it: the call (the copy of all but `stable`),
    then, with `beside`, the next update's forward and backward while the staging thread copies the stable
    tensors, and the wait for that copy where the optimizer step would be (`wait_staged`: what the callback's
    step pre-hook does); then the write, not waited for by the loop; then the commit. Blocking = the call +
    that wait + the commit."""
    from pilotrun.training.checkpoint.background import finish_background_save, start_background_save

    cpu = _cpu_seconds()
    pending = start_background_save(checkpointer, step, state, {"bench": True}, stable=stable)
    beside_seconds = None
    if beside is not None:
        started = time.perf_counter()
        beside()
        beside_seconds = time.perf_counter() - started
    held = pending.wait_staged()
    pending.future.result()  # the write, beside the loop: not waited for by it
    committing = time.perf_counter()
    path = finish_background_save(checkpointer, pending)
    finished = time.perf_counter()
    return {"blocking": pending.staged_seconds + held + (finished - committing), "held": held,
            "called": pending.staged_seconds, "commit": finished - committing,
            "total": finished - pending.started, "beside": beside_seconds, "cpu": _cpu_seconds() - cpu,
            "bytes": _size(path)}


def _forward_backward(model):
    """The next update's forward and backward of the saved model (the batch _build_state stepped on: 1 x 16
    tokens): what the staging copy runs beside."""
    tokens = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))

    def run() -> None:
        model(tokens, tokens).loss.backward()
        model.zero_grad(set_to_none=True)

    return run


def _sync(checkpointer, step: int, state) -> dict:
    started, cpu = time.perf_counter(), _cpu_seconds()
    folder = checkpointer.save(step, state, {"bench": True})
    return {"total": time.perf_counter() - started, "cpu": _cpu_seconds() - cpu, "bytes": _size(folder)}


class _FsyncClock:
    """Seconds spent inside os.fsync by any thread of the process while it is entered (summed over threads):
    what of a save's wall time was the disk making its writes durable. Benchmark only: it wraps os.fsync,
    which both storages call (the save's code is unchanged)."""

    def __init__(self) -> None:
        self.seconds, self.lock, self.real = 0.0, threading.Lock(), os.fsync

    def __enter__(self) -> _FsyncClock:
        os.fsync = self._timed
        return self

    def __exit__(self, *_exc) -> None:
        os.fsync = self.real

    def _timed(self, fd) -> None:
        started = time.perf_counter()
        try:
            self.real(fd)
        finally:
            with self.lock:
                self.seconds += time.perf_counter() - started


def _save_pairs(checkpointer, step: int, states, stable, pairs: int) -> tuple[list[dict], int]:
    """`pairs` synchronous and background saves timed adjacently, the order swapped every pair (sync first,
    then background first), each pair with the 1-minute load before it. Nothing runs beside either save: the
    background one's loop waits for the staging copy at once, as a loop that stepped right away would."""
    state, dcp_state = states
    found = []
    for index in range(pairs):
        order = ("sync", "background") if index % 2 == 0 else ("background", "sync")
        pair: dict = {"load": os.getloadavg()[0], "order": order}
        for kind in order:
            checkpointer.wait_for_prune()  # the previous commit's prune: not part of this save
            with _FsyncClock() as fsyncs:
                pair[kind] = _sync(checkpointer, step, state) if kind == "sync" else \
                    _background(checkpointer, step, dcp_state, stable)
            pair[kind]["fsync"] = fsyncs.seconds
            step += 1
        found.append(pair)
    return found, step


def _overlapped(checkpointer, step: int, dcp_state, stable, beside) -> dict:
    """A background save with the next update's forward and backward beside its staging copy, then that
    forward and backward alone: what the loop waits for when it has an update to compute."""
    checkpointer.wait_for_prune()
    found = _background(checkpointer, step, dcp_state, stable, beside)
    started = time.perf_counter()
    beside()
    return {**found, "alone": time.perf_counter() - started, "load": os.getloadavg()[0]}


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def _measure(work: Path, rounds: int = REPEATS, pairs: int = PAIRS) -> dict:
    from pilotrun.training.checkpoint.background import stable_storages
    from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer

    objects, state = _build_state()
    dcp_state = _dcp_state(objects, state)
    stable, beside = stable_storages(objects[0], objects[1]), _forward_backward(objects[0])
    update = _trainer_beside()
    checkpointer = DistributedCheckpointer(work / "run", keep=2)
    # Warm-up of both paths; the first background save also allocates the host copy its stager keeps.
    checkpointer.save(0, state, {"bench": True})
    _background(checkpointer, 1, dcp_state, stable)
    found: dict = {key: [] for key in ("plain", "lost", "write", "pairs", "control", "overlapped")}
    found["stable_bytes"] = sum(t.numel() * t.element_size() for t in _tensors(dcp_state)
                                if t.numel() and t.untyped_storage().data_ptr() in stable)
    found["saves"], step = _save_pairs(checkpointer, 2, (state, dcp_state), stable, pairs)
    found["sync_bytes"] = found["saves"][-1]["sync"]["bytes"]
    found["background_bytes"] = found["saves"][-1]["background"]["bytes"]
    for _ in range(rounds):
        found["overlapped"].append(_overlapped(checkpointer, step, dcp_state, stable, beside))
        step += 1
        checkpointer.wait_for_prune()
        found["plain"].append(_plain(state, work / "plain.pt"))
        found["plain_bytes"] = (work / "plain.pt").stat().st_size
        (work / "plain.pt").unlink()
        rates = _throughput_beside_write(checkpointer, step, dcp_state, update)
        for key in ("lost", "write", "pairs"):
            found[key].append(rates[key])
        found["control"].append(_control_pairs(dcp_state, work / "control.bin", update))
        step += 1
    checkpointer.wait_for_prune()
    return found


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _seconds(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def _split_text(splits: list) -> str:
    """The loop's time per update, median over the rounds: CPU, run-queue wait, blocked (ms)."""
    found = [split for split in splits if split is not None]
    if not found:
        return "not measured (no per-thread schedstat here)"
    cpu, waited, blocked = (statistics.median(split[i] for split in found) for i in range(3))
    return f"CPU {cpu:.1f}, run-queue wait {waited:.1f}, blocked {blocked:.1f}"


def _throughput_goal(found: dict) -> str:
    """The throughput goal, judged on the median of the ratios of every pair of windows (the write paused,
    then running), with where the loop's time went and what the save cost the training against a
    synchronous save."""
    pairs = [pair for round_pairs in found["pairs"] for pair in round_pairs]
    kept = [beside / steady for steady, beside, _, _ in pairs]
    per_round = [statistics.median(b / s for s, b, _, _ in round_pairs) if round_pairs else float("nan")
                 for round_pairs in found["pairs"]]
    median = statistics.median(kept) if kept else float("nan")
    sync = statistics.median(pair["sync"]["total"] for pair in found["saves"])
    cheaper = sum(lost < sync for lost in found["lost"])
    return (
        f"training throughput while a background write runs >= {THROUGHPUT_GOAL:.0%} of steady, the median "
        f"of the ratios of {len(pairs)} pairs of {WINDOW_SECONDS:g}-second windows (the write paused, then "
        f"running, alternately, within one write per round): **{_met(median >= THROUGHPUT_GOAL)}** "
        f"({median:.1%}; per round {', '.join(f'{r:.1%}' for r in per_round)}; quartiles of the pairs "
        f"{_quartiles(kept)}; steady {min(s for s, *_ in pairs):.1f}-{max(s for s, *_ in pairs):.1f} "
        f"updates/s; "
        f"the write ran {_seconds(found['write'])} s beside the training; the `tiny` preset, batch 8 x 64, "
        f"{TRAINING_THREADS} thread; the writer threads at nice +{BACKGROUND_NICENESS}). The loop's time per "
        f"update, ms, the write paused: {_split_text([pair[2] for pair in pairs])}; running: "
        f"{_split_text([pair[3] for pair in pairs])} (blocked: the wall time neither on a core nor waiting "
        f"for one, i.e. waiting for the GIL). "
        f"{_control_text(found['control'])} "
        f"Training time a save costs (the wait, plus the updates the write held back: per running window, "
        f"its time minus its updates / the paused window's rate): synchronous {sync:.3f} s (its whole time, "
        f"the median of the pairs above), background {_seconds(found['lost'])} s, the background one cheaper "
        f"in {cheaper} of {len(found['lost'])} rounds."
    )


def _control_text(rounds: list) -> str:
    pairs = [pair for round_pairs in rounds for pair in round_pairs]
    if not pairs:
        return "The control (the same bytes, hashed and written in 4 MB pieces by one thread): no pair."
    kept = [beside / steady for steady, beside, _, _ in pairs]
    return (
        f"The control, the same bytes hashed and written in 4 MB pieces that release the GIL by one thread "
        f"at the same nice value (no per-tensor serialization, no planning), paired the same way: the loop "
        f"keeps {statistics.median(kept):.1%} (median of {len(pairs)} pairs, quartiles {_quartiles(kept)}); "
        f"its time per update, ms, paused: {_split_text([pair[2] for pair in pairs])}; running: "
        f"{_split_text([pair[3] for pair in pairs])}."
    )


def _quartiles(values: list[float]) -> str:
    if len(values) < 2:
        return "n/a"
    low, _, high = statistics.quantiles(values, n=4)
    return f"{low:.0%}-{high:.0%}"


def _blocking_goal(found: dict) -> str:
    saves, overlapped = found["saves"], found["overlapped"]
    sync = statistics.median(pair["sync"]["total"] for pair in saves)
    ratios = [save["blocking"] / sync for save in overlapped]
    at_once = statistics.median(pair["background"]["blocking"] / pair["sync"]["total"] for pair in saves)

    def med(key: str) -> float:
        return statistics.median(save[key] for save in overlapped)

    loads = ", ".join(f"{save['load']:.1f}" for save in overlapped)
    return (
        f"loop blocked by a background save <= {BLOCKING_GOAL}x a synchronous save, the median of "
        f"{len(overlapped)} saves each followed by the next update's forward and backward, against the "
        f"median synchronous save of the pairs below: **{_met(statistics.median(ratios) <= BLOCKING_GOAL)}** "
        f"({statistics.median(ratios):.3f}x; each {', '.join(f'{r:.3f}x' for r in ratios)}). Where it goes "
        f"(medians, s): the call {med('called'):.3f} (everything but the parameters and the optimizer's "
        f"state), the wait for the staging thread's copy of those ({found['stable_bytes'] / 1e6:,.1f} MB) "
        f"where the next optimizer step would start {med('held'):.3f}, the commit {med('commit'):.3f}; that "
        f"forward and backward (gpu-100m, 1 x 16 tokens, the default threads) took {med('beside'):.3f} s "
        f"beside the copy and {med('alone'):.3f} s alone right after (load {loads}). A loop that stepped at "
        f"once (nothing to hide the copy behind) would wait {at_once:.3f}x a synchronous save (the pairs' "
        f"background saves)"
    )


def _whole_goal(saves: list[dict]) -> str:
    ratios = [pair["background"]["total"] / pair["sync"]["total"] for pair in saves]
    each = ", ".join(
        f"{ratio:.2f}x (load {pair['load']:.1f}, {pair['order'][0]} first; CPU {pair['sync']['cpu']:.1f} / "
        f"{pair['background']['cpu']:.1f}, fsync {pair['sync']['fsync']:.1f} / "
        f"{pair['background']['fsync']:.1f})"
        for ratio, pair in zip(ratios, saves)
    )
    return (
        f"the background save's whole time <= {TOTAL_GOAL}x the synchronous one in every pair (not the "
        f"median): **{_met(max(ratios) <= TOTAL_GOAL)}** (median {statistics.median(ratios):.2f}x, "
        f"{min(ratios):.2f}x-{max(ratios):.2f}x; per pair, with the 1-minute load before it, which save ran "
        f"first, the process's CPU seconds and the seconds its threads spent in fsync (summed) of the "
        f"synchronous / background save: {each})"
    )


def _report(found: dict, load_before: float, load_after: float) -> list[str]:
    saves = found["saves"]
    sync, total = (statistics.median(pair[kind]["total"] for pair in saves)
                   for kind in ("sync", "background"))
    blocking = statistics.median(save["blocking"] for save in found["overlapped"])
    plain = statistics.median(found["plain"])
    sync_bytes, background_bytes, plain_bytes = found["sync_bytes"], found["background_bytes"], \
        found["plain_bytes"]

    def mbs(count: int, seconds: float) -> str:
        return f"{count / 1e6 / seconds:,.0f}"

    return [
        "## Background checkpoints: what the loop waits for",
        "",
        f"State: `gpu-100m` at vocab 32,768 with Muon+AdamW state after one step, on the CPU: "
        f"{sync_bytes / 1e6:,.1f} MB (torch.save storage), {background_bytes / 1e6:,.1f} MB (DCP, the "
        f"background storage). Medians of {len(saves)} synchronous and background saves timed adjacently, "
        f"the order swapped every pair (the background loop blocked: of {len(found['overlapped'])} saves "
        f"beside the next forward and backward), and of {len(found['plain'])} plain saves, on "
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
        f"Goals: {_blocking_goal(found)}; {_whole_goal(saves)}; "
        f"{_throughput_goal(found)} "
        f"All synchronous (s): {_seconds([pair['sync']['total'] for pair in saves])}; background blocked "
        f"(s): {_seconds([save['blocking'] for save in found['overlapped']])} (beside the next forward and "
        f"backward), {_seconds([pair['background']['blocking'] for pair in saves])} (stepping at once); "
        f"background whole (s): "
        f"{_seconds([pair['background']['total'] for pair in saves])}; plain (s): "
        f"{_seconds(found['plain'])}.",
        "",
        "Command: `python -m benchmarks.run_all bench_background_checkpoint`",
        "",
    ]


def run(rounds: int = REPEATS, pairs: int = PAIRS) -> str:
    work = Path(tempfile.mkdtemp(prefix="bench_background_", dir=os.environ.get("PILOTRUN_BENCH_DIR")))
    load_before = os.getloadavg()[0]
    try:
        found = _measure(work, rounds, pairs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return "\n".join(_report(found, load_before, os.getloadavg()[0]))


def _dcps_own_write_data(writer, plan, planner):
    """The background writer as it was before dcp_file_writer.py: DCP's FileSystemWriter writes the rank's
    files (each tensor torch.saved with the zip CRC32 on, about forty writes each), hashed the same way."""
    import torch.distributed.checkpoint as dcp

    from pilotrun.training.checkpoint import background

    background.yield_to_training()
    return dcp.FileSystemWriter.write_data(writer, plan, planner)


def _process_cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def _writers_text(found: dict[str, list[tuple[float, float, float]]], load: tuple[float, float]) -> str:
    lines = [f"load {load[0]:.1f} before, {load[1]:.1f} after, {os.cpu_count()} cores; per writer, the "
             "medians (and ranges) of its background saves, nothing beside them"]
    for name, rows in found.items():
        whole, user, system = ([row[i] for row in rows] for i in range(3))
        lines.append(
            f"{name}: {len(rows)} saves, whole {statistics.median(whole):.3f} s ({min(whole):.3f}-"
            f"{max(whole):.3f}), user CPU {statistics.median(user):.2f} s ({min(user):.2f}-{max(user):.2f}), "
            f"system CPU {statistics.median(system):.2f} s ({min(system):.2f}-{max(system):.2f})"
        )
    return "\n".join(lines)


def compare_writers(rounds: int = 6) -> str:
    """The whole background save and the process's user and system CPU seconds, with DCP's own file writer and
    with dcp_file_writer.py's, alternately in one process (the order swapped every round): what writing the
    records without the CRC32 and in few writes saves."""
    from pilotrun.training.checkpoint import background
    from pilotrun.training.checkpoint.background import stable_storages
    from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer

    work = Path(tempfile.mkdtemp(prefix="bench_writers_", dir=os.environ.get("PILOTRUN_BENCH_DIR")))
    writers = {"DCP's FileSystemWriter": _dcps_own_write_data,
               "dcp_file_writer.py": background._HashingFileSystemWriter.write_data}
    found: dict[str, list[tuple[float, float, float]]] = {name: [] for name in writers}
    load_before = os.getloadavg()[0]
    try:
        objects, state = _build_state()
        dcp_state, stable = _dcp_state(objects, state), stable_storages(objects[0], objects[1])
        checkpointer = DistributedCheckpointer(work / "run", keep=2)
        _background(checkpointer, 0, dcp_state, stable)  # the host buffers, allocated once
        for index in range(rounds * len(writers)):
            name = list(writers)[(index + index // len(writers)) % len(writers)]
            background._HashingFileSystemWriter.write_data = writers[name]
            checkpointer.wait_for_prune()
            user, system = _process_cpu()
            whole = _background(checkpointer, index + 1, dcp_state, stable)["total"]
            found[name].append((whole, _process_cpu()[0] - user, _process_cpu()[1] - system))
    finally:
        background._HashingFileSystemWriter.write_data = writers["dcp_file_writer.py"]
        shutil.rmtree(work, ignore_errors=True)
    return _writers_text(found, (load_before, os.getloadavg()[0]))


def compare_niceness(values: list[int], rounds: int = 2) -> str:
    """The paired throughput and the whole save with nothing beside, for each nice value of the writer
    threads, side by side in one process (the order rotated each round): what the writer's priority does."""
    from pilotrun.common import thread_priority
    from pilotrun.training.checkpoint import background
    from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer

    work = Path(tempfile.mkdtemp(prefix="bench_niceness_", dir=os.environ.get("PILOTRUN_BENCH_DIR")))
    chosen, yielding = {"niceness": values[0]}, background.yield_to_training
    background.yield_to_training = lambda: thread_priority.yield_to_training(chosen["niceness"])
    found: dict[int, dict[str, list]] = {value: {"kept": [], "alone": []} for value in values}
    load_before = os.getloadavg()[0]
    try:
        objects, state = _build_state()
        dcp_state, update = _dcp_state(objects, state), _trainer_beside()
        checkpointer = DistributedCheckpointer(work / "run", keep=2)
        _background(checkpointer, 0, dcp_state)
        step = 1
        for index in range(rounds):
            for value in values[index % len(values):] + values[:index % len(values)]:
                chosen["niceness"] = value
                pairs = _throughput_beside_write(checkpointer, step, dcp_state, update)["pairs"]
                found[value]["kept"] += [beside / steady for steady, beside, _, _ in pairs]
                found[value]["alone"].append(_background(checkpointer, step + 1, dcp_state)["total"])
                checkpointer.wait_for_prune()
                step += 2
    finally:
        background.yield_to_training = yielding
        shutil.rmtree(work, ignore_errors=True)
    lines = [f"load {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, {os.cpu_count()} cores"]
    for value, result in found.items():
        kept = result["kept"]
        lines.append(f"nice +{value}: loop kept {statistics.median(kept) if kept else float('nan'):.1%} "
                     f"(median of {len(kept)} pairs, quartiles {_quartiles(kept)}); whole save with nothing "
                     f"beside {_seconds(result['alone'])} s")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=REPEATS,
                        help="rounds of the plain save and of the training beside a write")
    parser.add_argument("--pairs", type=int, default=PAIRS, help="adjacent synchronous/background save pairs")
    parser.add_argument("--niceness", default=None,
                        help="e.g. 10,19: the writer's nice values side by side instead (paired throughput)")
    parser.add_argument("--writers", action="store_true",
                        help="DCP's own file writer against dcp_file_writer.py, side by side instead")
    options = parser.parse_args()
    if options.writers:
        print(compare_writers())
    elif options.niceness:
        print(compare_niceness([int(v) for v in options.niceness.split(",")]))
    else:
        print(run(options.rounds, options.pairs))
