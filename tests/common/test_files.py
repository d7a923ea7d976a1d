"""The file primitives every writer stands on: the canonical JSON of identities, file hashes, atomic
writes."""

import hashlib
import json
import math
import os
from pathlib import Path

import pytest

from pilotrun.common.errors import PilotrunError
from pilotrun.common.files import canonical_json, canonical_sha256, sha256_of_file, write_text_atomic


def test_canonical_sha256_ignores_key_order_and_formatting():
    assert canonical_sha256({"b": 1, "a": [1, 2]}) == canonical_sha256({"a": [1, 2], "b": 1})
    assert canonical_sha256({"a": 1}) != canonical_sha256({"a": 1.5})


def test_canonical_json_is_sorted_compact_utf8_and_refuses_nan():
    assert canonical_json({"b": "é", "a": [1, 2.5]}) == '{"a":[1,2.5],"b":"é"}'.encode()
    # A NaN has no JSON spelling: an identity that held one could not be recomputed by another reader.
    with pytest.raises(ValueError):
        canonical_json({"loss": math.nan})
    assert canonical_sha256({"a": 1}) == hashlib.sha256(b'{"a":1}').hexdigest()


def test_sha256_of_file_reads_in_chunks_to_the_same_digest(tmp_path, monkeypatch):
    import pilotrun.common.files as files

    path = tmp_path / "blob"
    payload = bytes(range(256)) * 1000
    path.write_bytes(payload)
    monkeypatch.setattr(files, "HASH_CHUNK_BYTES", 1000)  # many chunks, one digest
    assert sha256_of_file(path) == hashlib.sha256(payload).hexdigest()


def test_write_text_atomic_replaces_the_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "run.json"
    target.write_text("old")
    write_text_atomic(target, json.dumps({"new": True}))
    assert json.loads(target.read_text()) == {"new": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_a_link_at_the_target_or_as_its_folder_is_refused_and_nothing_written(tmp_path):
    from pilotrun.common.files import LinkRefused, open_for_write, plain_folder, write_text_atomic

    outside = tmp_path / "outside"
    outside.write_text("mine")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "out.json").symlink_to(outside)
    (tmp_path / "run" / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "linked-folder").symlink_to(tmp_path / "run", target_is_directory=True)
    for write in (lambda: write_text_atomic(tmp_path / "run" / "out.json", "new"),
                  lambda: open_for_write(tmp_path / "run" / "out.json", "a"),
                  lambda: open_for_write(tmp_path / "run" / "dangling", "w"),
                  lambda: plain_folder(tmp_path / "linked-folder")):
        with pytest.raises(LinkRefused, match="is a symbolic link"):
            write()
    assert outside.read_text() == "mine" and not (tmp_path / "nowhere").exists()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["dangling", "out.json"]  # no temp left
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(PilotrunError, match="is a file, not a folder"):
        plain_folder(tmp_path / "a-file")


def test_a_failed_atomic_write_removes_its_temp_and_keeps_the_old_file(tmp_path, monkeypatch):
    from pilotrun.common import files

    target = tmp_path / "summary.json"
    target.write_text("old")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        files.write_text_atomic(target, "new")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


@pytest.mark.slow
def test_stale_temps_of_a_dead_writer_are_found_named_and_removed(tmp_path):
    import subprocess
    import sys

    from pilotrun.common.files import recover_folder, remove_stale_temps, stale_temps

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / f".lock.json.tmp-{dead}").write_text("half")
    (tmp_path / f".lock.json.tmp-{os.getpid()}").write_text("mine, still writing")
    (tmp_path / f".other.json.tmp-{dead}").write_text("not this output's")
    (tmp_path / f".export.tmp-{dead}").mkdir()
    assert [p.name for p in stale_temps(tmp_path, "lock.json")] == [f".lock.json.tmp-{dead}"]
    lines = remove_stale_temps(tmp_path, "lock.json") + remove_stale_temps(tmp_path, "export")
    assert len(lines) == 2 and all("removed" in line and dead in line for line in lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f".lock.json.tmp-{os.getpid()}",
                                                                 f".other.json.tmp-{dead}"])
    # A report swap killed between its renames: the older copy is put back.
    (tmp_path / f".report.replaced-{dead}").mkdir()
    (tmp_path / f".report.replaced-{dead}" / "report.html").write_text("old report")
    assert "restored" in recover_folder(tmp_path / "report")[0]
    assert (tmp_path / "report" / "report.html").read_text() == "old report"


def test_refuse_wrong_kind_names_the_kind_and_lets_a_missing_path_pass(tmp_path):
    from pilotrun.common.files import refuse_wrong_kind

    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    with pytest.raises(PilotrunError, match=r"^--data .*/f is a file, not a folder$"):
        refuse_wrong_kind(tmp_path / "f", "folder", "--data")
    with pytest.raises(PilotrunError, match=r"/d is a folder, not a file$"):
        refuse_wrong_kind(tmp_path / "d", "file")
    with pytest.raises(PilotrunError, match=r"/f/run/x: .*/f is a file, not a folder$"):
        refuse_wrong_kind(tmp_path / "f" / "run" / "x", "folder")
    for path, kind in (
        (tmp_path / "f", "file"),
        (tmp_path / "d", "folder"),
        (tmp_path / "d" / "new", "folder"),
    ):
        assert refuse_wrong_kind(path, kind) is None  # the right kind, or missing under a folder: passes


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_device_or_a_fifo_is_named_for_what_it_is_as_config_source_tokenizer_and_shard(tmp_path, kind):
    """A path that exists but is no regular file: never "not found", "no such file" or "a folder", and never
    opened (/dev/zero would be read forever, a FIFO with no writer would block)."""
    from pilotrun.common.errors import PilotrunError
    from pilotrun.common.files import not_regular
    from pilotrun.config import resolve_recipe_path
    from pilotrun.data.shards import check_shard
    from pilotrun.data.sources import open_source
    from pilotrun.data.tokenizer import resolve_tokenizer

    if kind == "fifo":
        path = tmp_path / "train_00000.npy"
        os.mkfifo(path)
        what = "a FIFO (named pipe), not a regular file"
    else:
        path = Path("/dev/zero")
        what = "a character device, not a regular file"
    assert (
        not_regular(path) == what and not_regular(tmp_path) is None and not_regular(tmp_path / "none") is None
    )
    for call in (lambda: resolve_recipe_path(path), lambda: open_source(str(path)),
                 lambda: resolve_tokenizer(str(path)), lambda: check_shard(str(path), "uint16", 10)):
        with pytest.raises(PilotrunError) as refused:
            call()
        assert f"{path}" in str(refused.value) and what in str(refused.value), str(refused.value)
