"""The signals that ask a pilotrun command to stop, their exit codes, and the one way to handle them.

Every command that stops on a signal (train, prepare, pilot, and the commands that write an output as temp +
rename) honours the same set, `STOP_SIGNALS`, and ends with the same code, 128 + the signal's number (130 for
SIGINT, 143 for SIGTERM, 129 for SIGHUP), whatever its first signal means to it (finish the update or the chunk
and save, pass it on to a child, unwind and remove a temp). SIGHUP is a closed terminal or a dropped ssh
session: the user did not ask to lose the work since the last save, so it is a stop like SIGTERM. A scheduler's
pre-emption warning is one more entry in `STOP_SIGNALS`, and every command honours it at once.

`handling(handler)` installs a handler for every stop signal for the duration of a block and puts the previous
handlers back afterwards, so an in-process caller (the API, a test) keeps its own handling. Python delivers
signals to the main thread only and allows installing handlers nowhere else, so in another thread it installs
nothing. `ignored()` is for worker processes whose parent decides when to stop (a terminal sends SIGINT and
SIGHUP to its whole process group).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

Handler = Callable[[int, Any], None]


def exit_code_of(signum: int) -> int:
    """The documented exit code of a command stopped by `signum`: 128 + its number; a stop asked without a
    stop signal (a request naming another one) ends as SIGTERM would, 143."""
    return 128 + int(signum) if signum in STOP_SIGNALS else 128 + signal.SIGTERM


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


@contextmanager
def handling(handler: Handler) -> Iterator[None]:
    """`handler(signum, frame)` handles every stop signal for the duration of the block (main thread only)."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)


def ignored() -> None:
    """In a worker process: ignore every stop signal, so that one the terminal sends to the whole process group
    reaches the worker's parent alone, which finishes its unit of work and then ends the worker itself."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
