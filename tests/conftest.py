"""Shared fixtures: one intra-op thread for every in-process test, one prepared built-in corpus, and the rule
that makes `make test-fast` fast: a test that starts a pilotrun, torchrun or Python child process is marked
`slow`.

The two tiers: `make test` runs everything (CI); `make test-fast` (`-m "not slow"`) is the inner loop, in-process
tests of a few updates at most. A test is `slow` when it crosses a process boundary on purpose (a signal, a
SIGKILL, torchrun, the console script) or trains for more than a few seconds; the marker is on the test or its
module. The first half of that is checked, not trusted: outside a `slow` test, starting such a child fails the
test, naming what it started.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Children that are themselves a run of Python (pilotrun's console script and torchrun are Python programs). A
# `git` child (the code identity a session records) is a few milliseconds and is not what the rule is about.
PYTHON_PROGRAMS = ("python", "pilotrun", "torchrun")


@pytest.fixture(autouse=True)
def single_intra_op_thread():
    """Bit-exact comparisons need a fixed thread count, and one thread is also the fast choice here: on a
    busy 2-core machine two OpenMP threads made small matmuls up to ~100x slower (measured while building
    the model tests). Subprocess tests choose their threads through the recipe's train.num_threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def starts_python(argv: object) -> bool:
    """Whether a command line (a list, or a shell string) runs Python or one of pilotrun's Python programs."""
    first = argv[0] if isinstance(argv, list | tuple) and argv else argv
    words = str(first).split() if isinstance(first, str) else [str(first)]
    name = Path(words[0]).name if words else ""
    return str(first) == sys.executable or any(name.startswith(program) for program in PYTHON_PROGRAMS)


@pytest.fixture(autouse=True)
def child_processes_only_in_slow_tests(request, monkeypatch):
    """Outside a `slow` test, starting a Python child process (subprocess or multiprocessing) fails the test."""
    if request.node.get_closest_marker("slow"):
        return
    real_init = subprocess.Popen.__init__
    test = request.node.nodeid

    def refuse_python_children(self, args, *rest, **options):
        if starts_python(args):
            raise AssertionError(f"{test} starts a child process ({str(args)[:120]}) but is not marked slow: mark "
                                 "it @pytest.mark.slow (make test-fast runs no child process)")
        return real_init(self, args, *rest, **options)

    def refuse_process_start(self):
        raise AssertionError(f"{test} starts a multiprocessing worker but is not marked slow: mark it "
                             "@pytest.mark.slow (make test-fast runs no child process)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse_python_children)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse_process_start)


@pytest.fixture(scope="session")
def builtin_data_dir(tmp_path_factory):
    """The built-in offline corpus prepared with the default byte-level BPE (4,096 tokens): read-only for tests."""
    from pilotrun.data.prepare import prepare_corpus

    out = tmp_path_factory.mktemp("data") / "builtin"
    prepare_corpus(out, source="builtin", tokenizer="bpe:4096", progress=False)
    return out
