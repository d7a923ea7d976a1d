"""The pilot's process tree: every descendant of a training child is found (a worker in a session of its own
included), a zombie counts as exited, and the torchrun command is one node's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pilotrun.commands.pilot_process import descendants, is_alive, torchrun_command


def test_grandchildren_in_their_own_session_are_descendants_and_die_with_the_tree():
    # A child that starts a grandchild in a new session, as torchrun starts its workers.
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
            "print(p.pid, flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        tree = descendants(os.getpid())
        assert child.pid in tree and grandchild in tree
        assert tree.index(child.pid) < tree.index(grandchild)  # children before grandchildren
        assert descendants(child.pid) == [grandchild]
        for pid in [grandchild, child.pid]:
            os.kill(pid, signal.SIGKILL)
        child.wait(timeout=60)
        deadline = time.monotonic() + 60  # a hang guard: init reaps the orphaned grandchild
        while is_alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_alive(child.pid) and not is_alive(grandchild)
    finally:
        for pid in [child.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_an_unreaped_child_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # exited but not waited for: a zombie
        state = open(f"/proc/{child.pid}/stat").read().rpartition(")")[2].split()[0]
        if state == "Z":
            break
        time.sleep(0.02)
    assert not is_alive(child.pid)
    child.wait()
    assert is_alive(os.getpid())


def test_torchrun_runs_pilotrun_on_one_node():
    command = torchrun_command(2)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in command and "--nproc-per-node=2" in command and command[-2:] == ["-m", "pilotrun"]
