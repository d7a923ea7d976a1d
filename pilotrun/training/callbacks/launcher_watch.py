"""Under torchrun, a rank stops when its launcher is gone: the update is finished and a checkpoint saved.

torchrun starts each worker in a session of its own (`start_new_session`), so when the launcher alone dies
without forwarding a signal (SIGKILLed by an OOM killer, a scheduler killing one pid) nothing reaches the
workers: they would train on to `max_steps` holding the run folder's lock, and the `--resume` a user starts
under a new torchrun would be refused as a second writer. With this callback each rank notices, and the
session ends "interrupted" at the next update boundary like a SIGTERM: the window is closed, a checkpoint of
the state is committed, the lock released, every process exits.

How a rank notices: the parent pid is recorded when the session's callbacks are built, and after each update
`os.getppid()` is compared with it (one system call; a dead parent's children are handed to init or a
subreaper, so the pid changes and never comes back). On Linux the kernel is also asked (prctl
PR_SET_PDEATHSIG) to send `PARENT_DEATH_SIGNAL` when the parent goes; its handler only sets a flag, so it can
never be taken for the user's second Ctrl-C (signals.py counts those). The pid comparison decides: the kernel
sends the parent-death signal when the *thread* that started the worker ends, which need not be the launcher
process, and a flag whose parent is still there is such a case (or someone else's signal) and is ignored.

What still works once the launcher is gone: the launcher hosts the c10d TCPStore, which the process group used
to rendezvous. Under gloo every collective the save uses (the replica check, DCP's gathers, the barrier) and
the group's teardown go rank to rank over the connections made at start; a real 2-rank torchrun run whose
launcher was SIGKILLed committed its checkpoint and exited (tests/training/callbacks/test_launcher_watch.py).
Nothing in the checkpoint path creates a process group or asks the store. NCCL was not tried without its
store.

The exit code is 143, SIGTERM's: for whoever waits on a worker (a wrapper that reaps orphans, a node agent),
losing the launcher is an outside request to stop from which `--resume` continues exactly, and scripts (and
`pilotrun pilot`) already read 143 as "interrupted, resumable". The session's message says it was the
launcher.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from pilotrun.training import distributed as dist_utils
from pilotrun.training.callbacks.base import Callback, Ending, LoopState

PR_SET_PDEATHSIG = 1
# A real-time signal: SIGUSR1/SIGUSR2 are what schedulers send as a pre-emption warning (SLURM's --signal,
# submitit), and the default action of an unhandled real-time signal (terminate) is never reached: the handler
# is installed before the kernel is asked to send it, and the request is withdrawn before the handler goes.
PARENT_DEATH_SIGNAL = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None
EXIT_CODE = 143
PRIORITY_LAUNCHER = 50  # asked only through stop_request, which every callback answers before any acts


def run_by_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Started by torchrun's elastic agent (which is then this process's parent): the rank variables that
    distributed.py reads, and the agent's own TORCHELASTIC_RUN_ID (another launcher may set RANK and friends
    with a parent that legitimately comes and goes)."""
    environ = os.environ if environ is None else environ
    return dist_utils.launched_by_torchrun(dict(environ)) and "TORCHELASTIC_RUN_ID" in environ


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


class LauncherWatchCallback(Callback):
    """Asks the session to stop once this rank's parent is no longer `launcher_pid` (None: watch nothing).

    `parent_pid` and `prctl` are the seams: the process's real parent and libc's prctl by default."""

    priority = PRIORITY_LAUNCHER
    phase = "other"

    def __init__(self, launcher_pid: int | None, *, parent_pid: Callable[[], int] = os.getppid,
                 prctl: Callable[..., int] | None = None) -> None:
        self.launcher_pid = launcher_pid
        self.parent_pid = parent_pid
        self.prctl = prctl
        self.signalled = False  # the parent-death signal arrived (the pid comparison still decides)
        self.ignored_signals = 0  # flags that came while the parent was still the launcher
        self._previous_handler: Any = None
        self._armed = False

    @classmethod
    def for_process(cls, environ: Mapping[str, str] | None = None) -> LauncherWatchCallback:
        """The watch for this process: its parent now, when torchrun started it; else one that watches
        nothing. Arms the parent-death signal where it can (Linux, main thread, the signal not already
        taken)."""
        if not run_by_torchrun(environ):
            return cls(None)
        watch = cls(os.getppid(), prctl=_prctl())
        watch.arm()
        return watch

    def arm(self) -> bool:
        """Install the flag handler, then ask the kernel for the signal; whether both were done."""
        if self.launcher_pid is None or self.prctl is None or PARENT_DEATH_SIGNAL is None:
            return False
        if threading.current_thread() is not threading.main_thread():
            return False  # Python installs handlers from the main thread only; the pid comparison remains
        if signal.getsignal(PARENT_DEATH_SIGNAL) not in (signal.SIG_DFL, None):
            return False  # someone else's signal: leave it theirs
        self._previous_handler = signal.signal(PARENT_DEATH_SIGNAL, self._handle)
        if self.prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) != 0:
            signal.signal(PARENT_DEATH_SIGNAL, self._previous_handler)
            return False
        self._armed = True
        if self.parent_pid() != self.launcher_pid:
            self.signalled = True  # gone between the pid's reading and the request: no signal will come
        return True

    def disarm(self) -> None:
        """Withdraw the kernel's request first, so no signal arrives after the handler is put back."""
        if not self._armed:
            return
        self._armed = False
        assert self.prctl is not None and PARENT_DEATH_SIGNAL is not None
        self.prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
        signal.signal(PARENT_DEATH_SIGNAL, self._previous_handler)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signalled = True  # only a flag: read after the update in flight, like every stop request

    def launcher_gone(self) -> bool:
        if self.launcher_pid is None:
            return False
        gone = self.parent_pid() != self.launcher_pid
        if self.signalled and not gone:
            self.signalled = False  # the thread that started this worker ended, or another sender: not a loss
            self.ignored_signals += 1
        return gone

    def stop_request(self, loop: LoopState) -> Ending | None:
        if not self.launcher_gone():
            return None
        how = "parent-death signal and parent pid" if self.signalled else "parent pid"
        return Ending("interrupted", EXIT_CODE,
                      f"torchrun launcher (pid {self.launcher_pid}) is gone (seen by {how}, now "
                      f"{self.parent_pid()}): finished the update, saved checkpoint step {loop.step}")

    def at_end(self, loop: LoopState) -> None:
        self.disarm()
