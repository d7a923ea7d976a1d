"""bench_background_checkpoint's throughput goal: judged on the median of the rounds' ratios (each round its
own steady pair, so that one round the shared machine's load swung does not decide it), and the loop's time
per update split into CPU, run-queue wait and the rest (blocked: the GIL), from the kernel's per-thread
counters; the whole-save goal held by every adjacent pair, each listed with its load; the blocking goal read
on the median of the pairs, with where the wait went."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from benchmarks import bench_background_checkpoint as bench


def rounds(*ratios: list[float]) -> dict:
    """Found by the benchmark: per round, pairs of windows at a steady 20 updates/s with the write paused."""
    count = len(ratios)
    pairs = [[(20.0, 20.0 * ratio, None, None) for ratio in round_ratios] for round_ratios in ratios]
    control = [[(20.0, 19.8, None, None), (20.0, 20.2, None, None), (20.0, 20.0, None, None)]] * count
    return {"pairs": pairs, "write": [2.0] * count, "lost": [0.5] * count,
            "saves": [{"sync": {"total": 3.0}}] * count, "control": control}


def test_the_goal_reads_the_median_of_every_pairs_ratio_not_the_worst():
    one_swung_pair = bench._throughput_goal(rounds([0.5, 0.96, 0.97], [0.99, 0.95]))
    assert "the median of the ratios of 5 pairs" in one_swung_pair
    assert "**met** (96.0%; per round 96.0%, 97.0%;" in one_swung_pair
    below = bench._throughput_goal(rounds([0.99, 0.90, 0.94]))
    assert "**NOT met** (94.0%; per round 94.0%;" in below
    assert "the background one cheaper in 1 of 1 rounds" in below
    assert "the loop keeps 100.0% (median of 3 pairs" in below  # the control, the same bytes GIL-free


def save_pair(sync: float, background: float, blocking: float, load: float, first: str) -> dict:
    return {"load": load, "order": (first, "background" if first == "sync" else "sync"), "alone": 0.8,
            "sync": {"total": sync, "cpu": 2.0, "fsync": 0.5},
            "background": {"total": background, "blocking": blocking, "called": blocking / 2,
                           "held": blocking / 4, "commit": blocking / 4, "beside": 0.9, "cpu": 2.5,
                           "fsync": 1.5}}


def test_the_whole_save_goal_holds_every_pair_and_lists_each_with_its_load():
    saves = [save_pair(3.0, 3.3, 0.03, 2.5, "sync"), save_pair(2.0, 2.8, 0.02, 6.1, "background"),
             save_pair(4.0, 4.0, 0.04, 3.0, "sync")]
    text = bench._whole_goal(saves)
    assert "**NOT met** (median 1.10x, 1.00x-1.40x;" in text  # one pair of three above 1.3x decides it
    assert "1.40x (load 6.1, background first; CPU 2.0 / 2.5, fsync 0.5 / 1.5)" in text
    assert "**met**" in bench._whole_goal([saves[0], saves[2]])


def test_the_blocking_goal_reads_the_saves_beside_the_next_update_and_where_the_wait_went():
    saves = [save_pair(3.0, 3.3, 0.3, 2.5, "sync"), save_pair(2.0, 2.8, 0.2, 6.1, "background"),
             save_pair(4.0, 4.0, 0.4, 3.0, "sync")]  # the pairs' sync median: 3.0 s
    beside = [{**save_pair(0, 0, blocking, 0, "sync")["background"], "alone": 0.8, "load": load}
              for blocking, load in ((0.03, 4.0), (0.3, 5.0), (0.09, 6.0))]
    text = bench._blocking_goal({"saves": saves, "overlapped": beside, "stable_bytes": 900_000_000})
    assert "the median of 3 saves each followed by" in text
    assert "**met** (0.030x; each 0.010x, 0.100x, 0.030x)" in text
    assert "the wait for the staging thread's copy of those (900.0 MB)" in text
    assert "took 0.900 s beside the copy and 0.800 s alone right after (load 4.0, 5.0, 6.0)" in text
    assert "stepped at once (nothing to hide the copy behind) would wait 0.100x" in text
    assert "**NOT met** (0.100x" in bench._blocking_goal({"saves": saves, "overlapped": beside[1:2],
                                                          "stable_bytes": 1})


def test_the_control_gathers_every_tensor_of_the_state_whatever_its_dtype():
    import torch

    state = {"model": {"w": torch.ones(2, 3), "h": torch.zeros(4, dtype=torch.bfloat16)},
             "optimizer": [torch.tensor(7), {"step": 3}], "trainer": {"step": 1}}
    found = bench._tensors(state)
    assert [tuple(t.shape) for t in found] == [(2, 3), (4,), ()]
    assert sum(t.reshape(-1).view(torch.uint8).numel() for t in found) == 24 + 8 + 8


def test_the_write_gate_holds_the_writer_between_pieces_and_lets_every_byte_through():
    written: list[bytes] = []
    gate = bench._WriteGate()
    gate.PIECE = 4
    gated = gate.wrapping(lambda stream, data: written.append(bytes(data)) or len(data))
    assert gated(None, b"0123456789") == 10
    assert written == [b"0123", b"4567", b"89"] and gate.inside == 0
    held: list[bool] = []

    class NotedEvent(threading.Event):
        def wait(self, timeout=None):
            held.append(not self.is_set())
            return super().wait(timeout)

    gate.open = NotedEvent()  # closed: a fresh event is clear
    finished = threading.Event()
    writer = threading.Thread(target=lambda: gated(None, b"abc") and finished.set())
    writer.start()
    while not held:  # the writer reached the gate
        time.sleep(0.01)
    assert held == [True] and written[-1] == b"89" and not finished.is_set()
    gate.open.set()
    writer.join()
    assert finished.is_set() and written[-1] == b"abc"


def test_the_loops_time_per_update_is_split_into_cpu_run_queue_wait_and_blocked():
    assert bench._per_update((1.0, 2.0, 3.0), (11.0, 6.0, 8.0), 4) == (1000.0, 1250.0, 250.0)
    assert bench._per_update(None, (11.0, 6.0, 8.0), 4) is None
    assert bench._per_update((1.0, 2.0, 3.0), (11.0, 6.0, 8.0), 0) is None
    assert bench._split_text([(20.0, 10.0, 1.0), (24.0, 30.0, 3.0), None]) == \
        "CPU 22.0, run-queue wait 20.0, blocked 2.0"
    assert bench._split_text([None, None]) == "not measured (no per-thread schedstat here)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread schedstat is Linux's")
def test_the_calling_threads_own_counters_are_read():
    first = bench._loop_thread_times()
    sum(i * i for i in range(200_000))  # some CPU time of this thread
    second = bench._loop_thread_times()
    assert first is not None and second is not None
    assert second[0] > first[0] and second[1] > first[1] and second[2] >= first[2]


def test_the_fsync_clock_counts_the_time_inside_fsync_and_puts_fsync_back(tmp_path):
    import os

    real = os.fsync
    with bench._FsyncClock() as clock, open(tmp_path / "f", "wb") as handle:
        handle.write(b"x" * 4096)
        handle.flush()
        os.fsync(handle.fileno())
    assert clock.seconds > 0 and os.fsync is real


def test_the_writers_comparison_reports_each_writers_medians_and_ranges():
    text = bench._writers_text({"DCP's FileSystemWriter": [(1.2, 1.0, 0.3), (1.0, 1.1, 0.4), (1.4, 0.9, 2.0)],
                                "dcp_file_writer.py": [(0.9, 0.7, 0.3), (1.0, 0.7, 0.4)]}, (2.5, 2.6))
    assert text.splitlines()[0].startswith("load 2.5 before, 2.6 after")
    assert "DCP's FileSystemWriter: 3 saves, whole 1.200 s (1.000-1.400), user CPU 1.00 s (0.90-1.10), " \
           "system CPU 0.40 s (0.30-2.00)" in text
    assert "dcp_file_writer.py: 2 saves, whole 0.950 s (0.900-1.000), user CPU 0.70 s (0.70-0.70)" in text
