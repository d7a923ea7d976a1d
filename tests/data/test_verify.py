"""`data verify`: a rehash finds what the startup check cannot (a flipped byte), and names every bad file."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from pilotrun.commands.cli import main
from pilotrun.common.errors import DataError
from pilotrun.data.prepare import prepare_corpus
from pilotrun.data.reader import open_dataset
from pilotrun.data.verify import verify_data


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "data"
    prepare_corpus(out, source="builtin", tokenizer="bpe:300", train_tokens=20_000, shard_tokens=6_000,
                   val_fraction=0.05, workers=1, progress=False)
    return out


@pytest.fixture
def copy(prepared, tmp_path):
    target = tmp_path / "data"
    shutil.copytree(prepared, target)
    return target


def test_intact_folder_has_no_problems(prepared, capsys):
    assert verify_data(prepared) == []
    assert main(["data", "verify", str(prepared)]) == 0
    assert "intact" in capsys.readouterr().out


def test_a_flipped_byte_is_found_though_the_reader_still_opens(copy, capsys):
    path = copy / "train_00001.npy"
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01  # a token changes value; size, dtype and shape do not
    path.write_bytes(bytes(raw))
    open_dataset(copy)  # the startup check cannot see it: that is what verify is for
    problems = verify_data(copy)
    assert len(problems) == 1 and "train_00001.npy" in problems[0] and "sha256" in problems[0]
    assert main(["data", "verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "train_00001.npy" in out and "damaged" in out


def test_every_bad_file_is_named(copy):
    (copy / "train_00000.npy").unlink()
    truncated = copy / "train_00002.npy"
    truncated.write_bytes(truncated.read_bytes()[:-3])
    (copy / "tokenizer.json").write_text("{}")
    np.save(copy / "train_00099.npy", np.zeros(3, dtype=np.uint16))
    problems = "\n".join(verify_data(copy))
    for name in ("train_00000.npy: missing", "train_00002.npy", "tokenizer.json", "train_00099.npy"):
        assert name in problems


def test_manifest_claims_about_documents_are_checked(copy):
    # A manifest that was edited to claim another document count (its shards untouched) no longer adds up.
    path = copy / "metadata.json"
    manifest = json.loads(path.read_text())
    manifest["splits"]["train"]["documents"] += 1
    path.write_text(json.dumps(manifest))
    problems = verify_data(copy)
    assert len(problems) == 1 and "EOS ids" in problems[0]


def test_not_a_data_folder(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        verify_data(tmp_path / "nowhere")
    assert main(["data", "verify", str(tmp_path / "nowhere")]) == 2
    problems = verify_data(tmp_path)
    assert len(problems) == 1 and "metadata.json is missing" in problems[0]
