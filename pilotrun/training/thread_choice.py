"""`train.num_threads: 0`: the intra-op thread count chosen from what this process can actually use.

One thread per core is right on a machine of the run's own, and badly wrong on a shared one: spinning OpenMP
threads that lose their time slices to another job stall every matmul (on a busy machine two threads can run
an update many times slower than one; BENCHMARKS.md, "Intra-op threads"). So, for one process on a CPU, the
candidates are 1, the cores free at start (the idle share of this process's CPUs over a short sample of
/proc/stat) and every physical core of its affinity, and each is timed on a few updates of the recipe's own
model and optimizer (a throwaway copy, random tokens), capped in seconds (`MEASURE_SECONDS`), as
benchmarks/bench_threads.py does offline. The fastest wins; a near tie goes to fewer threads, which leaves the
machine's other work its cores.

The choice is made once per run: a resume with `train.num_threads: 0` keeps the thread count its run recorded
(run.json, sessions[].hardware.threads), so that a run is not timed one way and then another. A thread count
set in the recipe (or by `--set`) is used as given and nothing is measured; under several ranks or on CUDA the
default of training/environment.py (the cores divided among the machine's ranks) is used, not measured (ranks
would time each other). The thread count changes only how work is split among threads, never a result
(tests/training/test_resume_threads.py), and the timing leaves the run's generators as it found them.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pilotrun.training.environment import default_threads

MEASURE_SECONDS = 3.0  # the whole comparison's budget, after one untimed warm-up update
UPDATES_PER_CANDIDATE = 3  # timed updates per candidate at most (after one untimed)
NEAR_TIE = 1.1  # a candidate within this factor of the fastest that uses fewer threads is preferred
SAMPLE_SECONDS = 0.1  # how long the CPUs' idle time is sampled at start


@dataclass
class ThreadChoice:
    threads: int
    # set (the recipe), recorded (the run's own, on resume), measured, or default (not measured: why)
    how: str
    why: str = ""
    cores: int | None = None  # physical cores of the affinity, divided among the machine's ranks
    free_cpus: float | None = None  # idle CPUs of the affinity at start
    # measured: candidate -> median seconds
    seconds_per_update: dict[int, float] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """What run.json's session hardware records under `threads`."""
        return {"threads": self.threads, "how": self.how, "why": self.why, "cores": self.cores,
                "free_cpus": self.free_cpus,
                "seconds_per_update": {str(k): v for k, v in sorted(self.seconds_per_update.items())}}

    def describe(self) -> str:
        """The plan's line: how many threads and where the number comes from."""
        if self.how == "measured":
            timed = ", ".join(f"{k}: {v:.3g} s" for k, v in sorted(self.seconds_per_update.items()))
            return (
                f"threads: {self.threads}, measured on the recipe's update (seconds per update by threads: "
                f"{timed}; {self.cores} core(s) in this process's affinity, {self.free_cpus:.1f} CPU(s) free "
                "at start); --set train.num_threads=N fixes it"
            )
        return f"threads: {self.threads} ({self.why})"


def free_cpus(
    cpus: list[int],
    sample_seconds: float = SAMPLE_SECONDS,
    read_stat: Callable[[], str] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> float | None:
    """Idle CPUs among `cpus` over a short sample of /proc/stat (idle and iowait time); None off Linux."""
    def idle_and_total() -> dict[int, tuple[int, int]]:
        text = read_stat() if read_stat is not None else open("/proc/stat").read()
        found = {}
        for line in text.splitlines():
            name, *values = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                numbers = [int(v) for v in values[:8]]
                found[int(name[3:])] = (numbers[3] + numbers[4], sum(numbers))
        return found

    try:
        before = idle_and_total()
        sleep(sample_seconds)
        after = idle_and_total()
    except (OSError, ValueError, IndexError):
        return None
    shares = [(after[c][0] - before[c][0]) / (after[c][1] - before[c][1])
              for c in after if c in before and after[c][1] > before[c][1]]
    return sum(shares) if shares else None


def candidates(cores: int, free: float | None) -> list[int]:
    """1, the free cores (rounded, at least 1) and every core, each at most `cores`, without repeats."""
    free_cores = cores if free is None else max(1, min(cores, int(free + 0.5)))
    return sorted({1, free_cores, cores})


def measure(config: Any, threads: list[int], budget_seconds: float = MEASURE_SECONDS,
            clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """Median seconds per update of the recipe's model and optimizer (a throwaway copy on the CPU, random
    tokens) at each thread count; {} when one update alone would take the budget's share of a candidate."""
    with torch.random.fork_rng(devices=[]):  # the run's generators are left where they are
        return _measure(config, threads, budget_seconds, clock)


def _measure(
    config: Any, threads: list[int], budget_seconds: float, clock: Callable[[], float]
) -> dict[int, float]:
    from pilotrun.model.transformer import build_model
    from pilotrun.optim.muon_adamw import build_optimizer
    from pilotrun.training.precision import autocast_context

    t = config.train
    model = build_model(config.model)
    optimizer = build_optimizer(model, config.optim)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=generator)

    def update() -> float:
        started = clock()
        optimizer.zero_grad(set_to_none=True)
        for _ in range(t.gradient_accumulation_steps):
            with autocast_context(t.precision, "cpu"):
                output = model(tokens[:, :-1], tokens[:, 1:])
            (output.loss / t.gradient_accumulation_steps).backward()
        optimizer.step()
        return clock() - started

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        update()  # untimed warm-up on one thread: first calls, kernels loading
        share = budget_seconds / len(threads)
        if update() > share / 2:  # too slow to compare within the budget
            return {}
        timed: dict[int, float] = {}
        deadline = clock() + budget_seconds
        for count in threads:
            if clock() > deadline:
                break  # the budget is spent: the counts timed so far decide
            torch.set_num_threads(count)
            first = update()  # the pool resized: its first update is not the steady one
            if first > share:  # clearly slower than the budget allows: no more of it spent here
                timed[count] = first
                continue
            seconds = [update()]
            while len(seconds) < UPDATES_PER_CANDIDATE and sum(seconds) < share / 2:
                seconds.append(update())
            timed[count] = statistics.median(seconds)
        return timed
    finally:
        torch.set_num_threads(previous)


def choose_threads(config: Any, *, local_ranks: int, world_size: int, device_type: str,
                   recorded: int | None = None, measure_fn: Callable[..., dict[int, float]] = measure,
                   free_fn: Callable[[list[int]], float | None] | None = None) -> ThreadChoice:
    """The session's thread count (module docstring). `recorded`: the count the run's earlier sessions
    chose."""
    if config.train.num_threads > 0:
        return ThreadChoice(config.train.num_threads, "set", "train.num_threads in the recipe")
    cores = default_threads(local_ranks)
    if recorded is not None:
        return ThreadChoice(recorded, "recorded", "the count this run chose at its start (run.json), kept on "
                            "resume; --set train.num_threads=N changes it", cores)
    if world_size > 1 or device_type != "cpu":
        why = "several ranks" if world_size > 1 else f"device {device_type}"
        return ThreadChoice(
            cores,
            "default",
            f"one per physical core, divided among this machine's ranks; not measured ({why})",
            cores,
        )
    cpus = (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )
    free = (free_fn or free_cpus)(cpus)
    options = candidates(cores, free)
    if len(options) == 1:
        return ThreadChoice(
            options[0],
            "default",
            f"the only candidate: {cores} core(s) in this process's affinity",
            cores,
            free,
        )
    try:
        timed = measure_fn(config, options)
    # the copy could not run here (a precision the CPU lacks): the cores free
    except (RuntimeError, ValueError):
        timed = {}
    if not timed:
        fallback = cores if free is None else max(1, min(cores, int(free + 0.5)))
        return ThreadChoice(fallback, "default", "one update is too slow to compare counts within "
                            f"{MEASURE_SECONDS:g} s: the cores free at start", cores, free)
    fastest = min(timed.values())
    threads = min(count for count, seconds in timed.items() if seconds <= fastest * NEAR_TIE)
    return ThreadChoice(threads, "measured", "", cores, free, timed)


def recorded_threads(run: dict[str, Any]) -> int | None:
    """The thread count a run chose at its start (the first session that chose one, not set it)."""
    for session in run.get("sessions") or []:
        threads = ((session.get("hardware") or {}).get("threads") or {}) if isinstance(session, dict) else {}
        if threads.get("how") in ("measured", "default") and isinstance(threads.get("threads"), int):
            return int(threads["threads"])
    return None
