"""The two tiers of the suite (tests/conftest.py): outside a `slow` test no Python child process starts, so
`make test-fast` (`-m "not slow"`) runs in-process only; a `slow` test may start one."""

import subprocess
import sys

import pytest

from tests.conftest import starts_python


def test_python_programs_are_told_from_other_commands():
    assert starts_python([sys.executable, "-c", "pass"])
    assert starts_python(["/venv/bin/pilotrun", "train"])
    assert starts_python(["torchrun", "--nproc-per-node", "2"])
    assert starts_python("python3 -m pilotrun --help")
    assert not starts_python(["git", "rev-parse", "HEAD"])
    assert not starts_python(["/usr/bin/ninja", "-v"])


def test_a_fast_test_cannot_start_a_python_child():
    with pytest.raises(AssertionError, match="not marked slow"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    # other commands are fine
    assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0


def test_a_fast_test_cannot_start_a_multiprocessing_worker():
    import multiprocessing

    with pytest.raises(AssertionError, match="multiprocessing worker"):
        multiprocessing.get_context("spawn").Process(target=print).start()


@pytest.mark.slow
def test_a_slow_test_may_start_one():
    done = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "42"
