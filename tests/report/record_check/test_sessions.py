"""sessions.py: within one session, every inconsistency of the counters, the skips, the numbers and the
qk_clip events is one reason naming its line."""


import pytest

from pilotrun.report.record_check.summarize import summarize_run
from tests.report.synthetic import SyntheticRun, crashed_and_resumed


@pytest.mark.parametrize("field,delta,expected", [
    ("tokens", 16, "window.tokens=176 but tokens_seen grew by 160"),
    ("updates_applied", 1, "window.updates_applied=6 but step grew by 5"),
    ("microbatches", -1, "!= microbatches (9) x tokens_per_microbatch (16)"),
])
def test_counter_that_does_not_add_up_is_rejected(tmp_path, field, delta, expected):
    run = crashed_and_resumed(tmp_path / "r")
    run.find("train", session="s2", step=45)["window"][field] += delta
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert not summary.valid
    assert any(expected in r and "step 45" in r for r in summary.reasons), summary.reasons


def test_counter_going_backwards_is_rejected(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.find("val", session="s2", step=40)["tokens_seen"] -= 32
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert any("tokens_seen went backwards" in r for r in summary.reasons), summary.reasons


def test_skip_without_overflow_event_is_rejected(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.overflow_at = {7}
    run.start_session()
    run.train_until(20)
    run.end_session()
    run.events = [e for e in run.events if e["event"] != "overflow"]
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert any("updates_skipped grew by 1 since the previous train window but 0 overflow event(s)" in r
               and "(train" in r for r in summary.reasons), summary.reasons


def test_skip_counted_at_a_data_restart_of_the_same_update_is_accepted(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.overflow_at = {7}
    run.start_session()
    run.train_until(20)
    run.end_session()
    overflow = run.find("overflow")
    restart = dict(overflow, event="data_restart", epoch=1)  # same update: counters already include the skip
    for key in ("reason", "loss_scale_before", "loss_scale_after", "consecutive_skips"):
        restart.pop(key)
    run.events.insert(run.events.index(overflow), restart)
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert summary.valid, summary.reasons


def test_nonfinite_value_is_rejected(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.find("train", session="s2", step=50)["loss"] = "NaN"  # how the writer (run/writer.py) writes a NaN
    run.find("train", session="s2", step=55)["memory"]["rss_mb"] = float("inf")
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert any("non-finite value in loss" in r and "step 50" in r for r in summary.reasons), summary.reasons
    assert any("memory.rss_mb" in r and "step 55" in r for r in summary.reasons), summary.reasons


def test_session_started_twice_is_rejected(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    duplicate = dict(run.find("session_start", session="s2"))
    run.events.append(duplicate)
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert any("started twice" in r for r in summary.reasons), summary.reasons


def test_interleaved_sessions_are_rejected(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    late = dict(run.find("val", session="s1", step=30))
    run.events.append(late)
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert any("continues after another session started" in r for r in summary.reasons), summary.reasons


def test_completed_session_with_unlogged_work_is_rejected(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    end = run.find("session_end")
    end["step"] += 1
    end["updates_attempted"] += 1
    end["tokens_seen"] += run.tokens_per_update
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert any("train windows account only for step 60" in r for r in summary.reasons), summary.reasons


def make_clipping_run(tmp_path) -> SyntheticRun:
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(20)
    run.end_session()
    return run


def test_qk_clip_events_that_match_their_windows_are_accepted(tmp_path):
    run = make_clipping_run(tmp_path)
    run.clip_head(10, 1, 0, 120.0, first_time=True)
    run.clip_head(10, 2, 1, 250.0, first_time=True)  # hard as well
    run.clip_head(10, 0, 1, 400.0, first_time=False)  # hard only: clipped before
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert summary.valid, summary.reasons


@pytest.mark.parametrize("change,expected", [
    (dict(gamma=0.9), "gamma 0.9 x max_logit 120.0 != tau 100.0"),
    (dict(gamma=1.0), "(0 < gamma < 1)"),
    (dict(first_time=False), "logged with first_time=False, hard=False"),
    (dict(hard=True), "logged with first_time=True, hard=True"),
    (dict(head=-1), "without a valid layer and head"),
])
def test_inconsistent_qk_clip_events_are_rejected(tmp_path, change, expected):
    run = make_clipping_run(tmp_path)
    run.clip_head(10, 1, 0, 120.0, first_time=True).update(change)
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert not summary.valid
    assert any(expected in reason for reason in summary.reasons), summary.reasons


def test_a_first_clip_missing_from_its_window_is_rejected(tmp_path):
    run = make_clipping_run(tmp_path)
    run.clip_head(10, 1, 0, 120.0, first_time=True)
    run.find("train", step=10)["qk_clip"]["first_clipped"] = []
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert any(
        "qk_clip.first_clipped [] differs from the first-time qk_clip events logged in it [[1, 0]]" in r
        for r in summary.reasons
    ), summary.reasons


def test_a_sessions_tokens_per_update_is_taken_back_through_later_batch_changes():
    from pilotrun.report.record_check.sessions import tokens_per_update_of

    run = {"tokens_per_update": 64, "sessions": [{"session_id": sid} for sid in ("a", "b", "c")],
           "allowed_changes": [{"key": "train.batch_size", "old": 4, "new": 2, "session_id": "c"},
                               {"key": "optim.muon.lr", "old": 0.1, "new": 0.2, "session_id": "b"}]}
    assert [tokens_per_update_of(run, sid) for sid in ("a", "b", "c")] == [128, 128, 64]
    run["allowed_changes"].append({"key": "train.gradient_accumulation_steps", "old": 1, "new": 4,
                                   "session_id": "c"})
    run["tokens_per_update"] = 256
    assert [tokens_per_update_of(run, sid) for sid in ("a", "c")] == [128, 256]
