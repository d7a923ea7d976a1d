"""A stop signal while training (SIGINT, SIGTERM, SIGHUP, a scheduler's SIGUSR1 / SIGUSR2, or the set chosen
with `--stop-signals`): the first is a request to stop at the next update boundary, the second stops now.

`pilotrun train` installs the handlers before its set-up begins, so a signal during start-up is a request too:
the session stops after its first update with a committed checkpoint.

The first signal only sets `received` (and prints its acknowledgement at once, so that a user who pressed
Ctrl-C knows it was heard while the update in flight and the checkpoint finish); the loop reads it after each
update, agrees on it across ranks, closes the window, saves a checkpoint and ends the session "interrupted"
with exit code 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP). A second signal while the first is being honoured
raises `SecondSignal` from the handler, wherever the main thread is: the session ends at once, without the
checkpoint it was waiting for.

Copies of one request are not a second one. SLURM ends a job step (a time limit without `--signal`, `scancel`,
pre-emption) by sending SIGTERM to every process of the step, and torchrun, which gets its own, forwards it to
each rank: a rank hears the same signal twice, the second copy when the launcher's agent gets to it, which may
be seconds later (during the save the first asked for). So the same signal again within `COPY_SECONDS` of the
first is a copy, and under a launcher so is one more of it, whenever it comes; a different stop signal, or the
same one once more after that (a person's second Ctrl-C), is a second request.

The signals and their exit codes are every command's (pilotrun/common/stop_signals.py), and so is the
installer: handlers only from the main thread, the previous ones put back when the session ends, so an
in-process caller (the API, a test) keeps its own handling afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pilotrun.common import stop_signals

# Copies of one stop request arrive together: a scheduler's signal to every process and the launcher's forward
# of its own copy, both sent at once (the launcher's a Python handler later, on a busy machine).
COPY_SECONDS = 2.0


class SecondSignal(Exception):
    """A second SIGINT/SIGTERM while the first was being honoured: stop without waiting further."""

    @property
    def signum(self) -> int:
        return int(self.args[0])


class StopSignals:
    """What the session was asked by signal: `received` is the first stop signal (None: none yet).

    `on_first(signum)` runs inside the handler of the first signal (the trainer prints its acknowledgement
    there); `request(signum)` is the same request made without a signal (an embedding program, a test), never
    a copy. `launcher`: the process runs under torchrun, which forwards a copy of the stop signal it gets."""

    def __init__(self, on_first: Callable[[int], None] | None = None, signums: tuple[int, ...] | None = None,
                 launcher: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.on_first = on_first
        self.signums = signums  # the stop signals handled (`--stop-signals`); None: stop_signals.STOP_SIGNALS
        self.launcher, self.clock = launcher, clock
        self.received: int | None = None
        self.received_at = 0.0
        self.count = 0
        self.copies = 0  # copies of the first signal heard and taken as the same request
        self.finished = False  # the session is saved and on the record: a signal now changes nothing

    def request(self, signum: int) -> None:
        if self.finished:
            # Under torchrun the first rank to exit with a non-zero code (a stop's) has the launcher SIGTERM
            # the others, which are only tearing down by then: that must not turn their resumable exit into a
            # second-signal traceback.
            return
        self.count += 1
        if self.count > 1:
            raise SecondSignal(signum)
        self.received, self.received_at = signum, self.clock()
        if self.on_first is not None:
            self.on_first(signum)

    def is_copy(self, signum: int) -> bool:
        """Whether a delivered signal is a copy of the first request (the module docstring)."""
        if self.received is None or signum != self.received:
            return False
        together = self.clock() - self.received_at <= COPY_SECONDS
        return together or (self.launcher and self.copies == 0)

    def handle(self, signum: int, frame: Any) -> None:
        if self.is_copy(signum):
            self.copies += 1
            return
        self.request(signum)

    def exit_code(self, signum: int) -> int:
        return stop_signals.exit_code_of(signum, self.signums)

    @contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Handle every stop signal for the duration of the block (main thread only), then restore."""
        with stop_signals.handling(self.handle, self.signums):
            yield self
