"""The partial folder of an interruptible prepare: differences named, the lock, commits written last,
leftovers cleared, the rename into place, the stop requests, and the peak-memory reading."""

from __future__ import annotations

import json
import os
import signal

import pytest

from pilotrun.common.errors import DataError
from pilotrun.data.prepare_state import (
    PROGRESS_FILE,
    PartialFolder,
    StopRequests,
    differences,
    peak_resident_mb,
)


def test_differences_name_each_changed_leaf():
    recorded = {
        "tokenizer": "bpe:300",
        "options": {"seed": 7, "shard_tokens": 5000},
        "source": {"files": [1]},
    }
    current = {
        "tokenizer": "bpe:400",
        "options": {"seed": 7, "shard_tokens": 6000, "new": True},
        "source": {"files": [1]},
    }
    assert differences(recorded, current) == ['options.new: now true, recorded null',
                                              'options.shard_tokens: now 6000, recorded 5000',
                                              'tokenizer: now "bpe:400", recorded "bpe:300"']
    assert differences(recorded, json.loads(json.dumps(recorded))) == []


def test_a_second_prepare_of_the_same_folder_is_refused_while_the_first_holds_it(tmp_path):
    first = PartialFolder(str(tmp_path / "out"))
    assert first.open() is None and first.created
    second = PartialFolder(str(tmp_path / "out"))
    with pytest.raises(
        DataError, match=f"held by another pilotrun prepare still running \\(pid {os.getpid()} on host "
    ):
        second.open()
    first.close()
    assert second.open() is None and not second.created  # released: the folder can be taken again
    second.close()


def test_a_prepare_refused_before_the_holder_wrote_its_name_waits_for_the_name(tmp_path):
    """The holder takes the lock and only then writes its name into the mark: a second prepare refused in that
    gap waits for the name rather than naming nobody (the race two real prepares started together can hit)."""
    import fcntl
    import threading

    from pilotrun.data.prepare_state import OWN_MARK, PROGRESS_FORMAT

    folder = tmp_path / "out.partial"
    folder.mkdir()
    (folder / OWN_MARK).write_text(json.dumps({"format": PROGRESS_FORMAT, "out": "out"}))
    held = os.open(folder, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked, the name not yet written

    def name_the_holder():
        (folder / OWN_MARK).write_text(json.dumps({
            "format": PROGRESS_FORMAT, "out": "out", "holder": {"pid": 4242, "host": "node7"}}))

    writer = threading.Timer(0.3, name_the_holder)
    writer.start()
    try:
        with pytest.raises(DataError, match=r"still running \(pid 4242 on host node7\)"):
            PartialFolder(str(tmp_path / "out")).open(wait_seconds=60)
        # no name ever written, no wait: the refusal still comes, naming nobody
        (folder / OWN_MARK).write_text(json.dumps({"format": PROGRESS_FORMAT, "out": "out"}))
        with pytest.raises(DataError, match="prepare still running; wait for it"):
            PartialFolder(str(tmp_path / "out")).open(wait_seconds=0)
    finally:
        writer.join()
        os.close(held)


def test_an_uncommitted_attempt_is_cleared_and_a_committed_one_returned(tmp_path):
    from pilotrun.data.prepare_state import OWN_MARK

    folder = tmp_path / "out.partial"
    first = PartialFolder(str(tmp_path / "out"))
    first.open()  # makes the folder with its mark
    first.close()
    (folder / "train_00000.npy").write_bytes(b"half")  # written by an attempt killed before its first commit
    partial = PartialFolder(str(tmp_path / "out"))
    assert partial.open() is None and [p.name for p in folder.iterdir()] == [OWN_MARK]
    partial.commit({"state": {"documents_done": 3}})
    partial.close()
    again = PartialFolder(str(tmp_path / "out"))
    assert again.open()["state"] == {"documents_done": 3}
    again.close()
    (folder / PROGRESS_FILE).write_text('{"format": "something else"}')
    with pytest.raises(DataError, match="not a progress file"):
        PartialFolder(str(tmp_path / "out")).open()


def test_a_file_in_the_way_is_refused(tmp_path):
    (tmp_path / "out.partial").write_text("mine")
    with pytest.raises(DataError, match="in the way"):
        PartialFolder(str(tmp_path / "out")).open()
    assert (tmp_path / "out.partial").read_text() == "mine"


def test_commit_then_obsolete_files_go_and_finish_keeps_only_the_data(tmp_path):
    partial = PartialFolder(str(tmp_path / "out"))
    partial.open()
    obsolete = tmp_path / "out.partial" / "train_00000.pending"
    obsolete.write_bytes(b"\0\0")
    partial.commit({"state": None}, [str(obsolete)])
    assert not obsolete.exists() and (tmp_path / "out.partial" / PROGRESS_FILE).exists()
    for name in ("metadata.json", "train_00000.npy", "train_00001.npy", "val_00000.pending"):
        (tmp_path / "out.partial" / name).write_text("x")
    partial.keep_only({"metadata.json", "train_00000.npy"})
    partial.finish(force=False)
    partial.close()
    assert sorted(os.listdir(tmp_path)) == ["out"]
    # progress.json dropped
    assert sorted(os.listdir(tmp_path / "out")) == ["metadata.json", "train_00000.npy"]


def test_finish_with_force_replaces_the_old_folder_only_after_the_rename(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("old")
    partial = PartialFolder(str(tmp_path / "out"))
    partial.open()
    (tmp_path / "out.partial" / "new").write_text("new")
    with pytest.raises(DataError, match="appeared while preparing"):
        partial.finish(force=False)
    partial.finish(force=True)
    partial.close()
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(tmp_path / "out") == ["new"]


def test_a_force_killed_between_its_renames_leaves_the_old_folder_recoverable(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    assert "stays whole" in PartialFolder.recover_replaced(str(out), force=True)[0]  # says where it will be
    partial = PartialFolder(str(out))
    partial.open()
    (tmp_path / "out.partial" / "new").write_text("new")
    real_rename = os.rename

    def killed_after_first(source, target):
        real_rename(source, target)
        if str(target).endswith(".replaced"):
            raise KeyboardInterrupt  # as if SIGKILLed between the two renames

    monkeypatch.setattr(os, "rename", killed_after_first)
    with pytest.raises(KeyboardInterrupt):
        partial.finish(force=True)
    monkeypatch.setattr(os, "rename", real_rename)
    partial.close()
    assert not out.exists() and (tmp_path / "out.partial.replaced" / "old").read_text() == "old"  # visible
    line = PartialFolder.recover_replaced(str(out))[0]
    assert line.startswith(f"restored {out}") and "out.partial.replaced" in line
    assert (out / "old").read_text() == "old"
    # Killed after the second rename: the stale old copy beside the finished folder is removed, named.
    (tmp_path / "out.partial.replaced").mkdir()
    assert "removed" in PartialFolder.recover_replaced(str(out))[0]
    assert not (tmp_path / "out.partial.replaced").exists()


def test_stop_requests_record_the_first_signal_and_a_second_stops_at_once():
    stops = StopRequests()
    before = signal.getsignal(signal.SIGTERM)
    with stops.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        assert stops.signum == signal.SIGTERM and stops.exit_code == 143
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_peak_resident_memory_is_measured():
    assert peak_resident_mb() > 10


def test_a_partial_folder_prepare_did_not_make_is_refused_untouched_and_its_own_is_reopened(tmp_path):
    from pilotrun.data.prepare_state import OWN_MARK, PartialFolder

    out = tmp_path / "corpus"
    theirs = tmp_path / "corpus.partial"
    (theirs / "notes").mkdir(parents=True)
    (theirs / "notes" / "draft.txt").write_text("mine")
    (theirs / "shard.bin").write_bytes(b"\x00\x01")
    with pytest.raises(
        DataError, match="is not the folder of an interrupted pilotrun prepare .* not touching it"
    ):
        PartialFolder(str(out)).open()
    assert (theirs / "notes" / "draft.txt").read_text() == "mine" and (
        theirs / "shard.bin"
    ).read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in theirs.iterdir()) == ["notes", "shard.bin"]

    mine = PartialFolder(str(tmp_path / "other"))
    assert mine.open() is None and mine.created
    (tmp_path / "other.partial" / "tokenizer.json.tmp").write_text("{")  # killed before its first commit
    mine.close()
    again = PartialFolder(str(tmp_path / "other"))
    assert again.open() is None and not again.created  # its own mark: reopened, emptied but for the mark
    assert sorted(p.name for p in (tmp_path / "other.partial").iterdir()) == [OWN_MARK]
    again.close()
