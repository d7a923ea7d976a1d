"""The signals that ask a pilotrun command to stop, their exit codes, and the one way to handle them.

Every command that stops on a signal (train, prepare, pilot, and the commands that write an output as temp +
rename) honours the same set, `STOP_SIGNALS`, and ends with the same code, 128 + the signal's number (130 for
SIGINT, 143 for SIGTERM, 129 for SIGHUP), whatever its first signal means to it (finish the update or the
chunk and save, pass it on to a child, unwind and remove a temp). SIGHUP is a closed terminal or a dropped ssh
session: the user did not ask to lose the work since the last save, so it is a stop like SIGTERM. SIGUSR1 and
SIGUSR2 are a scheduler's pre-emption warnings (SLURM's `--signal=USR1@180`, submitit, Lightning's USR2): a
job left alone must answer them with a checkpoint, so they are stop signals by default too (138 and 140).
`pilotrun train --stop-signals` chooses its own set (`parse_signal_names`), a machine setting that may change
on any resume.

Exit codes that mean "stopped with a committed checkpoint, resumable" (a requeue script tells them from a
failure): 128 + a stop signal's number, and `DEADLINE_EXIT_CODE` (75, sysexits' EX_TEMPFAIL, "try again
later") for a session that ended itself before `--stop-by`; `HUNG_EXIT_CODE` (124) for a rank that made no
progress within its hang bound (resumable from the newest checkpoint, the work since it lost). 0 is done, 1 a
run that stopped itself, 2 bad input.

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

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
DEADLINE_EXIT_CODE = 75
# A rank that made no progress within its hang bound (training/callbacks/hang_watchdog.py): GNU timeout's
# "timed out". Resumable like the codes above, but from the newest committed checkpoint: a stuck job cannot
# save.
HUNG_EXIT_CODE = 124
# Signals no process can handle, and those that mean a fault rather than a request: never stop signals.
UNHANDLEABLE = {signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL,
                signal.SIGCHLD}

Handler = Callable[[int, Any], None]


def exit_code_of(signum: int, stop_signals: tuple[int, ...] | None = None) -> int:
    """The documented exit code of a command stopped by `signum`: 128 + its number; a stop asked without a
    stop signal (a request naming another one) ends as SIGTERM would, 143. `stop_signals`: the command's own
    set when it chose one (`--stop-signals`), else `STOP_SIGNALS`."""
    return 128 + int(signum) if signum in (stop_signals or STOP_SIGNALS) else 128 + signal.SIGTERM


def parse_signal_names(text: str) -> tuple[int, ...]:
    """`SIGUSR1,TERM,int` -> the signals' numbers, in order, without repeats; an unknown name, an empty list
    or a signal no process may handle as a stop raises ValueError naming it (the command turns it into exit
    2)."""
    names = [name.strip().upper() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--stop-signals {text!r}: no signal named (e.g. SIGINT,SIGTERM,SIGUSR1)")
    chosen: list[int] = []
    for name in names:
        full = name if name.startswith("SIG") else f"SIG{name}"
        signum = getattr(signal.Signals, full, None) if not full.startswith("SIG_") else None
        if signum is None:
            raise ValueError(
                f"--stop-signals: unknown signal name {name!r} (e.g. SIGINT, SIGTERM, SIGHUP, SIGUSR1)"
            )
        if signum in UNHANDLEABLE:
            raise ValueError(
                f"--stop-signals: {full} cannot be a stop signal (it cannot be handled, or means a fault)"
            )
        if int(signum) not in chosen:
            chosen.append(int(signum))
    return tuple(chosen)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


@contextmanager
def handling(handler: Handler, signums: tuple[int, ...] | None = None) -> Iterator[None]:
    """`handler(signum, frame)` handles every stop signal (or those of `signums`) for the duration of the
    block (main thread only)."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signums or STOP_SIGNALS):
            previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, before in previous.items():
            signal.signal(signum, before)


# Stop signals heard between the interpreter's start and a command's own handling (`held_early`), and whether
# that holding is installed (only `python -m pilotrun` installs it; an in-process caller's handlers are its
# own).
EARLY: list[int] = []
HELD = {"installed": False}


def held_early() -> None:
    """From the first lines of `python -m pilotrun` (before the command line is even read): a stop signal is
    kept in `EARLY` instead of ending the process, so that `train`, whose set-up imports torch for seconds,
    hears one sent at its launch as a request. `release_early` hands what was kept to the command's own
    handling."""
    if threading.current_thread() is threading.main_thread():
        HELD["installed"] = True
        for signum in STOP_SIGNALS:
            signal.signal(signum, lambda signum, frame: EARLY.append(signum))


def release_early(handler: Handler | None, signums: tuple[int, ...] | None = None) -> None:
    """The command's handling takes over: `handler` (train's, already installed for `signums`, its
    `--stop-signals`; None: every stop signal) hears each kept signal it handles; the default handling is put
    back for every other one (all of them for a command without a handler), and those kept act as they would
    have: a SIGINT left out of `--stop-signals` is Python's KeyboardInterrupt again, not a Ctrl-C the holding
    swallows."""
    kept, EARLY[:] = list(EARLY), []
    handled = () if handler is None else (signums or STOP_SIGNALS)
    if HELD["installed"] and threading.current_thread() is threading.main_thread():
        HELD["installed"] = False
        for signum in (s for s in STOP_SIGNALS if s not in handled):
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    for signum in kept:
        if signum in handled:
            handler(signum, None)
        else:
            signal.raise_signal(signum)


def ignored() -> None:
    """In a worker process: ignore every stop signal, so that one the terminal sends to the whole process
    group reaches the worker's parent alone, which finishes its unit of work and then ends the worker
    itself."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
