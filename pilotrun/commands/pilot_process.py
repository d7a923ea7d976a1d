"""The pilot's training children: one `pilotrun train` process, or torchrun with its workers, as one tree.

The rehearsal's interruption has to be what a lost machine does to a job: every process of it dies at once,
with no handler, atexit or final checkpoint. Under torchrun that is not one process: the launcher starts each
worker in a session of its own, so killing the launcher (or its process group) alone leaves the workers
running. So the tree is read from /proc (every descendant of the launcher) before the kill and each process in
it gets SIGKILL, and the pilot then checks by pid that none is left.

Each child is started in a session of its own, so a Ctrl-C at the terminal reaches the pilot alone, and the
pilot passes exactly one stop signal on (`StopForwarding`): a child that received the terminal's SIGINT and
then the pilot's own would take the second as "stop at once, without a checkpoint". Under torchrun the signal
goes to the workers themselves, which finish their update and checkpoint together (any rank's stop stops all).

A child must not outlive the pilot: a pilot killed outright (SIGKILL, the OOM killer) runs no handler that
could stop it. So each child asks the kernel, before it starts, for SIGTERM when its parent dies (Linux's
PR_SET_PDEATHSIG): a lone `pilotrun train` then stops as on any SIGTERM (a committed checkpoint, exit 143),
and torchrun forwards it to its workers, which also watch their launcher's pid themselves (the launcher
watch). A pilot that died before the child asked is seen at once (the parent pid is no longer the pilot's).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pilotrun.common import stop_signals

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def parent_death_signal(signum: int = signal.SIGTERM):
    """A `preexec_fn` that makes the child receive `signum` when the process that started it dies (Linux), or
    None where there is no prctl. libc is loaded here, before the fork: the child only calls into it."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between the fork and the prctl: no death to wait for
            os.kill(os.getpid(), signum)

    return arm


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process /proc lists (Linux)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return parents


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, children before grandchildren."""
    parents = _parents()
    found: list[int] = []
    frontier = {pid}
    while frontier:
        children = sorted(
            child for child, parent in parents.items() if parent in frontier and child not in found
        )
        found += children
        frontier = set(children)
    return found


def is_alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has: it only waits to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_until_stopped(pid: int, timeout_seconds: float, poll_seconds: float = 0.005) -> bool:
    """Whether process `pid` reached the stopped state ('T' in /proc/PID/stat) within the timeout. False at
    once where /proc is missing (not Linux) or the process has gone: the caller then kills without waiting."""
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            # The state follows the command name in parentheses, which may itself hold spaces or parentheses.
            state = stat.read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return False
        if state in ("T", "t"):
            return True
        if state in ("Z", "X") or time.monotonic() >= deadline:
            return False
        time.sleep(poll_seconds)


def train_command() -> list[str]:
    """`pilotrun` in a process of its own, with this interpreter."""
    return [sys.executable, "-m", "pilotrun"]


def torchrun_command(nproc_per_node: int) -> list[str]:
    """torchrun for one node, on a free local port (the rehearsal's ranks share one machine)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
        "-m",
        "pilotrun",
    ]


def log_cause(log: Path) -> str:
    """The one line of a training's log that says why it failed: its `pilotrun: error:` line (bad input),
    else a traceback's last line (the exception), else the last line it wrote."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "its log could not be read"
    for line in reversed(lines):
        if line.startswith("pilotrun: error: "):
            return line.removeprefix("pilotrun: error: ")
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        return lines[-1]
    return lines[-1] if lines else "it wrote nothing"


class TrainingChild:
    """One `pilotrun train` of the rehearsal: a process, or torchrun and `nproc` workers, its output in
    `log`."""

    def __init__(self, train_args: list[str], log: Path, nproc: int | None = None,
                 launcher: list[str] | None = None) -> None:
        self.nproc, self.log = nproc, log
        # `launcher`: another command than `pilotrun` (the checks' branches in one process: tune_child.py)
        launcher = launcher or (torchrun_command(nproc) if nproc else train_command())
        env = dict(os.environ)
        if nproc:
            # torchrun sets it and warns; the recipe's num_threads rules
            env.setdefault("OMP_NUM_THREADS", "1")
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                launcher + train_args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=parent_death_signal(),
            )
        self.pid = self.process.pid

    def cause(self) -> str:
        return log_cause(self.log)

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self) -> int:
        return self.process.wait()

    def workers(self) -> list[int]:
        """The processes that train: the child itself, or torchrun's direct children."""
        if not self.nproc:
            return [self.pid] if self.process.poll() is None else []
        parents = _parents()
        return sorted(pid for pid, parent in parents.items() if parent == self.pid)

    def tree(self) -> list[int]:
        return [self.pid, *descendants(self.pid)]

    def wait_until_stopped(self, timeout_seconds: float) -> bool:
        """Whether every worker has stopped itself at the kill point (all `nproc` of them under torchrun)."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            workers = self.workers()
            if len(workers) >= (self.nproc or 1):
                left = max(0.0, deadline - time.monotonic())
                if all(wait_until_stopped(pid, left) for pid in workers):
                    return True
            if self.process.poll() is not None or time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def kill_tree(self) -> list[int]:
        """SIGKILL the launcher and every descendant at once; returns the pids killed, none of them alive
        after."""
        pids = self.tree()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + 30
        while any(is_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.01)  # the workers, reparented, are reaped by whoever adopted them
        return pids

    def forward(self, signum: int) -> None:
        """Pass a stop signal on: to the process, or under torchrun to each worker (torchrun, told too, would
        pass it on again, and a second signal means stop without a checkpoint). A worker stopped at the kill
        point is continued so that it can act on it."""
        for pid in self.workers() or [self.pid]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
                os.kill(pid, signal.SIGCONT)


class StopForwarding:
    """A stop signal (pilotrun/common/stop_signals.py) during the rehearsal: passed on to the running child
    (once per signal received), or, with no child running, raised as `PilotStopped` where the pilot stands."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.child: TrainingChild | None = None

    @property
    def exit_code(self) -> int:
        return stop_signals.exit_code_of(self.signum) if self.signum is not None else 0

    def _handle(self, signum: int, frame) -> None:
        first = self.signum is None
        self.signum = self.signum if self.signum is not None else signum
        child = self.child
        if child is not None and child.poll() is None:
            child.forward(signum)
        elif first:
            raise PilotStopped(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopForwarding]:
        with stop_signals.handling(self._handle):
            yield self

    @contextlib.contextmanager
    def running(self, child: TrainingChild) -> Iterator[TrainingChild]:
        self.child = child
        try:
            yield child
        finally:
            self.child = None


class PilotStopped(BaseException):
    """A stop signal reached the pilot while no child was training (preparing, between phases, the report)."""

    def __init__(self, signum: int) -> None:
        super().__init__(stop_signals.signal_name(signum))
        self.signum = signum
