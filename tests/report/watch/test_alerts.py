"""pilotrun/report/watch/alerts.py: each alert's condition on a record, with a handed-in clock and lock
holder."""

from __future__ import annotations

import pytest

from pilotrun.report.watch.alerts import Watcher, envelope_bound
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
    envelope = {
        "points": [[0, 10.0], [10, 6.0], [20, 4.0], [30, 4.0]],
        "noise": 0.1,
        "sigmas": 5,
        "share": 0.0,
    }
    assert envelope_bound(envelope, 5) == pytest.approx(8.0 + 0.5)
    assert envelope_bound(envelope, 1000) == pytest.approx(4.0 + 0.5)
    assert envelope_bound({"points": []}, 3) is None


def _cuda_pilot_and_run(tmp_path, slow_device_from: int):
    """A 'CUDA' pilot of 40 updates and a long run whose device seconds per update double from a step on,
    while its wall-clock training time stays the pilot's: only the per-device band can see it."""
    from pilotrun.report.projection.long_run import watch_figures
    from pilotrun.report.record_check.summarize import summarize_run

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
    from pilotrun.report.projection.long_run import watch_figures
    from pilotrun.report.record_check.summarize import summarize_run

    run = SyntheticRun(tmp_path / "cpu")
    run.start_session()
    run.train_until(60)
    run.end_session()
    figures = watch_figures(summarize_run(run.write()), {})
    assert figures["device_throughput"]["windows"] == 0 and figures["device_throughput"]["low"] is None
    new, _ = Watcher(tmp_path / "cpu", lock={"watch": figures}, holder=lambda _: None).check(final=True)
    assert "throughput_device" not in {a.key for a in new}


def _downstream(run, acc: float, sha: str = "abc") -> None:
    """A downstream event at the run's current step."""
    run._emit("downstream", tasks={"next": {"acc": acc, "acc_norm": acc, "chance": 0.25, "examples": 40,
                                            "sha256": sha}}, limit=0, seconds=0.1)


def test_a_task_back_near_chance_after_rising_is_a_downstream_alert_cleared_when_it_rises_again(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(10)
    _downstream(run, 0.55)
    run.write()
    watcher = Watcher(tmp_path / "r", holder=lambda _: {"pid": 1}, clock=lambda: run.clock)
    assert not [a for a in watcher.check()[0] if a.kind == "downstream"]
    run.train_until(20)
    _downstream(run, 0.28)
    run.write()
    new, _ = watcher.check()
    fell = [a for a in new if a.kind == "downstream"]
    assert [a.key for a in fell] == ["downstream:next"] and "fell back toward chance" in fell[0].message
    assert (fell[0].step, fell[0].figure) == (20, 0.28)
    run.train_until(30)
    _downstream(run, 0.5)
    run.write()
    _, cleared = watcher.check()
    assert "downstream:next" in {a.key for a in cleared}


def test_against_a_lock_a_task_below_the_pilots_figure_is_an_alert(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(40)
    _downstream(run, 0.3)
    run.write()
    lock = {"watch": {"downstream": {"next": {"acc": 0.6, "step": 40, "sha256": "abc"}}}}
    new, _ = Watcher(tmp_path / "r", lock=lock, holder=lambda _: {"pid": 1}, clock=lambda: run.clock).check()
    below = [a for a in new if a.kind == "downstream"]
    assert [a.key for a in below] == ["downstream_pilot:next"] and "below the pilot's 0.600" in below[
        0
    ].message


def _hung_then_resumed(tmp_path, mtbf_hours=None):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(33)
    run.end_session("hung")
    run.find("session_end")["message"] = "rank 1: no progress for 600 s in update after step 33"
    run.pause(5.0)
    run.resume()
    run.train_until(38)
    return run.write(), run


def test_a_hung_session_is_an_alert_raised_once_even_when_restarted_at_once(tmp_path):
    run_dir, run = _hung_then_resumed(tmp_path)
    watcher = Watcher(run_dir, clock=lambda: run.clock, holder=lambda _: {"pid": 1})
    new, _ = watcher.check()
    assert [a.kind for a in new] == ["hung"] and new[0].key == "hung:s1" and new[0].step == 33
    assert "session s1 hung at step 33: rank 1: no progress for 600 s" in new[0].message
    assert watcher.check() == ([], [])  # not raised again


def test_a_hang_found_by_the_next_start_is_the_hung_session_s_alert(tmp_path):
    """Rank 0 was the stuck one: the session has no session_end, and the next start's hang_found names it."""
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(33)
    run.kill()
    run.pause(5.0)
    run.resume()
    run._emit("hang_found", hung_session="s1", rank=1, stack_file="hangs/20261207T000000Z-rank1.txt")
    run.train_until(38)
    watcher = Watcher(run.write(), clock=lambda: run.clock, holder=lambda _: {"pid": 1})
    new, _ = watcher.check()
    assert [(a.kind, a.key, a.session_id) for a in new] == [("hung", "hung:s1", "s2")]
    assert "session s1 hung (no session_end: rank 1 wrote its stacks, hangs/20261207T000000Z-rank1.txt" \
        in new[0].message
    assert watcher.check() == ([], [])  # not raised again


@pytest.mark.parametrize("mtbf_hours, alert", [(10.0, True), (0.001, False)])
def test_interruptions_more_than_the_lock_s_mtbf_makes_likely_are_an_alert(tmp_path, mtbf_hours, alert):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    for until in (25, 45, 55):  # hung, hung, killed: three interruptions in a few minutes
        run.train_until(until)
        run.end_session("hung") if until < 50 else run.kill()
        run.pause(10.0)
        run.resume()
    run.train_until(60)
    run.end_session("completed")
    run.write()
    lock = {"projection": {"failures": {"mtbf_hours": mtbf_hours}}}
    new, _ = Watcher(tmp_path / "r", lock=lock, holder=lambda _: None).check(final=True)
    restarts = [a for a in new if a.kind == "restarts"]
    assert bool(restarts) == alert
    if alert:
        assert restarts[0].extra["interruptions"] == 3 and restarts[0].bound == 10.0
        assert "3 interruption(s) in" in restarts[0].message and "MTBF of 10 h" in restarts[0].message
        assert "sessions by end: completed 1, hung 2, killed 1" in restarts[0].message
    # Without --against, the lock the run was started from states the MTBF.
    run.run["frozen"] = {"lock_projection": lock["projection"]}
    run.write()
    new, _ = Watcher(tmp_path / "r", holder=lambda _: None).check(final=True)
    assert bool([a for a in new if a.kind == "restarts"]) == alert


def test_a_run_watched_before_its_first_train_window_gets_no_rule_alert_each_rule_waiting(tmp_path):
    """A session that has started but not closed its first window: no rule has its evidence yet, so none is
    judged (no "no loss recorded"): each waits, naming what for; once windows are there, they are judged."""
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.write()
    watcher = Watcher(run.run_dir, clock=lambda: run.clock, holder=lambda _: {"pid": 1})
    new, _ = watcher.check(final=True)
    assert [a for a in new if a.kind == "rule"] == []
    assert watcher.waiting["losses_finite"] == "a train window"
    assert watcher.waiting["skip_rate"] == "a train window"
    assert set(watcher.waiting) == {r.name for r in watcher.rules} - {
        "data_passes",
        "downstream",
        "recipe_changes",
    }
    run.train_until(20)
    run.write()
    watcher.check(final=True)
    assert watcher.waiting == {"loss_rise_at_end": "6 train windows"}
    run.train_until(30)
    run.write()
    watcher.check(final=True)
    assert watcher.waiting == {}


def _prefix(full: SyntheticRun, k: int, run_dir) -> SyntheticRun:
    """The record as the trainer had written it after its first `k` lines: run.json's sessions that had
    started (not yet closed where their end is still to come), the checkpoints committed by then."""
    run = full.copy()
    run.run_dir, run.events = run_dir, run.events[:k]
    started = {e["session_id"] for e in run.events if e["event"] == "session_start"}
    ended = {e["session_id"] for e in run.events if e["event"] == "session_end"}
    run.run["sessions"] = [s for s in run.run["sessions"] if s["session_id"] in started]
    for entry in run.run["sessions"]:
        if entry["session_id"] not in ended:
            entry.pop("chain_end", None), entry.pop("end_reason", None)
    saved = {e["step"] for e in run.events if e["event"] == "checkpoint"}
    run.checkpoints = {step: c for step, c in run.checkpoints.items() if step in saved}
    return run


def test_a_record_growing_line_by_line_raises_a_rule_only_once_its_evidence_exists(tmp_path):
    """The pilot's shape (killed at 33, resumed from 20) with warm-up clipping (every update to 10 clipped, a
    warm-up of 10) and overflow skips, watched after each of its lines: a rule is judged only once the record
    holds what it reads, and then exactly as the rule table judges it. So no alert ever says the record lacks
    a rule's evidence, the warm-up's clipping never alerts (clip_rate waits for a second half past the
    warm-up), and the complete record's alerts are every watched rule that FAILs on it, none waiting."""
    from pilotrun.report.record_check.summarize import summarize_run
    from pilotrun.report.verdict.thresholds import FAIL, Thresholds
    from pilotrun.report.verdict.verdict import judge_summary

    def build(run_dir, **kwargs):
        run = _overflowing(SyntheticRun(run_dir, **kwargs))
        run.run["recipe"]["optim"]["schedule"] = {"warmup_steps": 10}
        return run

    full = crashed_and_resumed(tmp_path / "full", make_run=build)
    raised, waited = set(), set()
    for k in range(1, len(full.events) + 1):
        run_dir = _prefix(full, k, tmp_path / f"p{k}").write()
        watcher = Watcher(run_dir, clock=lambda: full.clock, holder=lambda _: {"pid": 1})
        alerts = {a.key: a for a in watcher.check(final=True)[0] if a.kind == "rule"}
        summary = summarize_run(run_dir)
        judged = [r for r in watcher.rules if r.name not in watcher.waiting]
        assert set(alerts) == {
            f"rule:{r.name}" for r in judged if r.apply(summary, Thresholds()).status == FAIL
        }, k
        assert not any("evidence" in a.message or "no loss" in a.message or "no update" in a.message
                       for a in alerts.values()), (k, alerts)
        raised |= set(alerts)
        waited |= set(watcher.waiting)
    assert raised == {"rule:skip_rate"}
    assert {
        "losses_finite",
        "skip_rate",
        "grad_spikes",
        "clip_rate",
        "memory",
        "experts",
        "qk_clip",
    } <= waited
    assert watcher.waiting == {}
    watched = {r.name for r in watcher.rules}
    failed = {r.name for r in judge_summary(summarize_run(run_dir)).rules if r.status == FAIL} & watched
    assert set(alerts) == {f"rule:{name}" for name in failed} == {"rule:skip_rate"}


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


def test_a_resume_on_another_thread_count_is_said_once_as_a_note_not_an_alert(tmp_path):
    """run.json's not_exact for the resumed session: watch notes, once, that bit-exact continuation is not
    promised from update 21 and why (the thread count 1 -> 2); it raises no alert for it. A session on the
    same threads gets no note."""
    full = crashed_and_resumed(tmp_path / "full")
    entry = next(e for e in full.run["sessions"] if e["session_id"] == "s2")
    entry["not_exact"] = {
        "from_update": 21,
        "changes": [{"key": "hardware.torch_threads", "old": 1, "new": 2}],
    }
    plain = crashed_and_resumed(tmp_path / "plain").write()
    watcher = Watcher(plain, clock=lambda: full.clock, holder=lambda _: None)
    watcher.check(final=True)
    assert watcher.new_notes() == []  # resumed on the same threads: nothing to say
    full.write()
    watcher = Watcher(full.run_dir, clock=lambda: full.clock, holder=lambda _: None)
    new, _ = watcher.check(final=True)
    (note,) = watcher.new_notes()
    assert note == (
        "note: session s2 resumed across hardware.torch_threads 1 -> 2 from update 21: bit-exact "
        "continuation is not promised from there (the run goes on; its figures need not match an "
        "uninterrupted run's bit for bit, and the verdict's resumed rule counts no exact continuation "
        "from it)"
    )
    assert all("torch_threads" not in a.message for a in new)
    watcher._not_exact_notes()  # as when a later session starts: s2's is not said again
    watcher.check(final=True)
    assert watcher.new_notes() == [] and watcher.notes == [note]  # said once


def test_a_spike_and_its_rollback_name_the_update_and_its_batches_in_one_numbering(tmp_path):
    """Updates count from 1, the loader's batches from 0: the alert says which is which, and the rollback's
    skip is in the same cursor positions (as train.skip_data takes them), not a raw record."""
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(30)
    run._emit(
        "spike",
        spike_step=31,
        signals=["loss"],
        loss=9.5,
        grad_norm=1.2,
        batches=[60, 61],
        action="rollback",
        cause="batch",
        replay=None,
    )
    run._emit("rollback", spike_step=31, restored_step=20, rollbacks=1, max_rollbacks=3,
              skipped={"first_batch": 60, "batches": 6, "documents": [{"first": 12, "last": 13, "pass": 0}]})
    run.write()
    watcher = Watcher(tmp_path / "r")
    watcher.check(final=True)
    said = {a.kind: a.message for a in watcher.raised}
    assert said["spike"].startswith(
        "spike at update 31 (batches 60, 61: the loader's cursor positions, counted from "
        "0 as train.skip_data and the rollback count them): loss "
    )
    assert said["rollback"] == (
        "rollback 1 of at most 3 after the spike at update 31: back to step 20, skipped "
        "batches 60..65: documents 12..13 (pass 0)"
    )


def test_a_share_that_falls_with_the_rate_at_the_same_tokens_per_cpu_second_is_the_machine_busier(tmp_path):
    """From update 40 each update takes 1.5x the time. With the CPU seconds unchanged the share fell from the
    pilot's 0.9 to 0.6 (above min_cpu_share_ratio 0.6 of it, 0.54) and the rate with it, each CPU second still
    training the pilot's tokens: `machine_busier` at the first window after it, no throughput alert. With the
    CPU seconds up a third (the share fell less than the rate: less done per CPU second): the throughput
    alert."""
    from pilotrun.commands.freeze import freeze_run
    from pilotrun.run.recipe_lock import load_lock

    crashed_and_resumed(tmp_path / "pilot").write()
    assert freeze_run(tmp_path / "pilot", tmp_path / "lock.json")[0] == 0
    lock = load_lock(tmp_path / "lock.json")
    for name, cpu in (("busy", 0.45), ("slower", 0.6)):
        run = SyntheticRun(tmp_path / name)
        run.train_seconds_per_update = lambda step: 0.75 if step > 40 else 0.5
        run.cpu_seconds_per_update = lambda step, cpu=cpu: cpu if step > 40 else 0.45
        run.start_session()
        run.train_until(60)
        run.end_session()
        run.write()
        watcher = Watcher(run.run_dir, lock, clock=lambda run=run: run.clock, holder=lambda _: None)
        alerts = {a.kind: a for a in watcher.check(final=True)[0]}
        if name == "busy":
            assert "throughput" not in alerts and alerts["machine_busier"].step == 45, sorted(alerts)
            assert (
                "got 0.60 CPU seconds per training second against the pilot's 0.90, at 71 tokens per CPU "
                "second "
                "(the band's low at the pilot's share: 57;" in alerts["machine_busier"].message
            )
        else:
            assert "machine_busier" not in alerts and "throughput" in alerts, sorted(alerts)


def test_an_alert_s_json_line_holds_no_bare_infinity():
    """watch --json prints each alert as one JSON line: a non-finite figure (an overflowed loss) is a string
    there, so a strict parser (jq, JSON.parse) reads every line."""
    import json

    from pilotrun.report.watch.alerts import Alert

    def refuse(constant):
        raise ValueError(f"bare {constant}")

    line = Alert("spike", "spike:3:9", "spike at update 3", 3, float("inf"), float("nan"), "s1", 1.0,
                 {"grad_norm": float("-inf")}).to_json()
    parsed = json.loads(line, parse_constant=refuse)
    assert (parsed["figure"], parsed["bound"], parsed["extra"]["grad_norm"]) == (
        "Infinity",
        "NaN",
        "-Infinity",
    )


def test_one_look_reads_a_finished_record_past_a_long_line_in_its_middle(tmp_path):
    """A 9 MB line (more than one bounded poll) in the middle of a finished run's log: one-shot watch reads on
    to the end, names the line, and sees the run completed, not killed early at the line before it."""
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(run.max_steps)
    run.end_session()
    run_dir = run.write()
    path = run_dir / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    long_line = b'{"event":"note","pad":"' + b"x" * (9 << 20) + b'"}\n'
    path.write_bytes(b"".join(lines[:3]) + long_line + b"".join(lines[3:]))
    watcher = Watcher(run_dir, clock=lambda: run.clock, holder=lambda _: None)
    alerts = watcher.check(final=True)[0]
    assert watcher.completed, [a.message for a in alerts]
    assert not [a for a in alerts if a.kind == "session_end"]
    assert [a for a in alerts if a.kind == "chain" and "line 4: longer than 8 MiB" in a.message]


def test_one_look_names_a_long_line_at_the_end_of_a_finished_record(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(run.max_steps)
    run.end_session()
    run_dir = run.write()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    with open(run_dir / "metrics.jsonl", "ab") as handle:
        handle.write(b'{"event":"note","pad":"' + b"x" * (9 << 20) + b'"}\n')
    watcher = Watcher(run_dir, clock=lambda: run.clock, holder=lambda _: None)
    alerts = watcher.check(final=True)[0]
    assert [
        a for a in alerts if a.kind == "chain" and f"line {len(lines) + 1}: longer than 8 MiB" in a.message
    ]
