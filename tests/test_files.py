"""The file primitives every writer stands on: the canonical JSON of identities, file hashes, atomic writes."""

import hashlib
import json
import math

import pytest

from pilotrun.files import canonical_json, canonical_sha256, sha256_of_file, write_text_atomic


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
    import pilotrun.files as files

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
