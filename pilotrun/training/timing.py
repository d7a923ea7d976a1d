"""Time accounting: every second of a session belongs to exactly one of train, eval, checkpoint, profile,
report, other.

A single stopwatch always runs and charges elapsed time to the current phase; `phase("eval")` switches to
another phase for a block and back afterwards. Because the phases partition the session, their sums equal the
wall clock exactly. `profile` = the update attempts run under torch.profiler (`train.profile`), opening and
writing the profiler's files included: they are slower than others and are kept out of the training seconds;
`report` = writing events to metrics.jsonl, mirroring them to the metrics sinks, and the in-run reports
(progress bar); `other` = setup and the rest between phases (building a window's figures).

Why a switching stopwatch and not a timer around each update: the training phase is left only at window
boundaries (logging, eval, checkpoint), so the hot loop does no timing work at all; and on CUDA the device is
synchronized only when leaving the training phase, so queued kernels are charged to training instead of to
whatever comes next, without a per-step host sync.

Throughput is then reported twice, side by side: training-only (tokens / train seconds) and wall-clock (tokens
/ all seconds of the window).

Beside the wall clock the same switches read the process's CPU time (all its threads), charged to the same
phases. A window whose training seconds grew while its CPU seconds per token did not was slowed by other work
on the machine, not by the run itself; the verdict's throughput rule tells the two apart with it. Each window
also records what other processes did to the run's threads (`machine_counters`): the process's involuntary
context switches (a thread descheduled for another task) and the CPU seconds the rest of the machine used
meanwhile, so that threads starved by other work are not mistaken for a recipe whose work per token grew
(spinning OpenMP threads burn CPU while they wait for a descheduled sibling, so the work per CPU second falls
on a busy machine too).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pilotrun.run.record import PHASES

DEVICE_PHASES = ("train", "profile")  # the phases that queue device work


class TimeAccount:
    def __init__(
        self,
        synchronize: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.process_time,
    ):
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._synchronize = synchronize  # e.g. torch.cuda.synchronize; None on CPU
        self._started = clock()
        self._segment_start = self._started
        self._cpu_segment_start = cpu_clock()
        self._phase = "other"
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.cpu_totals = dict.fromkeys(PHASES, 0.0)  # process CPU seconds (every thread) per phase
        # Told each phase switched into (the hang watchdog's progress points: an evaluation, a save).
        self.listeners: list[Callable[[str], None]] = []

    def synchronize_with(self, synchronize: Callable[[], None] | None) -> None:
        """Set the device wait that leaving a phase does (known only once the session chose its device)."""
        self._synchronize = synchronize

    @property
    def current_phase(self) -> str:
        return self._phase

    def switch(self, phase: str) -> str:
        """Charge the running segment to the current phase and start a segment of `phase`; returns the old
        one."""
        if phase not in PHASES:
            raise ValueError(f"unknown time phase '{phase}'")
        if self._phase in DEVICE_PHASES and phase != self._phase and self._synchronize is not None:
            self._synchronize()  # queued training (or profiled) kernels belong to the phase that queued them
        now, cpu_now = self._clock(), self._cpu_clock()
        self.totals[self._phase] += now - self._segment_start
        self.cpu_totals[self._phase] += cpu_now - self._cpu_segment_start
        self._segment_start, self._cpu_segment_start = now, cpu_now
        previous, self._phase = self._phase, phase
        for listener in self.listeners:
            listener(phase)
        return previous

    @contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        previous = self.switch(phase)
        try:
            yield
        finally:
            self.switch(previous)

    def snapshot(self) -> dict[str, float]:
        """Totals so far including the running segment, the wall clock since construction, and per phase the
        process CPU seconds under `cpu_<phase>`."""
        now, cpu_now = self._clock(), self._cpu_clock()
        totals = dict(self.totals)
        totals[self._phase] += now - self._segment_start
        totals["wall"] = now - self._started
        for phase in PHASES:
            totals[f"cpu_{phase}"] = self.cpu_totals[phase] + (cpu_now - self._cpu_segment_start
                                                               if phase == self._phase else 0.0)
        return totals

    def time_split(self) -> dict[str, float]:
        """The session_end record: seconds per phase and the wall clock (their sum, up to float rounding)."""
        s = self.snapshot()
        return {**{f"{phase}_seconds": s[phase] for phase in PHASES}, "wall_seconds": s["wall"]}


def machine_counters() -> tuple[int, float | None]:
    """(this process's involuntary context switches so far, the busy CPU seconds of the whole machine so far
    from /proc/stat, steal included: None off Linux)."""
    switches = int(resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw)
    try:
        with open("/proc/stat") as stat:
            # user nice system idle iowait irq softirq steal
            values = [int(v) for v in stat.readline().split()[1:9]]
        return switches, (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return switches, None


class WindowClock:
    """Train-only and wall seconds of the current logging window, read from a TimeAccount; after each
    `close_window`, `cpu_seconds` holds the process CPU seconds of that window's training phase,
    `profile_seconds` the seconds its profiled update attempts took (inside its wall seconds, not its train
    seconds), `involuntary_switches` the times its threads were descheduled for other tasks, and
    `other_cpu_seconds` the CPU seconds the rest of the machine used during the window (None where
    unknown)."""

    def __init__(
        self, account: TimeAccount, machine: Callable[[], tuple[int, float | None]] = machine_counters
    ):
        self.account = account
        self.machine = machine
        self._last = account.snapshot()
        self._last_machine = machine()
        self.cpu_seconds = 0.0
        self.profile_seconds = 0.0
        self.involuntary_switches: int | None = None
        self.other_cpu_seconds: float | None = None

    def close_window(self) -> tuple[float, float]:
        """(train_seconds, wall_seconds) since the previous call (or construction); starts the next window."""
        now = self.account.snapshot()
        train = now["train"] - self._last["train"]
        wall = now["wall"] - self._last["wall"]
        self.cpu_seconds = now["cpu_train"] - self._last["cpu_train"]
        self.profile_seconds = now["profile"] - self._last["profile"]
        switches, busy = machine = self.machine()
        own_cpu = sum(now[f"cpu_{phase}"] - self._last[f"cpu_{phase}"] for phase in PHASES)
        self.involuntary_switches = switches - self._last_machine[0]
        self.other_cpu_seconds = (max(0.0, busy - self._last_machine[1] - own_cpu)
                                  if busy is not None and self._last_machine[1] is not None else None)
        self._last, self._last_machine = now, machine
        return train, wall


def throughput(
    tokens: int,
    train_seconds: float,
    wall_seconds: float,
    flops_per_token: float | None,
    peak_flops_per_s: float | None,
    train_tokens: int | None = None,
) -> dict[str, float | str | None]:
    """Training-only and wall-clock tokens/s, achieved FLOP/s (training-only), MFU against a known peak.

    `train_tokens` are the tokens processed in the training phase (default: all `tokens`); the tokens of
    profiled update attempts are not, as their seconds are not in `train_seconds`. A window with none has no
    training-only figures. `peak_flops_per_s` is the total over all devices of the run; without a known peak
    MFU is "unknown" (no figure without a basis).
    """
    train_tokens = tokens if train_tokens is None else train_tokens
    train_tps = train_tokens / train_seconds if train_seconds > 0 and train_tokens > 0 else None
    wall_tps = tokens / wall_seconds if wall_seconds > 0 else None
    achieved = train_tps * flops_per_token if (train_tps is not None and flops_per_token) else None
    if achieved is not None and peak_flops_per_s:
        mfu: float | str = achieved / peak_flops_per_s
    else:
        mfu = "unknown"
    return {"train_tokens_per_s": train_tps, "wall_tokens_per_s": wall_tps, "achieved_flops_per_s": achieved,
            "mfu": mfu}
