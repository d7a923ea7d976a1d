"""Shared fixtures: one intra-op thread for every in-process test, one prepared built-in corpus, and the rule
that makes `make test-fast` fast: a test that starts a pilotrun, torchrun or Python child process is marked
`slow`.

The two tiers: `make test` runs everything (CI); `make test-fast` (`-m "not slow"`) is the inner loop,
in-process tests of a few updates at most. A test is `slow` when it crosses a process boundary on purpose (a
signal, a SIGKILL, torchrun, the console script) or trains for more than a few seconds; the marker is on the
test or its module. The first half of that is checked, not trusted: outside a `slow` test, starting such a
child fails the test, naming what it started, also when a fixture the test needs starts it.
"""

from __future__ import annotations

import json
import multiprocessing.process
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# The shared test fixtures (the FineWeb-Edu documents, the GPT-2 tokenizer) live beside the clone, not in it.
# A test needs them when it uses one of these fixtures (directly or through another fixture), or is marked
# `shared_fixtures` (it reads them itself); without the folder each such test skips.
SHARED_FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
SHARED_FIXTURE_USERS = frozenset(
    {"mixture_sources", "task_run", "fineweb_jsonl", "fineweb_parquet", "gpt2_tokenizer_path"}
)


def needs_shared_fixtures(item) -> bool:
    """Whether a collected test needs ../shared/fixtures: a fixture that reads them in its closure, or the
    `shared_fixtures` mark."""
    used = set(getattr(item, "fixturenames", ()))
    return bool(used & SHARED_FIXTURE_USERS) or item.get_closest_marker("shared_fixtures") is not None


def shared_fixtures_line(items, folder: Path = SHARED_FIXTURES) -> str:
    """The session's header line on the shared fixtures, printed right after collection (before any test
    runs), so that a missing folder is said up front and not only by the skips at the end."""
    needing = sum(1 for item in items if needs_shared_fixtures(item))
    if folder.is_dir():
        return f"shared fixtures: {folder} is present ({needing} of the {len(items)} collected tests use it)"
    return (f"shared fixtures: MISSING {folder} (../shared/fixtures beside the clone): {needing} of the "
            f"{len(items)} collected tests need it and will skip")


def pytest_report_collectionfinish(config, start_path, items):
    return [shared_fixtures_line(items)]


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


# The test being set up, run or torn down: a child started by a fixture (a module's shared run) counts against
# the test that needed the fixture, since that test is what would make test-fast start it.
RUNNING: dict[str, pytest.Item | None] = {"item": None}


def refusal(kind: str, what: str) -> str | None:
    """Why the running test may not start this child, or None when it may."""
    item = RUNNING["item"]
    if item is None or item.get_closest_marker("slow"):
        return None
    return (f"{item.nodeid} starts {kind} ({what[:120]}) but is not marked slow: mark it @pytest.mark.slow "
            "(make test-fast runs no child process)")


def pytest_configure(config):
    real_init = subprocess.Popen.__init__
    real_start = multiprocessing.process.BaseProcess.start

    def checked_init(self, args, *rest, **options):
        why = refusal("a child process", str(args)) if starts_python(args) else None
        if why:
            raise AssertionError(why)
        return real_init(self, args, *rest, **options)

    def checked_start(self):
        why = refusal("a multiprocessing worker", repr(self))
        if why:
            raise AssertionError(why)
        return real_start(self)

    subprocess.Popen.__init__ = checked_init
    multiprocessing.process.BaseProcess.start = checked_start


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    RUNNING["item"] = item


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    RUNNING["item"] = nextitem  # a module fixture torn down here belongs to the tests that used it


@pytest.fixture(scope="session")
def builtin_data_dir(tmp_path_factory):
    """The built-in offline corpus prepared with the default byte-level BPE (4,096 tokens): read-only for
    tests."""
    from pilotrun.data.prepare import prepare_corpus

    out = tmp_path_factory.mktemp("data") / "builtin"
    prepare_corpus(out, source="builtin", tokenizer="bpe:4096", progress=False)
    return out


@pytest.fixture(scope="session")
def mixture_sources(tmp_path_factory):
    """Prepared folders for data mixtures (read-only for tests): `builtin` (the built-in corpus, its own
    512-token BPE), `edu` (the FineWeb-Edu fixture, prepared with builtin's tokenizer.json: one tokenizer file
    for both), `tiny` (a few lines of text, the same tokenizer: a source too small for its weight) and `other`
    (the built-in corpus under another vocabulary)."""
    from pilotrun.data.prepare import prepare_corpus

    fineweb = SHARED_FIXTURES / "fineweb-edu" / "fineweb_edu_sample10bt_150docs.jsonl"
    if not fineweb.exists():
        pytest.skip(
            f"shared test fixture {fineweb} is absent (expected ../shared/fixtures beside the repository)"
        )
    root = tmp_path_factory.mktemp("mixture_sources")
    prepare_corpus(
        root / "builtin",
        source="builtin",
        tokenizer="bpe:512",
        train_tokens=20_000,
        val_fraction=0.05,
        workers=1,
        progress=False,
    )
    tokenizer = str(root / "builtin" / "tokenizer.json")
    prepare_corpus(
        root / "edu",
        source=str(fineweb),
        tokenizer=tokenizer,
        train_tokens=40_000,
        val_fraction=0.1,
        workers=1,
        progress=False,
    )
    lines = root / "tiny.jsonl"
    lines.write_text(
        "".join(
            json.dumps({"text": f"Line {i} of a very small source about the river and the mill."}) + "\n"
            for i in range(40)
        )
    )
    prepare_corpus(
        root / "tiny", source=str(lines), tokenizer=tokenizer, val_fraction=0.3, workers=1, progress=False
    )
    prepare_corpus(
        root / "other",
        source="builtin",
        tokenizer="bpe:300",
        train_tokens=5_000,
        val_fraction=0.05,
        workers=1,
        progress=False,
    )
    return {name: root / name for name in ("builtin", "edu", "tiny", "other")}


def write_mixture(path, entries, seed=None):
    """A mixture file at `path`: entries are (folder, weight) pairs."""
    lines = ["mixture:"] + [f"  - {{path: {folder}, weight: {weight}}}" for folder, weight in entries]
    if seed is not None:
        lines.append(f"seed: {seed}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def task_run(tmp_path_factory):
    """A run that learned the FineWeb-Edu multiple-choice task (tests/choice_task_fixture.py): 40 updates, the
    task scored in the loop and a checkpoint committed at steps 20 and 40. (data, task file, run folder):
    read-only for tests (copy the run folder to change it)."""
    from tests.choice_task_fixture import fineweb_task, prepare_fineweb, train_task_run

    root = tmp_path_factory.mktemp("task-run")
    data, task = prepare_fineweb(root / "data"), fineweb_task(root / "tasks")
    return data, task, train_task_run(data, task, root / "run")
