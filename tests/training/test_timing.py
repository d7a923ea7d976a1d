"""Time accounting: the phases partition the wall clock; windows read train-only and wall seconds."""

import pytest

from pilotrun.training.timing import TimeAccount, WindowClock, throughput


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_phases_partition_the_wall_clock_exactly():
    clock = FakeClock()
    syncs = []
    account = TimeAccount(synchronize=lambda: syncs.append(clock.now), clock=clock)
    clock.now += 1.0  # setup: other
    account.switch("train")
    clock.now += 5.0
    with account.phase("eval"):
        clock.now += 2.0
    clock.now += 3.0  # back in train
    with account.phase("checkpoint"):
        clock.now += 0.5
    with account.phase("profile"):  # a profiled update attempt
        clock.now += 4.0
        with account.phase("report"):  # the profiler's files announced
            clock.now += 0.125
    with account.phase("report"):  # a train event written
        clock.now += 0.375
    account.switch("other")
    clock.now += 0.25
    split = account.time_split()
    assert split == {
        "train_seconds": 8.0,
        "eval_seconds": 2.0,
        "checkpoint_seconds": 0.5,
        "profile_seconds": 4.0,
        "report_seconds": 0.5,
        "other_seconds": 1.25,
        "wall_seconds": 16.25,
    }
    assert sum(v for k, v in split.items() if k != "wall_seconds") == split["wall_seconds"]
    # The device is synchronized only when leaving a phase that queues device work (train, profile), never per
    # step: train -> eval, -> checkpoint, -> profile; profile -> report, -> train; train -> report, -> other.
    assert syncs == [106.0, 111.0, 111.5, 115.5, 115.625, 115.625, 116.0]


def test_window_clock_reads_train_only_and_wall_seconds():
    clock = FakeClock()
    account = TimeAccount(clock=clock)
    account.switch("train")
    window = WindowClock(account)
    clock.now += 4.0
    with account.phase("eval"):
        clock.now += 1.0
    assert window.close_window() == (4.0, 5.0)
    clock.now += 2.0
    assert window.close_window() == (2.0, 2.0) and window.profile_seconds == 0.0
    clock.now += 1.0
    with account.phase("profile"):
        clock.now += 3.0
    # A profiled attempt's seconds are inside the window's wall seconds, never its train seconds.
    assert window.close_window() == (1.0, 4.0) and window.profile_seconds == 3.0


def test_unknown_phase_is_refused():
    with pytest.raises(ValueError):
        TimeAccount().switch("profiling!")


def test_throughput_reports_mfu_only_against_a_known_peak():
    figures = throughput(tokens=1000, train_seconds=2.0, wall_seconds=4.0, flops_per_token=6.0,
                         peak_flops_per_s=None)
    assert figures == {
        "train_tokens_per_s": 500.0,
        "wall_tokens_per_s": 250.0,
        "achieved_flops_per_s": 3000.0,
        "mfu": "unknown",
    }
    assert throughput(1000, 2.0, 4.0, 6.0, 30000.0)["mfu"] == 0.1


def test_throughput_counts_only_the_training_phase_tokens_in_training_only_figures():
    # 400 of the window's 1000 tokens were processed under the profiler, outside the 2 training seconds.
    figures = throughput(1000, 2.0, 4.0, 6.0, 36000.0, train_tokens=600)
    assert figures == {
        "train_tokens_per_s": 300.0,
        "wall_tokens_per_s": 250.0,
        "achieved_flops_per_s": 1800.0,
        "mfu": 0.05,
    }
    # A window trained only under the profiler has no training-only figure (not 0 tok/s).
    figures = throughput(1000, 0.001, 4.0, 6.0, 36000.0, train_tokens=0)
    assert figures == {"train_tokens_per_s": None, "wall_tokens_per_s": 250.0, "achieved_flops_per_s": None,
                       "mfu": "unknown"}


def test_window_clock_charges_process_cpu_seconds_to_the_training_phase_only():
    clock, cpu = FakeClock(), FakeClock()
    account = TimeAccount(clock=clock, cpu_clock=cpu)
    cpu.now += 7.0  # setup work: charged to "other"
    account.switch("train")
    window = WindowClock(account)
    clock.now += 4.0
    cpu.now += 1.0  # a busy machine: 4 s of wall, 1 s of this process's CPU
    with account.phase("eval"):
        clock.now += 1.0
        cpu.now += 0.5
    assert window.close_window() == (4.0, 5.0) and window.cpu_seconds == 1.0
    cpu.now += 2.0
    assert window.close_window() == (0.0, 0.0) and window.cpu_seconds == 2.0
    assert account.cpu_totals["other"] == 7.0 and account.cpu_totals["eval"] == 0.5


def test_window_clock_records_what_other_processes_took_from_the_run():
    clock, cpu = FakeClock(), FakeClock()
    account = TimeAccount(clock=clock, cpu_clock=cpu)
    machine = {"switches": 10, "busy": 100.0}
    window = WindowClock(account, machine=lambda: (machine["switches"], machine["busy"]))
    account.switch("train")
    clock.now += 4.0
    cpu.now += 1.5  # this process's CPU seconds
    machine["switches"] += 300  # its threads descheduled 300 times for other tasks
    machine["busy"] += 7.5  # the whole machine's busy CPU seconds: 6 of them were other processes'
    window.close_window()
    assert (window.involuntary_switches, window.other_cpu_seconds) == (300, 6.0)
    unknown = WindowClock(account, machine=lambda: (0, None))  # no /proc/stat: the share of others is unknown
    unknown.close_window()
    assert unknown.other_cpu_seconds is None and unknown.involuntary_switches == 0
