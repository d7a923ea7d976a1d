"""pilotrun/common/stop_signals.py: one set of stop signals, one exit-code convention, one installer for every
command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pilotrun.common import stop_signals
from pilotrun.common.stop_signals import STOP_SIGNALS, exit_code_of, handling, signal_name

ROOT = Path(__file__).resolve().parents[2]


def test_exit_codes_are_the_documented_ones():
    assert exit_code_of(signal.SIGINT) == 130 and exit_code_of(signal.SIGTERM) == 143
    assert exit_code_of(signal.SIGHUP) == 129  # a closed terminal: honoured like SIGTERM, 128 + 1
    assert exit_code_of(signal.SIGUSR1) == 138 and exit_code_of(signal.SIGUSR2) == 140  # pre-emption warnings
    # not a stop signal: a stop asked under its name ends as SIGTERM
    assert exit_code_of(signal.SIGALRM) == 143
    assert exit_code_of(signal.SIGQUIT, (signal.SIGQUIT,)) == 128 + signal.SIGQUIT  # a command's chosen set
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
    # A signal added to the set (another scheduler's warning) is handled by every command at once.
    monkeypatch.setattr(stop_signals, "STOP_SIGNALS", (*STOP_SIGNALS, signal.SIGALRM))
    before = signal.getsignal(signal.SIGALRM)
    with handling(lambda signum, frame: None):
        assert signal.getsignal(signal.SIGALRM) is not before
    assert signal.getsignal(signal.SIGALRM) is before


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
    code = (
        "import os\nfrom pilotrun.common import stop_signals\nstop_signals.ignored()\n"
        "for signum in stop_signals.STOP_SIGNALS:\n    os.kill(os.getpid(), signum)\nprint('still here')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert (done.returncode, done.stdout) == (0, "still here\n"), done.stderr


def test_signal_names_parse_in_order_without_repeats():
    assert stop_signals.parse_signal_names("SIGUSR1, term,int,SIGUSR1") == (signal.SIGUSR1, signal.SIGTERM,
                                                                            signal.SIGINT)


@pytest.mark.parametrize("text, named", [("SIGNOPE", "SIGNOPE"), ("", "no signal"), (",", "no signal"),
                                         ("SIGKILL", "SIGKILL"), ("SIG_IGN", "SIG_IGN")])
def test_an_unknown_or_unhandleable_signal_name_is_refused_naming_it(text, named):
    with pytest.raises(ValueError, match=named):
        stop_signals.parse_signal_names(text)


def test_handling_a_chosen_set_installs_only_those():
    before = signal.getsignal(signal.SIGUSR2)
    handler = lambda signum, frame: None  # noqa: E731
    with handling(handler, (signal.SIGUSR1,)):
        assert signal.getsignal(signal.SIGUSR1) is handler and signal.getsignal(signal.SIGUSR2) is before
