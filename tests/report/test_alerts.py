"""pilotrun/report/alerts.py: each alert's condition on a record, with a handed-in clock and lock holder."""

from __future__ import annotations

import pytest

from pilotrun.report.alerts import Watcher, envelope_bound
from tests.report.synthetic import SyntheticRun, crashed_and_resumed


def _killed(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(33)
    run.kill()
    return run.write(), run


def test_a_killed_session_with_no_resume_started_is_an_alert_until_one_holds_the_folder(tmp_path):
    run_dir, run = _killed(tmp_path)
    holder = {"value": None}
    watcher = Watcher(run_dir, clock=lambda: run.clock, holder=lambda _: holder["value"])
    new, _ = watcher.check()
    assert [a.kind for a in new] == ["session_end"] and "killed (no session_end)" in new[0].message
    holder["value"] = {"pid": 1}
    _, cleared = watcher.check()
    assert [a.kind for a in cleared] == ["session_end"]


def test_a_stall_is_k_window_intervals_of_silence_while_a_session_holds_the_folder(tmp_path):
    run_dir, run = _killed(tmp_path)  # the last line is a train window at step 30; windows of 5 x 0.625 s
    now = {"t": run.clock}
    watcher = Watcher(run_dir, stall_windows=2.0, clock=lambda: now["t"], holder=lambda _: {"pid": 1})
    assert watcher.check() == ([], [])
    interval, _ = watcher.window_interval()
    assert interval == pytest.approx(5 * 0.625, abs=0.05)
    last = watcher.events[-1]["time"]
    now["t"] = last + 1.9 * interval
    assert watcher.check()[0] == []
    now["t"] = last + 2.1 * interval  # the synthetic recipe names no cadence, so nothing is allowed on top
    new, _ = watcher.check()
    assert [a.kind for a in new] == ["stall"] and new[0].extra["windows"] == pytest.approx(2.1)
    assert new[0].bound == pytest.approx(2.0 * interval)
    now["t"] = last + 0.1
    run_dir.joinpath("metrics.jsonl").open("a").close()
    assert watcher.check() == ([], [])  # still standing: nothing new was written


def test_a_failing_rule_of_the_table_is_an_alert(tmp_path):
    run = crashed_and_resumed(tmp_path / "r", make_run=lambda d, **k: _overflowing(SyntheticRun(d, **k)))
    run.write()
    new, _ = Watcher(tmp_path / "r", holder=lambda _: None).check(final=True)
    assert "rule:skip_rate" in {a.key for a in new}


def _overflowing(run):
    run.overflow_at = set(range(2, 60, 3))
    return run


def test_the_envelope_follows_the_pilot_and_holds_its_last_level_past_its_end():
    envelope = {"points": [[0, 10.0], [10, 6.0], [20, 4.0], [30, 4.0]], "noise": 0.1, "sigmas": 5, "share": 0.0}
    assert envelope_bound(envelope, 5) == pytest.approx(8.0 + 0.5)
    assert envelope_bound(envelope, 1000) == pytest.approx(4.0 + 0.5)
    assert envelope_bound({"points": []}, 3) is None


def _cuda_pilot_and_run(tmp_path, slow_device_from: int):
    """A 'CUDA' pilot of 40 updates and a long run whose device seconds per update double from a step on, while
    its wall-clock training time stays the pilot's: only the per-device band can see it."""
    from pilotrun.report.projection import watch_figures
    from pilotrun.report.summarize import summarize_run

    def with_device_time(run, slower_from):
        flush = run._flush_window

        def flush_with_device():
            w, step = run._window, run.counters["step"]
            if w["updates_attempted"]:
                w["device_seconds"] = w["updates_applied"] * (0.8 if step > slower_from else 0.4)
            flush()
        run._flush_window = flush_with_device
        return run

    pilot = with_device_time(SyntheticRun(tmp_path / "pilot", max_steps=40), 10**9)
    pilot.start_session()
    pilot.train_until(40)
    pilot.end_session()
    summary = summarize_run(pilot.write())
    lock = {"watch": watch_figures(summary, {})}
    run = with_device_time(SyntheticRun(tmp_path / "long", max_steps=80), slow_device_from)
    run.start_session()
    run.train_until(80)
    run.end_session()
    return lock, run.write()


def test_a_slower_device_under_an_unchanged_wall_clock_is_a_throughput_device_alert(tmp_path):
    lock, run_dir = _cuda_pilot_and_run(tmp_path, slow_device_from=50)
    band = lock["watch"]["device_throughput"]
    assert band["windows"] == 7 and band["median"] == 32 * 5 / (5 * 0.4)  # 160 tokens per 2 device seconds
    new, _ = Watcher(run_dir, lock=lock, holder=lambda _: None).check(final=True)
    device = [a for a in new if a.key == "throughput_device"]
    assert [a.kind for a in device] == ["throughput"] and device[0].step == 55
    assert device[0].figure == 160 / 4.0 and device[0].bound == band["low"]
    assert "per device second 40.0 tok at step 55" in device[0].message
    assert "throughput" not in {a.key for a in new}  # the wall-clock band holds: the host kept pace


def test_a_cpu_record_has_no_device_band_and_never_raises_the_device_alert(tmp_path):
    from pilotrun.report.projection import watch_figures
    from pilotrun.report.summarize import summarize_run

    run = SyntheticRun(tmp_path / "cpu")
    run.start_session()
    run.train_until(60)
    run.end_session()
    figures = watch_figures(summarize_run(run.write()), {})
    assert figures["device_throughput"]["windows"] == 0 and figures["device_throughput"]["low"] is None
    new, _ = Watcher(tmp_path / "cpu", lock={"watch": figures}, holder=lambda _: None).check(final=True)
    assert "throughput_device" not in {a.key for a in new}


def test_a_run_watched_before_its_first_train_window_gets_no_rule_alert_then_is_judged(tmp_path):
    """A session that has started but not closed its first window: no rule has its evidence yet, so none is
    judged (no "no loss recorded"); once windows are there, the rules are judged as usual."""
    from tests.report.synthetic import SyntheticRun

    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.write()
    watcher = Watcher(run.run_dir, clock=lambda: run.clock, holder=lambda _: {"pid": 1})
    new, _ = watcher.check(final=True)
    assert [a for a in new if a.kind == "rule"] == [] and watcher.pending_judgement
    run.train_until(20)
    run.write()
    watcher.check(final=True)
    assert not watcher.pending_judgement and watcher.last_judged > -1e18


@pytest.mark.parametrize("cpu_follows", [False, True])
def test_a_slowdown_with_a_smaller_cpu_share_is_the_machine_busier_and_at_the_same_share_a_throughput_alert(
        tmp_path, cpu_follows):
    """From update 40 each update takes 4x the training time. With the process's CPU seconds unchanged its
    share of the CPU fell to a quarter of the pilot's: `machine_busier`, no throughput alert. With the CPU
    seconds 4x too (the same share: the recipe itself got slower): the throughput alert, no machine_busier."""
    from pilotrun.commands.freeze import freeze_run
    from pilotrun.run.recipe_lock import load_lock

    crashed_and_resumed(tmp_path / "pilot").write()
    assert freeze_run(tmp_path / "pilot", tmp_path / "lock.json")[0] == 0
    lock = load_lock(tmp_path / "lock.json")
    assert lock["watch"]["throughput"]["cpu_share"] == pytest.approx(0.9)
    run = SyntheticRun(tmp_path / "long")
    run.train_seconds_per_update = lambda step: 2.0 if step > 40 else 0.5
    if cpu_follows:
        run.cpu_seconds_per_update = lambda step: 1.8 if step > 40 else 0.45
    run.start_session()
    run.train_until(60)
    run.end_session()
    run.write()
    watcher = Watcher(run.run_dir, lock, clock=lambda: run.clock, holder=lambda _: None)
    kinds = {a.kind for a in watcher.check(final=True)[0]}
    assert ("throughput" in kinds) is cpu_follows and ("machine_busier" in kinds) is not cpu_follows, kinds
