"""pilotrun/commands/pilot_process.py: the training tree found by pid and killed at once, even where a
descendant runs in a session of its own (as torchrun's workers do), and the stop signals the pilot passes on.
The real torchrun tree is killed in tests/commands/test_pilot.py."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time

import pytest

from pilotrun.commands import pilot_process
from pilotrun.commands.pilot_process import (
    PilotStopped,
    StopForwarding,
    TrainingChild,
    descendants,
    is_alive,
    wait_until_stopped,
)

# A launcher that starts a worker in a session of its own and waits, as torchrun does.
LAUNCHER = (
    "import subprocess, sys, time\n"
    "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
    "time.sleep(600)\n"
)


def _child(tmp_path, monkeypatch, nproc=None) -> TrainingChild:
    # The launcher stands in for `python -m pilotrun` / torchrun; the tree is what counts.
    monkeypatch.setattr(pilot_process, "torchrun_command", lambda n: [sys.executable, "-c", LAUNCHER])
    return TrainingChild([], tmp_path / "child.log", nproc=nproc)


@pytest.mark.slow
def test_the_whole_tree_dies_at_once_with_a_worker_in_its_own_session(tmp_path, monkeypatch):
    child = _child(tmp_path, monkeypatch, nproc=1)
    try:
        deadline = time.monotonic() + 60  # a hang guard: the worker appears as soon as the launcher runs
        while not child.workers() and time.monotonic() < deadline:
            time.sleep(0.01)
        workers = child.workers()
        assert len(workers) == 1 and descendants(child.pid) == workers
        killed = child.kill_tree()
    finally:
        if child.poll() is None:
            child.process.kill()
    assert set(killed) == {child.pid, *workers}
    assert child.poll() == -signal.SIGKILL
    # the worker too, though killing the launcher spares it
    assert not [pid for pid in killed if is_alive(pid)]


def test_a_stop_with_no_child_running_is_raised_where_the_pilot_stands():
    stops = StopForwarding()
    with pytest.raises(PilotStopped) as raised:
        stops._handle(signal.SIGTERM, None)
    assert (raised.value.signum, stops.exit_code) == (signal.SIGTERM, 143)


@pytest.mark.slow
def test_a_stop_while_a_child_runs_is_passed_on_once_per_signal(tmp_path, monkeypatch):
    sent = []
    child = _child(tmp_path, monkeypatch, nproc=1)
    stops = StopForwarding()
    try:
        deadline = time.monotonic() + 60  # a hang guard
        while not child.workers() and time.monotonic() < deadline:
            time.sleep(0.01)
        with monkeypatch.context() as patch, stops.running(child):
            patch.setattr(pilot_process.os, "kill", lambda pid, signum: sent.append((pid, signum)))
            stops._handle(signal.SIGINT, None)
            stops._handle(signal.SIGINT, None)  # a second Ctrl-C: the child stops at once
        worker = child.workers()[0]
    finally:
        child.kill_tree()
    # To the worker itself, never to the launcher (which would pass it on again), and continued if stopped.
    assert sent == [(worker, signal.SIGINT), (worker, signal.SIGCONT)] * 2 and stops.exit_code == 130


@pytest.mark.slow
def test_a_process_that_exits_is_not_reported_stopped():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert wait_until_stopped(child.pid, timeout_seconds=5) is False


def test_a_hangup_stops_the_pilot_as_the_other_stop_signals_do():
    # A closed terminal (SIGHUP) is one of every command's stop signals (pilotrun/common/stop_signals.py): 128
    # + 1.
    stops = StopForwarding()
    with pytest.raises(PilotStopped) as raised:
        stops._handle(signal.SIGHUP, None)
    assert (raised.value.signum, stops.exit_code, str(raised.value)) == (signal.SIGHUP, 129, "SIGHUP")


@pytest.mark.parametrize(("log", "cause"), [
    ("plan line\npilotrun: error: model.vocab_size (10) is smaller than the data's vocabulary (2048)\n",
     "model.vocab_size (10) is smaller than the data's vocabulary (2048)"),
    ("Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: out of memory\n",
     "RuntimeError: out of memory"),
    ("step 3 loss 5.0\n\n", "step 3 loss 5.0"),
    ("", "it wrote nothing"),
])
def test_a_childs_cause_is_the_one_line_of_its_log_that_says_why(tmp_path, log, cause):
    child = object.__new__(pilot_process.TrainingChild)
    child.log = tmp_path / "train-1.log"
    child.log.write_text(log)
    assert child.cause() == cause


# A pilot that starts its child as the pilot does, says the tree's pids and waits. The child stands in for
# torchrun with one worker in a session of its own that watches its launcher's pid, as pilotrun's workers do
# (the launcher watch); or, with no nproc, for a lone `pilotrun train`.
PILOT = """
import json, os, sys, time
from pathlib import Path
from pilotrun.commands import pilot_process
WORKER = ("import os, sys, time\\n"
          "while os.getppid() == int(sys.argv[1]): time.sleep(0.01)\\n")
LAUNCHER = ("import os, subprocess, sys, time\\n"
            f"w = subprocess.Popen([sys.executable, '-c', {WORKER!r}, str(os.getpid())],"
            " start_new_session=True)\\n"
            "time.sleep(600)\\n")
pilot_process.torchrun_command = lambda n: [sys.executable, "-c", LAUNCHER]
pilot_process.train_command = lambda: [sys.executable, "-c", "import time; time.sleep(600)"]
nproc = int(sys.argv[2]) or None
child = pilot_process.TrainingChild([], Path(sys.argv[1]), nproc=nproc)
deadline = time.monotonic() + 120
while nproc and len(child.tree()) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps(child.tree()), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [0, 1])
def test_every_child_stops_when_the_pilot_is_sigkilled_alone(tmp_path, nproc):
    """SIGKILL of the pilot alone (no handler runs, its children untouched): the kernel's parent-death signal
    stops the child, and under a launcher its worker follows its launcher's death; none is left."""
    import json
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pilot = subprocess.Popen(
        [sys.executable, "-c", PILOT, str(tmp_path / "child.log"), str(nproc)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    tree: list[int] = []
    try:
        tree = json.loads(pilot.stdout.readline())
        assert len(tree) == 1 + nproc and all(is_alive(pid) for pid in tree), tree
        pilot.kill()
        pilot.wait()
        deadline = time.monotonic() + 120  # a hang guard, not a measure: they go as soon as the signal lands
        while any(is_alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not [pid for pid in tree if is_alive(pid)], (tree, (tmp_path / "child.log").read_text())
    finally:
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pilot.kill()


@pytest.mark.slow
def test_a_real_two_rank_pilot_sigkilled_alone_leaves_no_launcher_or_worker(builtin_data_dir, tmp_path):
    """The same with the real tree: `pilotrun pilot --nproc-per-node 2` (torchrun and two workers, each worker
    in a session of its own) SIGKILLed alone while it trains; torchrun gets the parent-death signal and passes
    it on, the workers also watch their launcher, and no process of the tree is left."""
    import json
    import os
    from pathlib import Path

    from pilotrun.run.record import read_metrics_tolerant

    root = Path(__file__).resolve().parents[2]
    workdir = tmp_path / "w"
    command = [
        sys.executable,
        "-m",
        "pilotrun",
        "pilot",
        "--workdir",
        str(workdir),
        "--config",
        "smoke",
        "--data",
        str(builtin_data_dir),
        "--nproc-per-node",
        "2",
        "--set",
        "train.num_threads=1",
        "--set",
        "train.max_steps=5000",
        "--set",
        "optim.schedule.horizon=5000",
        "--interrupt-at",
        "4900",
    ]
    pilot = subprocess.Popen(command, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 240  # a hang guard, not a timing assertion
        run = workdir / "run"
        while time.monotonic() < deadline and pilot.poll() is None:
            if (run / "metrics.jsonl").is_file() and any(
                    e["event"] == "train" for e in read_metrics_tolerant(run).events):
                break
            time.sleep(0.05)
        assert pilot.poll() is None, "the pilot ended before it trained"
        tree = descendants(pilot.pid)
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in tree]
        assert sum("torch.distributed.run" in c or "torchrun" in c for c in commands) == 1, commands
        # the two workers (and torchrun's own argv)
        assert sum(" train " in c for c in commands) >= 2, commands
        pilot.kill()
        pilot.wait()
        deadline = time.monotonic() + 120
        while any(is_alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in tree if is_alive(pid)], json.dumps(commands)
    finally:
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if pilot.poll() is None:
            pilot.kill()
            pilot.wait()
