"""Time accounting: the phases partition the wall clock; windows read train-only and wall seconds."""

import pytest

from pilotrun.train.timing import TimeAccount, WindowClock, throughput


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
    account.switch("other")
    clock.now += 0.25
    split = account.time_split()
    assert split == {"train_seconds": 8.0, "eval_seconds": 2.0, "checkpoint_seconds": 0.5,
                     "other_seconds": 1.25, "wall_seconds": 11.75}
    assert sum(v for k, v in split.items() if k != "wall_seconds") == split["wall_seconds"]
    # The device is synchronized only when leaving the training phase (three times above), never per step.
    assert syncs == [106.0, 111.0, 111.5]


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
    assert window.close_window() == (2.0, 2.0)


def test_unknown_phase_is_refused():
    with pytest.raises(ValueError):
        TimeAccount().switch("profiling!")


def test_throughput_reports_mfu_only_against_a_known_peak():
    figures = throughput(tokens=1000, train_seconds=2.0, wall_seconds=4.0, flops_per_token=6.0,
                         peak_flops_per_s=None)
    assert figures == {"train_tokens_per_s": 500.0, "wall_tokens_per_s": 250.0, "achieved_flops_per_s": 3000.0,
                       "mfu": "unknown"}
    assert throughput(1000, 2.0, 4.0, 6.0, 30000.0)["mfu"] == 0.1


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
