"""pilotrun/common/stop_signals.py: a stop signal between `python -m pilotrun`'s first lines and the command's
own handling is kept, then handed to `train`'s handling; another command gets the default handling back."""

from __future__ import annotations

import signal

import pytest

from pilotrun.common import stop_signals


def test_a_signal_held_since_the_launch_reaches_the_commands_handler(monkeypatch):
    before = {s: signal.getsignal(s) for s in stop_signals.STOP_SIGNALS}
    try:
        stop_signals.held_early()
        signal.raise_signal(signal.SIGUSR1)  # handled at once, by the holding handler: kept
        assert stop_signals.EARLY == [signal.SIGUSR1]
        heard = []
        stop_signals.release_early(lambda signum, frame: heard.append(signum))
        assert heard == [signal.SIGUSR1] and stop_signals.EARLY == []
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        stop_signals.HELD["installed"] = False


def test_another_command_gets_the_default_handling_back():
    before = {s: signal.getsignal(s) for s in stop_signals.STOP_SIGNALS}
    try:
        stop_signals.held_early()
        stop_signals.release_early(None)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) == signal.default_int_handler
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_without_the_holding_an_in_process_callers_handlers_are_left_alone():
    mine = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        stop_signals.release_early(None)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, mine)


def test_a_signal_left_out_of_the_commands_set_gets_its_default_handling_back():
    """`train --stop-signals SIGTERM`: SIGINT is not train's, so the holding gives it back to Python (a Ctrl-C
    raises KeyboardInterrupt) instead of swallowing it; one held since the launch acts now."""
    before = {s: signal.getsignal(s) for s in stop_signals.STOP_SIGNALS}
    try:
        stop_signals.held_early()
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # train's own, installed first
        signal.raise_signal(signal.SIGINT)
        heard = []
        with pytest.raises(KeyboardInterrupt):
            stop_signals.release_early(lambda signum, frame: heard.append(signum), (signal.SIGTERM,))
        assert heard == [] and signal.getsignal(signal.SIGINT) == signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.default_int_handler)
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        stop_signals.HELD["installed"] = False
