"""pilotrun/run/run_folder.py: run.json, metrics.jsonl and the markers read once, by summarize, verdict and
watch alike; a live log read by what it grew, parsed as the tolerant reader parses the whole file."""

from __future__ import annotations

import builtins
import collections
import io
import json
import os
from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from pilotrun.report.watch.alerts import Watcher
from pilotrun.run.record import RecordError, read_metrics_tolerant
from pilotrun.run.run_folder import RunFolder
from tests.report.synthetic import SyntheticRun, crashed_and_resumed

COUNTED = ("run.json", "metrics.jsonl", "COMMITTED.json")


@pytest.fixture
def opens(monkeypatch):
    """How often each of COUNTED was opened (by any path: builtins.open, io.open, os.open)."""
    counts: collections.Counter = collections.Counter()
    real_open, real_os_open = builtins.open, os.open

    def counting(file, *args, **kwargs):
        if isinstance(file, str | Path) and Path(file).name in COUNTED:
            counts[Path(file).name] += 1
        return real_open(file, *args, **kwargs)

    def counting_os(path, *args, **kwargs):
        if Path(path).name in COUNTED:
            counts[Path(path).name] += 1
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    monkeypatch.setattr(io, "open", counting)  # pathlib's read_bytes / read_text open through io.open
    monkeypatch.setattr(os, "open", counting_os)
    return counts


@pytest.mark.parametrize(
    "command", [["summarize"], ["verdict"], ["watch"], ["summarize", "--require-step", "60"]]
)
def test_summarize_verdict_and_watch_read_run_json_and_metrics_jsonl_once(tmp_path, opens, capsys, command):
    run_dir = crashed_and_resumed(tmp_path / "r").write()  # three committed checkpoints: 20, 40, 60
    opens.clear()
    assert main([command[0], str(run_dir), *command[1:]]) == 0
    assert opens == {"run.json": 1, "metrics.jsonl": 1, "COMMITTED.json": 3}, capsys.readouterr()


def _live(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(33)
    run.kill()
    return run.write(), run


def test_one_watch_poll_reads_each_file_once_and_nothing_when_nothing_changed(tmp_path, opens):
    run_dir, run = _live(tmp_path)
    watcher = Watcher(run_dir, clock=lambda: run.clock, holder=lambda _: {"pid": 1})
    watcher.check(final=True)
    run.resume()  # a resumed session: run.json replaced, lines appended, a checkpoint committed at 40
    run.train_until(45)
    run.write()
    opens.clear()
    watcher.check(final=True)
    # The synthetic writer writes step 20's marker again beside the new one at 40: each is read once.
    assert opens == {"run.json": 1, "metrics.jsonl": 1, "COMMITTED.json": 2}
    assert (
        watcher.events[-1]["step"] == 45
        and watcher.folder.run["sessions"][-1]["session_id"] == run.session_id
    )
    opens.clear()
    watcher.check(final=True)
    assert opens == {}  # nothing was written: no file opened


def test_a_growing_log_parses_as_the_tolerant_reader_parses_the_whole_file(tmp_path):
    run_dir = crashed_and_resumed(tmp_path / "r").write()
    path = run_dir / "metrics.jsonl"
    whole = path.read_bytes()
    lines = whole.splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:5]) + lines[5][:30])  # a writer halfway through line 6
    folder = RunFolder(run_dir)
    assert folder.metrics == read_metrics_tolerant(run_dir) and folder.metrics.notes  # the torn tail, noted
    path.write_bytes(whole)
    folder.read_metrics()
    assert folder.metrics == read_metrics_tolerant(run_dir) and not folder.metrics.notes
    assert len(folder.metrics.events) == len(lines) and folder.rewrites == 0
    path.write_bytes(b"".join(lines[:2]))  # shorter than what was read: rewritten, read again from the start
    folder.read_metrics()
    assert folder.rewrites == 1 and folder.metrics == read_metrics_tolerant(run_dir)
    path.unlink()
    folder.read_metrics()
    assert folder.metrics == read_metrics_tolerant(run_dir) and folder.metrics.missing


def test_a_marker_is_read_again_only_once_replaced_and_the_folder_must_be_a_run(tmp_path, opens):
    run_dir = crashed_and_resumed(tmp_path / "r").write()
    folder = RunFolder(run_dir)
    heads, owners = folder.checkpoint_heads()
    assert sorted(heads) == [20, 40, 60] and set(owners.values()) == {None}
    opens.clear()
    assert folder.checkpoint_heads() == (heads, owners) and folder.checkpoint_problems(60)[0] == []
    assert opens == {}
    marker_path = run_dir / "checkpoints" / "step-00000060" / "COMMITTED.json"
    marker = json.loads(marker_path.read_text())
    marker["meta"]["metrics_chain_head"] = "0" * 64
    replacement = marker_path.with_name("COMMITTED.json.tmp")
    replacement.write_text(json.dumps(marker))
    replacement.replace(marker_path)  # committed again at the same step, as the checkpointer renames
    opens.clear()
    assert folder.checkpoint_heads()[0][60] == "0" * 64 and opens == {"COMMITTED.json": 1}
    with pytest.raises(RecordError, match="not found"):
        RunFolder(tmp_path / "nothing")
    assert RunFolder.of(folder) is folder


def test_a_checkpoint_committed_while_summarize_reads_is_not_a_rewritten_log(tmp_path, monkeypatch):
    """The writer appends a checkpoint's line, then commits its marker. A reader that read the log before the
    markers would see a marker naming a line it had not read; the folder reads the markers first."""
    from pilotrun.report.record_check.summarize import summarize_run
    from pilotrun.run import run_folder

    whole = SyntheticRun(tmp_path / "whole")
    whole.start_session()
    whole.train_until(45)
    whole.write()
    lines = (whole.run_dir / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    live = whole.copy()
    live.run_dir = tmp_path / "live"
    live.checkpoints = {20: whole.checkpoints[20]}  # the marker at 40 is not committed yet
    live.write()
    (live.run_dir / "metrics.jsonl").write_bytes(b"".join(lines[:-8]))  # nor are the last lines written
    real, moved = run_folder.committed_checkpoint_steps, []

    def writer_moves_on(path):  # between two reads, the run writes its lines and commits step 40
        if moved:
            return real(path)
        moved.append(True)
        with open(live.run_dir / "metrics.jsonl", "ab") as handle:
            handle.write(b"".join(lines[-8:]))
        whole.run_dir, saved = live.run_dir, whole.run_dir
        whole.write_checkpoint(40, whole.checkpoints[40])
        whole.run_dir = saved
        return real(path)

    monkeypatch.setattr(run_folder, "committed_checkpoint_steps", writer_moves_on)
    folder = RunFolder(live.run_dir)
    folder.read_metrics()  # what a caller holding the folder may have read already (watch's follower)
    summary = summarize_run(folder)
    assert summary.valid, summary.reasons
    assert folder.committed_steps() == [20, 40] and summary.final.step == 45
