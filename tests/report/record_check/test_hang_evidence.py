"""summarize: a session without a session_end during which a rank wrote its stacks (RUN/hangs/) hung (rank 0,
the stuck one, recorded nothing); one written at another time says nothing of it."""

from __future__ import annotations

import datetime
import json

from pilotrun.report.record_check.summarize import summarize_run
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
