"""pilotrun/run/hang_evidence.py: a session without a session_end during which a rank wrote its stacks
(RUN/hangs/) hung (rank 0, the stuck one, recorded nothing); one written at another time says nothing of it.
The one rule read by summarize and by the next session's start, which records it (`hang_found`)."""

from __future__ import annotations

import datetime
import json

from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.run.hang_evidence import HangEvidence, sessions_of, unrecorded_hangs
from tests.report.synthetic import SyntheticRun


def stack_name(epoch: float, rank: int) -> str:
    when = datetime.datetime.fromtimestamp(epoch, datetime.UTC)
    return f"{when.strftime('%Y%m%dT%H%M%SZ')}-rank{rank}.txt"


def killed_then_resumed(run_dir):
    run = SyntheticRun(run_dir)
    run.start_session()
    run.train_until(33)
    run.kill()
    run.pause(600)
    run.resume()
    run.train_until(run.max_steps)
    run.end_session()
    run.write()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [e["time"] for e in lines if e["event"] == "session_start"]


def test_stacks_written_during_a_session_without_an_end_make_it_hung(tmp_path):
    first, second = killed_then_resumed(tmp_path / "r")
    (tmp_path / "r" / "hangs").mkdir()
    name = stack_name(first + 30, 1)
    (tmp_path / "r" / "hangs" / name).write_text("stacks")
    summary = summarize_run(tmp_path / "r")
    assert summary.valid, summary.reasons
    assert [s.end_reason for s in summary.sessions] == ["hung", "completed"]
    assert any(f"hangs/{name}" in note and "counted as hung" in note for note in summary.notes)


def test_stacks_written_at_another_time_leave_the_session_killed(tmp_path):
    first, second = killed_then_resumed(tmp_path / "r")
    (tmp_path / "r" / "hangs").mkdir()
    (tmp_path / "r" / "hangs" / stack_name(second + 5, 1)).write_text("stacks")  # the next session's
    summary = summarize_run(tmp_path / "r")
    assert [s.end_reason for s in summary.sessions] == [None, "completed"]


def events_with_a_found_hang(found: HangEvidence, before: list[dict]) -> list[dict]:
    """The events after the next session's start recorded what it found."""
    return before + [{"event": "hang_found", "session_id": "next", "time": 1e10,
                      "hung_session": found.session_id, "rank": found.rank, "stack_file": found.path()}]


def test_the_next_session_s_start_finds_it_once(tmp_path):
    first, second = killed_then_resumed(tmp_path / "r")
    (tmp_path / "r" / "hangs").mkdir()
    name = stack_name(first + 30, 1)
    (tmp_path / "r" / "hangs" / name).write_text("stacks")
    events = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    sessions, starts = sessions_of(events)
    assert [ended for _, ended in sessions] == [False, True]
    # as the second session's start saw it: the first session the last, its window open to the new start
    before_second = [e for e in events if e["session_id"] == sessions[0][0]]
    found = unrecorded_hangs(tmp_path / "r", before_second, until=second)
    assert found == [HangEvidence(sessions[0][0], 1, name)]
    assert unrecorded_hangs(tmp_path / "r", before_second, until=first + 29) == []  # written after that start
    # once recorded, not found again
    assert unrecorded_hangs(tmp_path / "r", events_with_a_found_hang(found[0], before_second), second) == []


def test_summarize_counts_a_recorded_hang_whose_stack_file_is_gone(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(33)
    run.kill()
    first = run.session_id
    run.pause(600)
    run.resume()
    run._emit("hang_found", hung_session=first, rank=1, stack_file="hangs/20261207T000000Z-rank1.txt")
    run.train_until(run.max_steps)
    run.end_session()
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert summary.valid, summary.reasons
    assert [s.end_reason for s in summary.sessions] == ["hung", "completed"]
    assert any("hangs/20261207T000000Z-rank1.txt, rank 1; a later session's start recorded it" in note
               for note in summary.notes)
