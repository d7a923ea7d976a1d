"""A run still going is read as running, from its folder's lock (read, never taken): summarize names the
holder, the verdict is provisional, and freeze refuses to lock a pilot that has not ended."""

from __future__ import annotations

import json
import os

import pytest

from pilotrun.commands.freeze import freeze_run
from pilotrun.report.summarize import format_summary, summarize_run
from pilotrun.report.verdict import format_verdict, judge_summary
from pilotrun.run.folder_lock import RunFolderLock
from pilotrun.run.recipe_lock import FreezeError
from tests.report.synthetic import SyntheticRun


def unfinished(run_dir):
    run = SyntheticRun(run_dir)
    run.start_session()
    run.train_until(40)  # no session_end: killed, or still going
    run.write()
    return run


def test_an_unended_session_whose_folder_is_held_is_running(tmp_path):
    unfinished(tmp_path / "r")
    assert summarize_run(tmp_path / "r").overall["running"] is None
    assert "killed, or still running" in format_summary(summarize_run(tmp_path / "r"))
    lock = RunFolderLock.acquire(tmp_path / "r")
    try:
        summary = summarize_run(tmp_path / "r")
        running = summary.overall["running"]
        assert running["pid"] == os.getpid()
        assert summary.overall["ended"].startswith(f"running (pid {os.getpid()} on host ")
        text = format_summary(summary)
        assert f"(running, pid {os.getpid()} on host" in text
        verdict = judge_summary(summary)
        assert verdict.provisional and json.loads(json.dumps(verdict.to_dict()))["provisional"] is True
        assert "Provisional: the run is still going" in format_verdict(verdict)
        with pytest.raises(FreezeError, match="the run is still going"):
            freeze_run(tmp_path / "r", tmp_path / "lock.json")
        assert not (tmp_path / "lock.json").exists()
        # Reading it left the folder as it was: nothing but the lock file the holder itself took.
        assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["checkpoints", "metrics.jsonl", "run.json",
                                                                      "run.lock"]
    finally:
        lock.release()
    assert not judge_summary(summarize_run(tmp_path / "r")).provisional
