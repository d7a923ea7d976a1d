"""pilotrun/common/thread_priority.py: the calling thread, and only it, yields the CPU (its nice value is the
process's plus the niceness, capped at 19), and threads it starts inherit it."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from pilotrun.common.thread_priority import BACKGROUND_NICENESS, yield_to_training

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="per-thread nice values are Linux's")


def in_a_thread(work):
    found = {}
    thread = threading.Thread(target=lambda: found.update(work()))
    thread.start()
    thread.join()
    return found


@linux_only
def test_the_calling_thread_yields_and_the_process_does_not():
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())

    def work():
        now = yield_to_training()
        child = in_a_thread(lambda: {"nice": os.getpriority(os.PRIO_PROCESS, threading.get_native_id())})
        again = yield_to_training()  # a second call leaves it where it is: never above base + niceness
        return {"now": now, "child": child["nice"], "again": again}

    found = in_a_thread(work)
    expected = min(19, base + BACKGROUND_NICENESS)
    assert found == {"now": expected, "child": expected, "again": expected}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == base


@linux_only
def test_the_nice_value_is_capped_at_19():
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    assert in_a_thread(lambda: {"nice": yield_to_training(40)})["nice"] == 19 >= base


def test_elsewhere_it_does_nothing(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert yield_to_training() is None


@linux_only
def test_background_work_runs_at_the_lowest_normal_priority():
    """The writer's weight in the process's scheduling group is what it takes from the training loop when
    they compete: at nice 19 (weight 15 against the loop's 1024) the least a normal thread can take."""
    assert in_a_thread(lambda: {"nice": yield_to_training()})["nice"] == 19
