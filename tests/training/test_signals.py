"""pilotrun/training/signals.py: a first SIGINT/SIGTERM is a request, a second stops now; handlers come and
go.

The exit codes (130, 143, 129) are every command's: tests/common/test_stop_signals.py."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from pilotrun.training.signals import SecondSignal, StopSignals


def test_the_first_signal_is_a_request_and_the_second_raises():
    heard = []
    signals = StopSignals(on_first=heard.append)
    assert signals.received is None
    signals.handle(signal.SIGTERM, None)
    assert signals.received == signal.SIGTERM and heard == [signal.SIGTERM]
    with pytest.raises(SecondSignal) as second:
        signals.handle(signal.SIGINT, None)
    assert second.value.signum == signal.SIGINT
    assert signals.received == signal.SIGTERM and heard == [signal.SIGTERM]  # the first stays the reason


def test_handlers_are_installed_for_the_block_and_the_previous_ones_restored():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signals = StopSignals()
    with signals.installed():
        assert signal.getsignal(signal.SIGTERM) == signals.handle
        # every command's stop signals (common/stop_signals.py)
        assert signal.getsignal(signal.SIGHUP) == signals.handle
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, handled by the request
        assert signals.received == signal.SIGTERM
    assert {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} == before


def test_outside_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def body():
        with StopSignals().installed():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [before]


def test_once_the_session_is_finished_a_signal_changes_nothing():
    signals = StopSignals()
    signals.request(15)
    signals.finished = True
    signals.request(15)  # torchrun's SIGTERM to a rank tearing down: no SecondSignal
    assert (signals.received, signals.count) == (15, 1)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_copies_of_the_first_signal_arriving_together_are_one_request():
    clock = Clock()
    signals = StopSignals(clock=clock)
    signals.handle(signal.SIGTERM, None)
    clock.now += 1.5  # SLURM's copy and a forward, moments apart
    signals.handle(signal.SIGTERM, None)
    assert (signals.received, signals.count, signals.copies) == (signal.SIGTERM, 1, 1)
    clock.now += 5.0  # the same signal long after, with no launcher to forward it: a second request
    with pytest.raises(SecondSignal):
        signals.handle(signal.SIGTERM, None)


def test_under_a_launcher_its_late_forward_is_a_copy_and_the_next_one_a_second_request():
    clock = Clock()
    signals = StopSignals(launcher=True, clock=clock)
    signals.handle(signal.SIGTERM, None)
    clock.now += 30.0  # torchrun's forward, during the save
    signals.handle(signal.SIGTERM, None)
    assert (signals.count, signals.copies) == (1, 1)
    clock.now += 5.0
    with pytest.raises(SecondSignal):
        signals.handle(signal.SIGTERM, None)


def test_another_signal_at_once_and_a_request_without_a_signal_are_never_copies():
    clock = Clock()
    signals = StopSignals(launcher=True, clock=clock)
    signals.handle(signal.SIGTERM, None)
    with pytest.raises(SecondSignal):
        signals.handle(signal.SIGINT, None)
    again = StopSignals(launcher=True, clock=clock)
    again.request(signal.SIGTERM)
    with pytest.raises(SecondSignal):
        again.request(signal.SIGTERM)  # an embedding program asks twice: it means it
