"""A run still going is read as running, from its folder's lock (read, never taken): summarize names the
holder, the verdict is provisional, and freeze refuses to lock a pilot that has not ended."""

from __future__ import annotations

import json
import os

import pytest

from pilotrun.commands.freeze import freeze_run
from pilotrun.report.record_check.summarize import format_summary, summarize_run
from pilotrun.report.verdict.verdict import format_verdict, judge_summary
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
        assert sorted(p.name for p in (tmp_path / "r").iterdir()) == [
            "checkpoints",
            "metrics.jsonl",
            "run.json",
            "run.lock",
        ]
    finally:
        lock.release()
    assert not judge_summary(summarize_run(tmp_path / "r")).provisional


def test_summarize_in_a_loop_while_the_run_appends_never_reads_a_false_invalid(tmp_path):
    """A writer thread appends the log line by line, as the trainer does, committing each checkpoint's marker
    after the line it names and before its checkpoint line; summarize reads the folder again and again
    meanwhile. Every read is a consistent moment of the run: valid, never "the log up to that checkpoint was
    rewritten"."""
    import threading

    from tests.report.synthetic import SyntheticRun

    whole = SyntheticRun(tmp_path / "whole", max_steps=200, log_every=2, checkpoint_every=4)
    whole.start_session()
    whole.train_until(200)
    whole.write()
    lines = (whole.run_dir / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    live = tmp_path / "live"
    live.mkdir()
    (live / "run.json").write_bytes((whole.run_dir / "run.json").read_bytes())
    (live / "metrics.jsonl").write_bytes(lines[0])  # the session has opened its log
    checkpoint_lines = {index: json.loads(line)["step"] for index, line in enumerate(lines)
                        if json.loads(line)["event"] == "checkpoint"}
    writer_done = threading.Event()

    def writer():
        with open(live / "metrics.jsonl", "ab", buffering=0) as handle:
            for index, line in enumerate(lines):
                if index == 0:
                    continue
                if index in checkpoint_lines:  # commit the marker (temp + rename), then log its line
                    step = checkpoint_lines[index]
                    source = whole.run_dir / "checkpoints" / f"step-{step:08d}"
                    folder = live / "checkpoints" / f"step-{step:08d}"
                    folder.mkdir(parents=True)
                    (folder / "state.pt").write_bytes((source / "state.pt").read_bytes())
                    (folder / "COMMITTED.json.tmp").write_bytes((source / "COMMITTED.json").read_bytes())
                    os.replace(folder / "COMMITTED.json.tmp", folder / "COMMITTED.json")
                handle.write(line)
        writer_done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    reads = []
    try:
        while not writer_done.is_set() or not reads:
            summary = summarize_run(live)
            assert summary.valid, summary.reasons
            reads.append(summary.final.step)
    finally:
        thread.join()
    assert summarize_run(live).valid and summarize_run(live).final.step == 200
    assert reads == sorted(reads)
