"""The hang watchdog: a rank that makes no progress for longer than this run's own measured times allow writes
every thread's stack to RUN/hangs/, ends the session `hung` on the record, and exits with `HUNG_EXIT_CODE`.

A collective that one rank never joins (a dead NCCL link, a stuck file read on one node, a deadlock) stops the
whole job without an error: every other rank waits in the collective until the process group's timeout, and a
job left alone burns its allocation. The watchdog is a daemon thread on every rank, fed by the loop's progress
points: the start and the end of each update attempt (`around_update`, outermost), and the time account's
switches into and out of evaluation and checkpointing (an evaluation and a save are progress, and can be
long). Between two progress points the rank is in one stretch of a kind: `startup` (from the command's start
to the first update), `update`, `eval`, `checkpoint`, `other` (the callbacks' round between updates) or
`teardown`.

The bound on a stretch is its kind's: `MULTIPLE` times the slowest stretch of that kind measured in this
session, never below `FLOOR_SECONDS`, never above the start-up bound (`auto`), or the bound the user fixed
(`--hang-timeout SECONDS`). The first stretch of each kind is not measured and is bounded by the start-up
bound (`STARTUP_SECONDS`, or the second figure of `--hang-timeout STEADY,STARTUP`): it pays the warm-up
(kernels loading, allocator growth, a compile, a first checkpoint read or write) and predicts nothing about
the next.

Past the bound, from the watchdog's thread (the main thread is the one stuck): every thread's stack (Python
frames, from `sys._current_frames`) goes to `RUN/hangs/<UTC time>-rank<R>.txt`, written as temp + rename; on
rank 0 `on_hang(message)` ends the session `hung` on the record (the trainer's; bounded by `RECORD_SECONDS`, a
record on a stuck file system must not keep the process alive); then `os._exit(HUNG_EXIT_CODE)`: no unwinding,
which would wait in the same collective. torchrun (`--max-restarts`) or the requeue script then starts the
same command again and `--resume auto` continues from the newest committed checkpoint; the work since that
checkpoint is lost (a stuck job cannot save). Every rank watches itself: a rank stuck alone and the ranks
waiting on it all stop within about one update of each other, each with its own stack file. A rank that fires
waits `GRACE_SECONDS` before it exits, so that the ranks waiting on it fire too: its exit would break their
collective with an error (gloo: "connection closed by peer"). Should it break first anyway, the waiting rank
finds the stuck rank's stack file of this session (`peer_hangs`) and ends the session `hung` too, naming it,
with the same exit code.

The process group's timeout is fixed when the group is created (it cannot change later), so it is derived from
the largest bound the watchdog can use, plus a margin (`process_group_seconds`): the watchdog always fires
first, with the stacks, before a collective gives up with an error. With the watchdog off it is torch's 30
minutes.

A thread that holds the GIL forever (a C extension that never releases it) stops the watchdog's thread too;
that hang is left to the process group's timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pilotrun.common.deadline import parse_duration
from pilotrun.common.files import plain_folder, write_text_atomic
from pilotrun.common.stop_signals import HUNG_EXIT_CODE
from pilotrun.run.record import HANGS_DIR
from pilotrun.run.start_costs import StartCosts
from pilotrun.training.callbacks.base import Callback, LoopState

STARTUP_SECONDS = 1800.0  # auto: the set-up and the first stretch of each kind (a compile, a first save)
MULTIPLE = 10.0  # auto: a stretch may take this many times its kind's slowest measured one
FLOOR_SECONDS = 300.0  # auto: never less (a busy machine, a slow file system's hiccup)
PROCESS_GROUP_MARGIN = 60.0  # the process group's timeout exceeds the largest bound by at least this
RECORD_SECONDS = 30.0  # the longest the hung session's record may take before the process exits regardless
# a hung rank waits this long (at most half its bound) before it exits: see the docstring
GRACE_SECONDS = 10.0
# A fixed bound with nothing recorded to measure it against is refused below these: a healthy update (a
# Python garbage collection, a record's fsync, a busy machine's scheduling) can pause a rank for a good part
# of a second, and a set-up (torch's import, the process group, the data and the model) takes tens of seconds
# on a cluster's shared file system. Once the record holds an update and a set-up, those measure the bounds.
STEADY_FLOOR_SECONDS = 1.0
STARTUP_FLOOR_SECONDS = 60.0
PRIORITY_HANG = -20  # outside the profiler: an update attempt's progress points bracket all of it
KINDS = ("startup", "update", "eval", "checkpoint", "other", "teardown")
PHASE_KINDS = {"eval": "eval", "checkpoint": "checkpoint"}  # time-account phases that are their own stretch
DEFAULT_PROCESS_GROUP_SECONDS = 1800.0  # torch's own default, kept with the watchdog off


@dataclass(frozen=True)
class HangBounds:
    """`steady`: the fixed bound after the first stretch of each kind (None: derived, `auto`); `startup`: the
    set-up's and each kind's first stretch's bound, and the ceiling of a derived bound."""

    steady: float | None = None
    startup: float = STARTUP_SECONDS

    def bound(self, measured: float | None) -> float:
        """The bound on a stretch whose kind's slowest measured stretch is `measured` (None: not measured)."""
        if measured is None:
            return self.startup
        if self.steady is not None:
            return self.steady
        return min(self.startup, max(FLOOR_SECONDS, MULTIPLE * measured))

    def largest(self) -> float:
        return max(self.startup, self.steady or 0.0)

    def process_group_seconds(self) -> float:
        """The process group's timeout: the largest bound plus a margin (a tenth, at least a minute)."""
        return self.largest() + max(PROCESS_GROUP_MARGIN, 0.1 * self.largest())

    def describe(self) -> str:
        if self.steady is None:
            return (f"auto: {MULTIPLE:g} x the slowest measured stretch of its kind, {FLOOR_SECONDS:g} s to "
                    f"{self.startup:g} s; set-up and first stretches {self.startup:g} s")
        return f"fixed: {self.steady:g} s; set-up and first stretches {self.startup:g} s"


def _seconds(text: str, what: str) -> float:
    text = text.strip().lower()
    try:
        value = float(text)
    except ValueError:
        duration = parse_duration(text)
        value = duration if duration is not None else float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"--hang-timeout: {what} {text!r} is not a positive duration (600, 45s, 10m, 1h)")
    return value


def parse_hang_timeout(text: str) -> HangBounds | None:
    """`auto` -> derived bounds; `off` -> None (no watchdog); `STEADY` or `STEADY,STARTUP` (seconds or a
    duration: 600, 10m) -> fixed bounds (the start-up bound is auto's unless given, never below the steady
    one). ValueError names what is wrong (the command's exit 2)."""
    text = text.strip()
    if text.lower() == "auto":
        return HangBounds()
    if text.lower() == "off":
        return None
    parts = text.split(",")
    if len(parts) > 2:
        raise ValueError(f"--hang-timeout {text!r}: auto, off, STEADY or STEADY,STARTUP (e.g. 10m,1h)")
    steady = _seconds(parts[0], "bound")
    startup = _seconds(parts[1], "start-up bound") if len(parts) == 2 else max(STARTUP_SECONDS, steady)
    return HangBounds(steady=steady, startup=max(startup, steady))


def check_bounds_fit(bounds: HangBounds | None, recorded: StartCosts) -> None:
    """A fixed bound that a healthy session would pass ends every session hung with nothing saved, and a
    scheduler requeues it for ever: refused (ValueError), as a deadline too close to train anything is. The
    steady bound against the slowest update the run has recorded, the start-up bound against its slowest
    recorded set-up; with nothing recorded, each against its floor (`STEADY_FLOOR_SECONDS`,
    `STARTUP_FLOOR_SECONDS`). `recorded`: the run's record (start_costs.read_start_costs)."""
    if bounds is None or bounds.steady is None:
        return
    slowest = max(recorded.seconds_per_update, default=None)
    if slowest is not None and bounds.steady < slowest:
        raise ValueError(
            f"--hang-timeout: the bound {bounds.steady:g} s is below an update this run has taken "
            f"({slowest:.2f} s, its slowest recorded): every session would end hung; choose auto or "
            "a bound well above it"
        )
    if slowest is None and bounds.steady < STEADY_FLOOR_SECONDS:
        raise ValueError(
            f"--hang-timeout: the bound {bounds.steady:g} s is below {STEADY_FLOOR_SECONDS:g} s, and this "
            "run has recorded no update to measure it against: a healthy update would read as a hang; choose "
            "auto or a bound well above an update of this recipe"
        )
    setups = recorded.setup_seconds
    if setups and bounds.startup < max(setups):
        raise ValueError(
            f"--hang-timeout: the start-up bound {bounds.startup:g} s is below a set-up this run has taken "
            f"({max(setups):.1f} s, its slowest recorded): every session would end hung before its first "
            "update; choose auto or a start-up bound well above it (STEADY,STARTUP)"
        )
    if not setups and bounds.startup < STARTUP_FLOOR_SECONDS:
        raise ValueError(
            f"--hang-timeout: the start-up bound {bounds.startup:g} s is below {STARTUP_FLOOR_SECONDS:g} s, "
            "and this run has recorded no set-up to measure it against: importing torch, opening the "
            "process group and building the model take tens of seconds on a cluster; choose auto or a "
            "start-up bound of minutes (STEADY,STARTUP)"
        )


def hang_file_name(rank: int, when: datetime.datetime) -> str:
    """One file per rank and time; names sort by time, the ranks of one hang side by side."""
    return f"{when.strftime('%Y%m%dT%H%M%SZ')}-rank{rank}.txt"


def thread_stacks() -> str:
    """Every thread's Python stack, named, the main thread's first, the innermost frame last (traceback's
    order)."""
    names = {thread.ident: thread for thread in threading.enumerate()}
    main = threading.main_thread().ident
    parts = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda item: (item[0] != main, item[0])):
        thread = names.get(ident)
        label = f"{thread.name}{' (daemon)' if thread.daemon else ''}" if thread else "unnamed"
        parts.append(f"Thread {label}, id {ident}:\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def peer_hangs(run_dir: str | Path, since: float, rank: int) -> list[Path]:
    """The stack files other ranks wrote since `since` (epoch seconds): a collective that failed on this rank
    after one of them was written failed because that rank hung and left."""
    folder = Path(run_dir) / HANGS_DIR
    if not folder.is_dir() or folder.is_symlink():
        return []
    return sorted(path for path in folder.glob("*-rank*.txt")
                  if not path.name.endswith(f"-rank{rank}.txt") and path.stat().st_mtime >= since)


class HangWatchdog(Callback):
    """Watches this rank's progress from a daemon thread (`start`/`stop`); see the module docstring.

    Seams: `clock` (monotonic seconds), `exit` (os._exit), `now` (the UTC time in the file's name)."""

    priority = PRIORITY_HANG
    phase = "other"

    def __init__(self, bounds: HangBounds, run_dir: str | Path, rank: int, *,
                 clock: Callable[[], float] = time.monotonic, exit: Callable[[int], Any] | None = None,
                 now: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
                 poll_seconds: float | None = None, out: Any = None,
                 sleep: Callable[[float], Any] = time.sleep) -> None:
        self.bounds, self.run_dir, self.rank = bounds, Path(run_dir), rank
        self.clock, self.exit, self.now = clock, exit if exit is not None else os._exit, now
        smallest = min(bounds.startup, bounds.steady or FLOOR_SECONDS)
        self.poll_seconds = poll_seconds if poll_seconds is not None else max(0.05, min(1.0, smallest / 20))
        self.out, self.sleep = out, sleep
        # rank 0's record of the hung session (the trainer's)
        self.on_hang: Callable[[str], None] | None = None
        self.step: Callable[[], int | None] = lambda: None
        self.kind, self.since = "startup", clock()
        self.measured: dict[str, float] = {}  # kind -> its slowest stretch after the first
        self.first_seen: set[str] = set()
        self.fired: str | None = None  # the hang file written, once fired
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._exited = threading.Event()  # the exit returned (only a seam's does): a halted beat goes on
        self._thread: threading.Thread | None = None

    # progress points -------------------------------------------------------------------------------
    def beat(self, kind: str) -> None:
        """A progress point: the stretch running ends (and is measured, but for its kind's first) and one of
        `kind` begins. Once the rank is declared hung its session has ended on the record: a stall that ends
        after that goes no further than here (no update, event or save of an ended session) until the exit."""
        if self.fired is not None:
            self._exited.wait()
        with self._lock:
            now = self.clock()
            ended, lasted = self.kind, now - self.since
            if ended in self.first_seen:
                self.measured[ended] = max(self.measured.get(ended, 0.0), lasted)
            self.first_seen.add(ended)
            self.kind, self.since = kind, now

    def phase_switched(self, phase: str) -> None:
        """The time account's listener: into evaluation or checkpointing, and out of them back to the
        round."""
        if phase == "report":
            return  # logging an event, within whatever stretch it belongs to
        kind = PHASE_KINDS.get(phase)
        if kind is not None and kind != self.kind:
            self.beat(kind)
        elif kind is None and self.kind in PHASE_KINDS.values():
            self.beat("other")

    @contextlib.contextmanager
    def _update(self) -> Iterator[None]:
        self.beat("update")
        try:
            yield
        finally:
            self.beat("other")

    def around_update(self, loop: LoopState) -> contextlib.AbstractContextManager[Any]:
        return self._update()

    def attach(self, loop: LoopState) -> None:
        """Listen to the session's time account and name the step in a hang's message."""
        loop.account.listeners.append(self.phase_switched)
        self.step = lambda: loop.step

    def at_end(self, loop: LoopState) -> None:
        with contextlib.suppress(ValueError):
            loop.account.listeners.remove(self.phase_switched)
        self.beat("teardown")  # the session's end and the ranks' leaving together are watched until `stop`

    # the thread ------------------------------------------------------------------------------------
    def bound(self) -> tuple[str, float, float]:
        """The running stretch: its kind, its seconds so far and its bound."""
        with self._lock:
            kind, since = self.kind, self.since
            measured = self.measured.get(kind)
        return kind, self.clock() - since, self.bounds.bound(measured)

    def check(self) -> bool:
        """Fire when the running stretch is past its bound; whether it fired."""
        kind, idle, bound = self.bound()
        if idle <= bound or self.fired is not None:
            return False
        self.fire(kind, idle, bound)
        return True

    def fire(self, kind: str, idle: float, bound: float) -> None:
        path = self.write_stacks(kind, idle, bound)
        step = self.step()
        message = (f"rank {self.rank}: no progress for {idle:.0f} s in {kind}"
                   f"{f' after step {step}' if step is not None else ''} (bound {bound:.0f} s, "
                   f"{self.bounds.describe()}); every thread's stack in {path}")
        self.fired = str(path)
        print(
            f"pilotrun: hung: {message}; exiting with {HUNG_EXIT_CODE}",
            file=self.out or sys.stderr,
            flush=True,
        )
        if self.on_hang is not None:
            recorder = threading.Thread(target=self._record, args=(message,), name="pilotrun-hang-record",
                                        daemon=True)
            recorder.start()
            recorder.join(RECORD_SECONDS)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        self.sleep(min(GRACE_SECONDS, bound / 2))
        self.exit(HUNG_EXIT_CODE)
        self._exited.set()

    def _record(self, message: str) -> None:
        try:
            assert self.on_hang is not None
            self.on_hang(message)
        # the exit comes regardless: a record that cannot be written is said, not fatal
        except Exception as exc:
            print(
                f"pilotrun: hung: the record could not be ended: {type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )

    def write_stacks(self, kind: str, idle: float, bound: float) -> Path:
        folder = plain_folder(self.run_dir / HANGS_DIR)
        path = folder / hang_file_name(self.rank, self.now())
        header = (
            f"pilotrun hang: rank {self.rank}, pid {os.getpid()}, no progress for {idle:.1f} s in {kind} "
            f"(bound {bound:.1f} s; {self.bounds.describe()}); step {self.step()}\n\n"
        )
        write_text_atomic(path, header + thread_stacks())
        return path

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_seconds):
            if self.check():
                return

    def start(self) -> HangWatchdog:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="pilotrun-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
