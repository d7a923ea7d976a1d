"""pilotrun/run/export_undo.py: each place a failed export wrote is put back as it was before it."""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from pilotrun.run.export_undo import Places
from tests.run.tracker_runs import tree


def test_a_place_the_export_made_goes_a_file_is_written_back_in_place_and_a_folder_loses_what_was_added(
    tmp_path,
):
    store, folder, made = tmp_path / "store.db", tmp_path / "logs", tmp_path / "new"
    store.write_bytes(b"before")
    (folder / "old").mkdir(parents=True)
    (folder / "old" / "a.log").write_text("a")
    (folder / "latest").symlink_to("old")
    before = tree(tmp_path)
    inode = store.stat().st_ino
    places = Places.take([store, folder, made])
    with store.open("ab") as f:  # what an export writes: appended, added, a link moved, a place made
        f.write(b" and half an export")
    (folder / "run-2" / "files").mkdir(parents=True)
    (folder / "run-2" / "files" / "b.bin").write_bytes(b"b")
    (folder / "latest").unlink()
    (folder / "latest").symlink_to("run-2")
    (made / "x").mkdir(parents=True)
    done = places.restore()
    assert tree(tmp_path) == before and store.stat().st_ino == inode
    assert done == ["new removed", "store.db restored", "3 new path(s) under logs removed"]


def test_after_success_the_copies_go_and_the_places_stay_as_the_export_left_them(tmp_path):
    store = tmp_path / "store.db"
    store.write_bytes(b"before")
    places = Places.take([store])
    store.write_bytes(b"after")
    places.discard()
    assert [p.name for p in tmp_path.iterdir()] == ["store.db"] and store.read_bytes() == b"after"


def test_a_copy_that_does_not_fit_is_removed_and_the_failure_raised(tmp_path, monkeypatch):
    store = tmp_path / "store.db"
    store.write_bytes(b"before")

    def half_copy(source, target):
        open(target, "wb").write(b"bef")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copy2", half_copy)
    with pytest.raises(OSError, match="No space left"):
        Places.take([store])
    assert [p.name for p in tmp_path.iterdir()] == ["store.db"]
