"""pilotrun/stop_signals.py: one set of stop signals, one exit-code convention, one installer for every command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pilotrun import stop_signals
from pilotrun.stop_signals import STOP_SIGNALS, exit_code_of, handling, signal_name

ROOT = Path(__file__).resolve().parents[1]


def test_exit_codes_are_the_documented_ones():
    assert exit_code_of(signal.SIGINT) == 130 and exit_code_of(signal.SIGTERM) == 143
    assert exit_code_of(signal.SIGHUP) == 129  # a closed terminal: honoured like SIGTERM, 128 + 1
    assert exit_code_of(signal.SIGUSR1) == 143  # not a stop signal: a stop asked under its name ends as SIGTERM
    assert all(exit_code_of(s) == 128 + s for s in STOP_SIGNALS)
    assert signal_name(signal.SIGINT) == "SIGINT"


def test_every_stop_signal_is_handled_for_the_block_and_the_previous_handlers_restored():
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    heard = []
    handler = lambda signum, frame: heard.append(signum)  # noqa: E731
    with handling(handler):
        assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == {s: handler for s in STOP_SIGNALS}
        for signum in STOP_SIGNALS:
            os.kill(os.getpid(), signum)  # the real signal
    assert heard == list(STOP_SIGNALS)
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before


def test_the_set_is_one_tuple_that_every_installer_reads(monkeypatch):
    # A signal added to the set (a scheduler's pre-emption warning) is handled by every command at once.
    monkeypatch.setattr(stop_signals, "STOP_SIGNALS", (*STOP_SIGNALS, signal.SIGUSR1))
    before = signal.getsignal(signal.SIGUSR1)
    with handling(lambda signum, frame: None):
        assert signal.getsignal(signal.SIGUSR1) is not before
    assert signal.getsignal(signal.SIGUSR1) is before


def test_outside_the_main_thread_nothing_is_installed():
    before = signal.getsignal(signal.SIGHUP)
    seen = []

    def body():
        with handling(lambda signum, frame: None):
            seen.append(signal.getsignal(signal.SIGHUP))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [before]


@pytest.mark.slow
def test_a_worker_ignores_every_stop_signal():
    code = ("import os\nfrom pilotrun import stop_signals\nstop_signals.ignored()\n"
            "for signum in stop_signals.STOP_SIGNALS:\n    os.kill(os.getpid(), signum)\nprint('still here')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert (done.returncode, done.stdout) == (0, "still here\n"), done.stderr
