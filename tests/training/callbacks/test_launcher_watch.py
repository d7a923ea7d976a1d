"""pilotrun/training/callbacks/launcher_watch.py: a rank whose torchrun launcher is gone stops at the next
update, checkpointed.

The callback alone (fast): a parent that is not the recorded launcher asks for an "interrupted" ending naming
the launcher and the step; the parent-death signal only sets a flag, and a flag whose parent is still the
launcher is no loss. Then the kernel's side in real processes, and the whole story under torchrun (slow): the
launcher alone SIGKILLed mid-run, both workers checkpoint, record "interrupted", release the lock and exit; a
`--resume` under a new torchrun ends with the weights of an uninterrupted run, bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.run.folder_lock import live_holder
from pilotrun.training.callbacks.launcher_watch import (
    EXIT_CODE,
    PARENT_DEATH_SIGNAL,
    PR_SET_PDEATHSIG,
    LauncherWatchCallback,
    run_by_torchrun,
)
from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer
from tests.training.test_distributed_trainer import (
    _descendants,
    _env,
    _events,
    _final_weights,
    _losses_by_step,
    _run,
    _train_command,
)

ROOT = Path(__file__).resolve().parents[3]
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux") or PARENT_DEATH_SIGNAL is None,
                                reason="PR_SET_PDEATHSIG is Linux's")


def _loop(step: int = 7) -> SimpleNamespace:
    return SimpleNamespace(step=step)


class FakePrctl:
    def __init__(self, result: int = 0) -> None:
        self.calls: list[tuple[int, ...]] = []
        self.result = result

    def __call__(self, *args: int) -> int:
        self.calls.append(args)
        return self.result


def test_a_parent_that_is_not_the_launcher_asks_for_an_interrupted_ending_naming_it() -> None:
    not_the_parent = os.getppid() + 100_000
    ending = LauncherWatchCallback(not_the_parent).stop_request(_loop(step=7))
    assert ending is not None
    assert (ending.reason, ending.exit_code) == ("interrupted", EXIT_CODE) == ("interrupted", 143)
    assert f"launcher (pid {not_the_parent}) is gone" in ending.message
    assert f"now {os.getppid()}" in ending.message and "saved checkpoint step 7" in ending.message


def test_the_launcher_still_there_or_none_recorded_asks_nothing() -> None:
    assert LauncherWatchCallback(os.getppid()).stop_request(_loop()) is None
    assert LauncherWatchCallback(None).stop_request(_loop()) is None


def test_the_parent_changing_after_start_is_seen_at_the_next_check() -> None:
    parent = [41]
    watch = LauncherWatchCallback(41, parent_pid=lambda: parent[0])
    assert watch.stop_request(_loop(3)) is None
    parent[0] = 1  # the launcher died: its orphans are adopted by init
    ending = watch.stop_request(_loop(4))
    assert ending is not None and "(pid 41)" in ending.message and "now 1" in ending.message


def test_only_torchruns_elastic_agent_counts_as_a_launcher() -> None:
    assert run_by_torchrun(TORCHRUN_ENV)
    assert not run_by_torchrun({k: v for k, v in TORCHRUN_ENV.items() if k != "TORCHELASTIC_RUN_ID"})
    assert not run_by_torchrun({"TORCHELASTIC_RUN_ID": "x"})
    assert LauncherWatchCallback.for_process({}).launcher_pid is None  # a plain process watches nothing


def test_a_signal_flag_while_the_launcher_is_still_the_parent_is_ignored_and_counted() -> None:
    watch = LauncherWatchCallback(os.getppid())
    watch._handle(0, None)  # the thread that started the worker ended, or another sender
    assert watch.stop_request(_loop()) is None
    assert (watch.signalled, watch.ignored_signals) == (False, 1)


@linux_only
def test_arming_installs_the_flag_handler_before_the_request_and_disarming_withdraws_it_first() -> None:
    before = signal.getsignal(PARENT_DEATH_SIGNAL)
    prctl = FakePrctl()
    watch = LauncherWatchCallback(os.getppid(), prctl=prctl)
    assert watch.arm()
    try:
        assert prctl.calls == [(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)]
        assert signal.getsignal(PARENT_DEATH_SIGNAL) == watch._handle
        os.kill(os.getpid(), PARENT_DEATH_SIGNAL)  # a real delivery: the handler sets the flag, nothing else
        time.sleep(0)  # a bytecode boundary: the main thread runs the Python-level handler
        assert watch.signalled
    finally:
        watch.at_end(_loop())
    assert prctl.calls[-1] == (PR_SET_PDEATHSIG, 0, 0, 0, 0)
    assert signal.getsignal(PARENT_DEATH_SIGNAL) == before
    watch.at_end(_loop())
    assert len(prctl.calls) == 2  # disarming twice does nothing more


@linux_only
def test_a_refused_request_or_a_taken_signal_leaves_only_the_pid_comparison() -> None:
    before = signal.getsignal(PARENT_DEATH_SIGNAL)
    assert not LauncherWatchCallback(os.getppid(), prctl=FakePrctl(result=-1)).arm()
    assert signal.getsignal(PARENT_DEATH_SIGNAL) == before
    assert not LauncherWatchCallback(os.getppid(), prctl=None).arm()
    previous = signal.signal(PARENT_DEATH_SIGNAL, lambda signum, frame: None)
    try:
        prctl = FakePrctl()
        assert not LauncherWatchCallback(os.getppid(), prctl=prctl).arm() and prctl.calls == []
    finally:
        signal.signal(PARENT_DEATH_SIGNAL, previous)


# The kernel's side: a middle process starts a watcher and is SIGKILLed; the watcher, armed with the real
# prctl, reports what it saw. The watcher waits on a pipe, not a clock: it is told when to look.
WATCHER = textwrap.dedent("""
    import json, os, sys
    from pilotrun.training.callbacks.launcher_watch import LauncherWatchCallback, _prctl
    watch = LauncherWatchCallback(os.getppid(), prctl=_prctl())
    armed = watch.arm()
    print("armed", flush=True)
    sys.stdin.readline()  # the test writes a line once the middle process is dead
    ending = watch.stop_request(type("Loop", (), {"step": 5})())
    print(json.dumps({"armed": armed, "signalled": watch.signalled, "message": ending and ending.message}),
          flush=True)
""")
MIDDLE = textwrap.dedent("""
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=0, stdout=1)
    print(child.pid, flush=True)
    child.wait()
""")


@pytest.mark.slow
@linux_only
def test_the_kernels_parent_death_signal_reaches_the_flag_when_the_parent_is_killed() -> None:
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, WATCHER], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        int(middle.stdout.readline())
        assert middle.stdout.readline().strip() == "armed"
        middle.kill()
        middle.wait(60)
        middle.stdin.write("look\n")
        middle.stdin.flush()
        seen = json.loads(middle.stdout.readline())
    finally:
        middle.kill()
        middle.stdin.close()  # a watcher still waiting reads the end of its input and exits
    assert seen["armed"] and seen["signalled"]
    assert (
        f"launcher (pid {middle.pid}) is gone (seen by parent-death signal and parent pid" in seen["message"]
    )


# ---------------------------------------------------------------------------------------------- under
# torchrun
# the update takes ~0.15 s on a free core: the kill lands well before the end even on a fast machine
STEPS = 40


def _recipe(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return _train_command(data, run_dir, 2, 2, "--set", f"train.max_steps={STEPS}", "--set",
                          f"optim.schedule.horizon={STEPS}", "--set", "train.checkpoint_every=0", *extra)


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (/proc/PID/stat field 22), or None once it is gone or a zombie
    (an orphan's zombie waits for whoever adopted it): with the pid it names one process, even if the pid is
    reused later."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _train_events_logged(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_text().count('"event":"train"')
    except FileNotFoundError:
        return 0


def _kill_the_launcher_alone(launcher: subprocess.Popen, run_dir: Path, log_path: Path) -> None:
    """Once a train event is logged, SIGKILL the launcher and wait until every worker has exited (a hang
    guard: workers still running after 180 s dump their stacks into the log and the test fails with them)."""
    workers: dict[int, str | None] = {}
    try:
        deadline = time.monotonic() + 240
        while _train_events_logged(run_dir) == 0 and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _train_events_logged(run_dir) > 0, log_path.read_text()[-3000:]
        workers = {pid: _start_time(pid) for pid in _descendants(launcher.pid)}
        assert len(workers) >= 2, workers
        # the launcher alone: torchrun's workers are in sessions of their own
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(30)
        deadline = time.monotonic() + 180
        alive = list(workers)
        while alive and time.monotonic() < deadline:
            alive = [
                pid for pid, started in workers.items() if started is not None and _start_time(pid) == started
            ]
            time.sleep(0.05)
        if alive:
            for pid in alive:
                os.kill(pid, signal.SIGABRT)  # faulthandler writes each one's Python stacks into the log
            time.sleep(5)
            pytest.fail(f"workers {alive} still running 180 s after the launcher died:\n"
                        f"{log_path.read_text()[-12000:]}")
    finally:
        for pid, started in workers.items():
            if started is not None and _start_time(pid) == started:
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.slow
@linux_only
def test_workers_checkpoint_and_exit_when_the_launcher_alone_is_killed_and_resume_bit_for_bit(
        builtin_data_dir: Path, tmp_path: Path) -> None:
    straight_dir, run_dir = tmp_path / "straight", tmp_path / "orphaned"
    straight = subprocess.Popen(_recipe(builtin_data_dir, straight_dir), cwd=ROOT, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log_path = tmp_path / "orphaned.log"
    try:
        with open(log_path, "w") as log:  # the workers inherit the launcher's output: a file outlives it
            launcher = subprocess.Popen(_recipe(builtin_data_dir, run_dir), cwd=ROOT, stdout=log,
                                        stderr=subprocess.STDOUT, env=_env({"PYTHONFAULTHANDLER": "1"}))
        _kill_the_launcher_alone(launcher, run_dir, log_path)
    except BaseException:
        straight.kill()
        raise
    _, stderr = straight.communicate(timeout=300)
    assert straight.returncode == 0, stderr[-3000:]

    events = _events(run_dir)
    end = events[-1]
    stopped = end["step"]
    assert stopped < STEPS, "the run ended before the launcher was killed"
    assert end["event"] == "session_end" and end["reason"] == "interrupted" and stopped >= 1, end
    assert f"torchrun launcher (pid {launcher.pid}) is gone" in end["message"]
    assert f"saved checkpoint step {stopped}" in end["message"]
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [stopped]
    assert DistributedCheckpointer(run_dir, keep=5).committed_steps() == [stopped]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["sessions"][-1]["end_reason"] == "interrupted"
    assert live_holder(run_dir) is None  # the lock went with the session

    resumed = _run(_recipe(builtin_data_dir, run_dir, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference, after = _losses_by_step(straight_dir), _losses_by_step(run_dir, session=-1)
    assert sorted(after) == list(range(stopped + 1, STEPS + 1))
    assert all(after[step] == reference[step] for step in after)  # exact float equality
    straight_weights, resumed_weights = _final_weights(straight_dir), _final_weights(run_dir)
    assert straight_weights.keys() == resumed_weights.keys()
    for name, value in straight_weights.items():
        assert torch.equal(value, resumed_weights[name]), name
    summary = summarize_run(run_dir, require_step=STEPS)
    assert summary.valid, summary.reasons
