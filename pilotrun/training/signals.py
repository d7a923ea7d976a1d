"""A stop signal while training (SIGINT, SIGTERM, SIGHUP, a scheduler's SIGUSR1 / SIGUSR2, or the set chosen with
`--stop-signals`): the first is a request to stop at the next update boundary, the second stops now.

`pilotrun train` installs the handlers before its set-up begins, so a signal during start-up is a request too:
the session stops after its first update with a committed checkpoint.

The first signal only sets `received` (and prints its acknowledgement at once, so that a user who pressed Ctrl-C
knows it was heard while the update in flight and the checkpoint finish); the loop reads it after each update,
agrees on it across ranks, closes the window, saves a checkpoint and ends the session "interrupted" with exit
code 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP). A second signal while the first is being honoured raises `SecondSignal` from
the handler, wherever the main thread is: the session ends at once, without the checkpoint it was waiting for.

The signals and their exit codes are every command's (pilotrun/common/stop_signals.py), and so is the installer: handlers
only from the main thread, the previous ones put back when the session ends, so an in-process caller (the API, a
test) keeps its own handling afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pilotrun.common import stop_signals


class SecondSignal(Exception):
    """A second SIGINT/SIGTERM while the first was being honoured: stop without waiting further."""

    @property
    def signum(self) -> int:
        return int(self.args[0])


class StopSignals:
    """What the session was asked by signal: `received` is the first stop signal (None: none yet).

    `on_first(signum)` runs inside the handler of the first signal (the trainer prints its acknowledgement
    there); `request(signum)` is the same request made without a signal (an embedding program, a test)."""

    def __init__(self, on_first: Callable[[int], None] | None = None, signums: tuple[int, ...] | None = None) -> None:
        self.on_first = on_first
        self.signums = signums  # the stop signals handled (`--stop-signals`); None: stop_signals.STOP_SIGNALS
        self.received: int | None = None
        self.count = 0
        self.finished = False  # the session is saved and on the record: a signal now changes nothing

    def request(self, signum: int) -> None:
        if self.finished:
            # Under torchrun the first rank to exit with a non-zero code (a stop's) has the launcher SIGTERM the
            # others, which are only tearing down by then: that must not turn their resumable exit into a
            # second-signal traceback.
            return
        self.count += 1
        if self.count > 1:
            raise SecondSignal(signum)
        self.received = signum
        if self.on_first is not None:
            self.on_first(signum)

    def handle(self, signum: int, frame: Any) -> None:
        self.request(signum)

    def exit_code(self, signum: int) -> int:
        return stop_signals.exit_code_of(signum, self.signums)

    @contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Handle every stop signal for the duration of the block (main thread only), then restore."""
        with stop_signals.handling(self.handle, self.signums):
            yield self
