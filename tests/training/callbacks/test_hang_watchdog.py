"""The hang watchdog's bounds, its progress points, and what it does when one is passed (a fake clock and
exit), plus its own thread firing on a real stall (no wall-clock assertion: the test waits for the exit it
injects)."""

from __future__ import annotations

import datetime
import os
import threading
import types

import pytest

from pilotrun.common.stop_signals import HUNG_EXIT_CODE
from pilotrun.run.record import HANGS_DIR
from pilotrun.training.callbacks.hang_watchdog import (
    FLOOR_SECONDS,
    MULTIPLE,
    STARTUP_SECONDS,
    HangBounds,
    HangWatchdog,
    hang_file_name,
    parse_hang_timeout,
    peer_hangs,
    thread_stacks,
)
from pilotrun.training.timing import TimeAccount


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


WHEN = datetime.datetime(2026, 12, 3, 23, 0, 5, tzinfo=datetime.UTC)


def watchdog(tmp_path, bounds=None, rank=0):
    clock, exits = Clock(), []
    dog = HangWatchdog(
        bounds or HangBounds(),
        tmp_path / "run",
        rank,
        clock=clock,
        exit=exits.append,
        now=lambda: WHEN,
        sleep=lambda seconds: None,
        out=types.SimpleNamespace(write=lambda text: None, flush=lambda: None),
    )
    return dog, clock, exits


def test_parse_auto_off_and_fixed_bounds():
    assert parse_hang_timeout("auto") == HangBounds(None, STARTUP_SECONDS)
    assert parse_hang_timeout("OFF") is None
    assert parse_hang_timeout("90") == HangBounds(90.0, STARTUP_SECONDS)
    assert parse_hang_timeout("10m,1h") == HangBounds(600.0, 3600.0)
    # the start-up bound is never below the steady one
    assert parse_hang_timeout("2h") == HangBounds(7200.0, 7200.0)
    assert parse_hang_timeout("1h,10m") == HangBounds(3600.0, 3600.0)


@pytest.mark.parametrize("text", ["0", "-5", "soon", "1,2,3", "inf", "nan", "10m,", ""])
def test_bad_bounds_name_what(text):
    with pytest.raises(ValueError, match="--hang-timeout"):
        parse_hang_timeout(text)


def test_a_derived_bound_is_a_multiple_of_the_measured_between_a_floor_and_the_startup_bound():
    auto = HangBounds()
    assert auto.bound(None) == STARTUP_SECONDS
    assert auto.bound(0.1) == FLOOR_SECONDS
    assert auto.bound(60.0) == MULTIPLE * 60.0
    assert auto.bound(10_000.0) == STARTUP_SECONDS
    fixed = HangBounds(20.0, 600.0)
    assert fixed.bound(None) == 600.0 and fixed.bound(0.1) == fixed.bound(1e6) == 20.0


def test_the_process_group_timeout_exceeds_every_bound_the_watchdog_can_use():
    assert HangBounds().process_group_seconds() == STARTUP_SECONDS + 0.1 * STARTUP_SECONDS
    assert HangBounds(20.0, 100.0).process_group_seconds() == 160.0  # a minute's margin at least
    for bounds in (HangBounds(), HangBounds(20.0, 100.0), HangBounds(5000.0, 5000.0)):
        assert all(bounds.process_group_seconds() > bounds.bound(m) for m in (None, 0.0, 1.0, 1e9))


def test_the_first_stretch_of_each_kind_is_not_measured_and_gets_the_startup_bound(tmp_path):
    dog, clock, _ = watchdog(tmp_path)
    for seconds in (40.0, 50.0, 2.0, 1.0, 3.0):  # start-up, the first update, a round, then update and round
        clock.now += seconds
        dog.beat("update" if dog.kind != "update" else "other")
    assert dog.measured == {"update": 1.0, "other": 3.0}
    assert dog.kind == "update" and dog.bound()[2] == FLOOR_SECONDS
    dog.beat("checkpoint")
    assert dog.bound()[2] == STARTUP_SECONDS  # no save measured yet: the first one may pay a warm-up


def test_evaluations_and_saves_are_progress_points_through_the_time_account(tmp_path):
    dog, clock, _ = watchdog(tmp_path)
    account = TimeAccount(clock=clock)
    dog.attach(types.SimpleNamespace(account=account, step=7))
    account.switch("train")
    dog.beat("update")
    clock.now += 1.0
    dog.beat("other")
    with account.phase("eval"):
        assert dog.kind == "eval"
        clock.now += 5.0
        with account.phase("report"):
            assert dog.kind == "eval"  # logging inside an evaluation is still the evaluation
    assert dog.kind == "other"
    with account.phase("checkpoint"):
        assert dog.kind == "checkpoint"
    assert dog.kind == "other" and dog.first_seen >= {"update", "eval", "checkpoint"}
    dog.at_end(types.SimpleNamespace(account=account))
    assert dog.kind == "teardown" and account.listeners == []


def test_past_its_bound_it_writes_every_stack_records_the_hang_and_exits_with_its_code(tmp_path):
    dog, clock, exits = watchdog(tmp_path, HangBounds(20.0, 600.0), rank=1)
    recorded = []
    dog.on_hang = recorded.append
    dog.step = lambda: 42
    for _ in range(3):
        dog.beat("update")
        clock.now += 1.0
        dog.beat("other")
    dog.beat("update")
    clock.now += 20.0
    assert not dog.check() and exits == []  # at the bound, not past it
    clock.now += 0.5
    assert dog.check() and exits == [HUNG_EXIT_CODE]
    path = tmp_path / "run" / HANGS_DIR / hang_file_name(1, WHEN)
    assert path.name == "20261203T230005Z-rank1.txt" and dog.fired == str(path)
    text = path.read_text()
    assert text.startswith("pilotrun hang: rank 1") and "in update" in text and "step 42" in text
    assert "Thread MainThread" in text and "test_past_its_bound_it_writes_every_stack" in text
    assert len(recorded) == 1 and "no progress for 20 s in update after step 42" in recorded[0]
    assert str(path) in recorded[0]
    assert not dog.check() and exits == [HUNG_EXIT_CODE]  # once


def test_a_record_that_fails_is_said_and_the_exit_still_comes(tmp_path, capsys):
    dog, clock, exits = watchdog(tmp_path, HangBounds(5.0, 5.0))

    def broken(message):
        raise OSError("disk gone")

    dog.on_hang = broken
    clock.now += 6.0
    assert dog.check() and exits == [HUNG_EXIT_CODE]
    assert "the record could not be ended: OSError: disk gone" in capsys.readouterr().err


def test_its_thread_fires_on_a_stalled_main_thread(tmp_path):
    exited, release = [], threading.Event()

    def exit_(code):
        exited.append(code)
        release.set()

    dog = HangWatchdog(HangBounds(0.2, 0.2), tmp_path / "run", 0, exit=exit_, poll_seconds=0.02,
                       out=types.SimpleNamespace(write=lambda text: None, flush=lambda: None)).start()
    dog.beat("update")
    assert release.wait(60)  # the stall: nothing beats until the watchdog has fired
    dog.stop()
    assert exited == [HUNG_EXIT_CODE]
    (stack_file,) = (tmp_path / "run" / HANGS_DIR).iterdir()
    assert "release.wait" in stack_file.read_text()


def test_stacks_name_every_thread():
    ready, done = threading.Event(), threading.Event()

    def parked():
        ready.set()
        done.wait()

    thread = threading.Thread(target=parked, name="parked-helper")
    thread.start()
    ready.wait()
    try:
        text = thread_stacks()
    finally:
        done.set()
        thread.join()
    assert "Thread parked-helper, id" in text and "in parked" in text and "Thread MainThread" in text


def test_a_peer_hang_is_another_rank_s_stack_file_written_since_the_session_began(tmp_path):
    folder = tmp_path / HANGS_DIR
    assert peer_hangs(tmp_path, 0.0, 0) == []
    folder.mkdir()
    for name, mtime in (("a-rank0.txt", 2000.0), ("a-rank1.txt", 2000.0), ("old-rank2.txt", 500.0)):
        (folder / name).write_text("stacks")
        os.utime(folder / name, (mtime, mtime))
    assert peer_hangs(tmp_path, 1000.0, 0) == [folder / "a-rank1.txt"]
    assert peer_hangs(tmp_path, 1000.0, 1) == [folder / "a-rank0.txt"]
