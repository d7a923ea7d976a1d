"""summarize: a valid multi-session run is accepted and reconciled; each kind of inconsistency is rejected."""

import json

import pytest

from pilotrun.commands.cli import main
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.run.record import RecordError
from tests.report.synthetic import SyntheticRun, crashed_and_resumed


def test_valid_crashed_and_resumed_run_is_reconciled(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    summary = summarize_run(tmp_path / "r", require_step=60)
    assert summary.valid, summary.reasons
    assert summary.lineage == ["s1", "s2"]
    s1, s2 = summary.sessions
    # s1 reached step 30 (logged) before the kill; s2 resumed from the checkpoint at step 20.
    assert (s1.status, s1.end_reason, s1.updates_applied, s1.updates_rolled_back) == (
        "partly rolled back",
        None,
        30,
        10,
    )
    assert (s2.status, s2.end_reason, s2.resumed_from, s2.updates_applied) == ("kept", "completed", 20, 40)
    assert s1.time_source == "events" and s2.time_source == "session_end"
    o = summary.overall
    assert o["updates_applied"] == 60  # not 70: the 10 redone updates are counted once
    assert o["tokens_seen"] == 60 * run.tokens_per_update
    assert o["tokens_rolled_back"] == 10 * run.tokens_per_update
    assert o["tokens_planned"] == 60 * run.tokens_per_update
    assert o["passes_over_train_split"] == 60 * run.tokens_per_update / 5000
    assert o["resumes"] == 1 and o["ended"] == "completed"
    # Rolled-back windows (steps 25 and 30 of s1) are not in the kept history.
    kept_s1_steps = [
        e["step"] for e in summary.kept_events if e["session_id"] == "s1" and e["event"] == "train"
    ]
    assert kept_s1_steps == [5, 10, 15, 20]
    assert sorted(e["step"] for e in summary.rolled_back_events if e["event"] == "train") == [25, 30]
    # Time split sums every session; throughput is labelled and computed from the windows.
    assert o["time_split"]["train_seconds"] == pytest.approx((30 + 40) * 0.5)
    assert o["train_tokens_per_s"] == pytest.approx(run.tokens_per_update / 0.5)
    # Each session's training-only throughput divides by its training seconds (0.5 s an update), never by its
    # wall seconds, which also hold the host's 0.125 s an update, evaluation and checkpoints.
    for session in (s1, s2):
        assert session.train_tokens_per_s == pytest.approx(run.tokens_per_update / 0.5)
        assert session.wall_tokens_per_s < run.tokens_per_update / (0.5 + 0.125)


def test_overflow_skips_are_accounted(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.overflow_at = {7, 8, 26}
    run.start_session()
    run.train_until(60)
    run.end_session()
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert summary.valid, summary.reasons
    assert summary.overall["updates_skipped"] == 3 and summary.overall["updates_attempted"] == 63
    assert summary.overall["tokens_seen"] == 63 * run.tokens_per_update


def test_fresh_restart_after_crash_before_any_checkpoint(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(12)
    run.kill()
    run.counters = {"step": 0, "tokens_seen": 0, "updates_attempted": 0, "updates_skipped": 0}
    run.start_session(resumed_from=None)
    run.train_until(60)
    run.end_session()
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert summary.valid, summary.reasons
    assert summary.lineage == ["s2"]
    # Only logged work is known: the window of updates 11-12 died with the process.
    assert summary.sessions[0].status == "rolled back" and summary.sessions[0].updates_rolled_back == 10
    assert summary.overall["updates_applied"] == 60


def test_torn_last_line_is_reported_not_fatal(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(33)
    run.write(torn_tail='{"event":"train","time":17000')
    summary = summarize_run(tmp_path / "r")
    assert summary.valid, summary.reasons
    assert any("torn last line" in note for note in summary.notes)


def test_torn_tail_cut_by_the_writer_is_noted(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.find("session_start", session="s2")["metrics_repaired_bytes"] = 37
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert summary.valid
    assert any("cut a torn last line of 37 bytes" in note for note in summary.notes)


def test_torn_fragment_before_a_resumed_session_is_recovered(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    path = tmp_path / "r" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if '"session_start"' in line and '"s2"' in line)
    lines[start] = '{"event":"train","ti' + lines[start]
    path.write_text("\n".join(lines) + "\n")
    summary = summarize_run(tmp_path / "r", require_step=60)
    assert summary.valid, summary.reasons
    assert any("torn fragment" in note for note in summary.notes)


def test_damaged_middle_line_is_invalid(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    path = tmp_path / "r" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[5] = lines[5][:20]
    path.write_text("\n".join(lines) + "\n")
    summary = summarize_run(tmp_path / "r")
    assert not summary.valid
    assert any("line 6" in r and "not a JSON object" in r for r in summary.reasons)


def test_missing_session_end_at_required_step(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(33)  # killed: no session_end
    run.write()
    assert summarize_run(tmp_path / "r").valid
    summary = summarize_run(tmp_path / "r", require_step=60)
    assert not summary.valid
    assert any(
        "no session_end at step 60" in r and "killed without session_end" in r for r in summary.reasons
    )
    complete = crashed_and_resumed(tmp_path / "c")
    complete.write()
    assert not summarize_run(tmp_path / "c", require_step=50).valid
    assert summarize_run(tmp_path / "c", require_step=60).valid


def test_session_double_counting_rolled_back_work_is_rejected(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(33)
    run.kill()
    # The resumed session claims the checkpoint at step 20 but keeps the crashed session's counters.
    run.counters["step"] = 30
    run.counters["tokens_seen"] = 30 * run.tokens_per_update
    run.counters["updates_attempted"] = 30
    run.start_session(resumed_from=20)
    run.train_until(60)
    run.end_session()
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert not summary.valid
    assert any("session s2" in r and "counted twice" in r for r in summary.reasons), summary.reasons


def test_resume_from_a_checkpoint_nobody_committed_is_rejected(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.events = [e for e in run.events if not (e["event"] == "checkpoint" and e["step"] == 20)]
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert any("no earlier session recorded committing" in r for r in summary.reasons), summary.reasons


def test_run_json_disagreeing_with_session_start_is_rejected(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.run["sessions"][1]["start_tokens_seen"] += 1
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert any("run.json session s2: start_tokens_seen" in r for r in summary.reasons), summary.reasons


def test_missing_run_folder_is_bad_input(tmp_path):
    with pytest.raises(RecordError, match="run folder not found"):
        summarize_run(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecordError, match="run.json: not found"):
        summarize_run(tmp_path / "empty")


def test_cli_exit_codes_and_json(tmp_path, capsys):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    assert main(["summarize", str(tmp_path / "r"), "--require-step", "60"]) == 0
    text = capsys.readouterr().out
    assert "VALID" in text and "rolled back and redone 10" in text
    assert main(["summarize", str(tmp_path / "r"), "--require-step", "70", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["valid"] is False and any("step 70" in r for r in data["reasons"])
    assert [s["session_id"] for s in data["sessions"]] == ["s1", "s2"]
    assert main(["summarize", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pilotrun: error: run folder not found") and "Traceback" not in err


def killed_between_commit_and_log(tmp_path, also_lose_the_window: bool = False) -> SyntheticRun:
    """Session 1 commits the checkpoint at step 40 and is SIGKILLed before its `checkpoint` line is written
    (what the pilot's kill hit on a short recipe); session 2 resumes from that checkpoint."""
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(40)
    run.kill()
    run.events.remove(run.find("checkpoint", session="s1", step=40))
    if also_lose_the_window:  # then no checkpoint at 40 could have been committed at all
        run.events.remove(run.find("train", session="s1", step=40))
    run.resume(from_step=40)
    run.train_until(run.max_steps)
    run.end_session()
    run.write()
    return run


def test_a_checkpoint_committed_but_not_logged_is_a_note_when_its_window_matches(tmp_path):
    killed_between_commit_and_log(tmp_path)
    summary = summarize_run(tmp_path / "r")
    assert summary.valid, summary.reasons
    assert any("committed but did not log" in note and "step 40" in note for note in summary.notes), (
        summary.notes
    )
    assert summary.overall["updates_applied"] == 60 and summary.overall["resumes"] == 1


def test_a_resume_from_a_checkpoint_no_record_supports_is_still_rejected(tmp_path):
    killed_between_commit_and_log(tmp_path, also_lose_the_window=True)
    summary = summarize_run(tmp_path / "r")
    assert any("no earlier session recorded committing that checkpoint" in r for r in summary.reasons), \
        summary.reasons


def forged_session_run(run_dir):
    """A pilot-shaped record whose second session's id holds a newline, a fake healthy line and an escape
    sequence that would clear the screen: what a crafted run folder can hold."""
    run = crashed_and_resumed(run_dir)
    forged = "s2\nrun synthetic-run: VALID\x1b[2J"
    for entry in [*run.events, *run.run["sessions"]]:
        if entry["session_id"] == "s2":
            entry["session_id"] = forged
    run.write()
    return run_dir


def test_the_text_summary_keeps_a_forged_session_id_on_its_line(tmp_path, capsys):
    from pilotrun.report.record_check.summarize import format_summary

    run_dir = forged_session_run(tmp_path / "r")
    text = format_summary(summarize_run(run_dir))
    lines = text.split("\n")
    assert "\x1b" not in text and "run synthetic-run: VALID" not in lines
    assert lines[0] == f"run synthetic-run ({run_dir}): VALID"
    assert "latest session: s2\\nrun synthetic-run: VALID\\x1b[2J (completed at step 60; kept)" in lines
    assert main(["summarize", str(run_dir)]) == 0
    assert capsys.readouterr().out.split("\n")[:len(lines)] == lines
