"""`pilotrun data merge`: parts prepared separately become one folder that verifies and reads back as the
parts' splits in turn; parts that differ (tokenizer, vocab, dtype, EOS, options), a damaged part, an existing
or symbolic-link --out are refused with one line, exit 2, and nothing written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from pilotrun.commands.cli import main
from pilotrun.data.merge import merge_data
from pilotrun.data.reader import open_dataset
from pilotrun.data.shards import metadata_sha256

from .conftest import FINEWEB_JSONL, GPT2_TOKENIZER

pytestmark = pytest.mark.shared_fixtures  # every test here merges parts prepared from them


def _prepare(out: Path, source: Path, tokenizer: Path | str, *extra: str) -> Path:
    assert main(["prepare", "--out", str(out), "--source", str(source), "--tokenizer", str(tokenizer),
                 "--shard-tokens", "6000", "--val-fraction", "0.1", "--shuffle-buffer", "8", "--workers", "1",
                 *extra]) == 0
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Path]:
    """The fixture documents in three disjoint jsonl files (as one would split a corpus by file)."""
    if not FINEWEB_JSONL.exists() or not GPT2_TOKENIZER.exists():
        pytest.skip(f"shared test fixtures under {FINEWEB_JSONL.parents[1]} are absent")
    texts = [
        json.loads(line)["text"] for line in FINEWEB_JSONL.read_text(encoding="utf-8").splitlines() if line
    ]
    folder = tmp_path_factory.mktemp("source")
    paths = []
    for index in range(3):
        path = folder / f"part-{index}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[index * 50:(index + 1) * 50]))
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def parts(tmp_path_factory, sources) -> list[Path]:
    """Prepared once for the module: every test reads them or copies them, none changes them."""
    folder = tmp_path_factory.mktemp("parts")
    return [_prepare(folder / f"part{index}", source, GPT2_TOKENIZER) for index, source in enumerate(sources)]


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_merged_folder_verifies_and_reads_as_the_parts_in_turn(tmp_path, parts, capsys):
    before = {str(p): _tree(p) for p in parts}
    out = tmp_path / "merged"
    capsys.readouterr()
    assert main(["data", "merge", "--out", str(out), *map(str, parts)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"merged 3 parts into {out}: train ") and "hard-linked, each rehashed" in line
    assert main(["data", "verify", str(out)]) == 0
    merged = open_dataset(out)
    part_sets = [open_dataset(p) for p in parts]
    for split in ("train", "val"):
        expected = np.concatenate([d.split(split).read(0, d.split(split).num_tokens) for d in part_sets])
        assert np.array_equal(merged.split(split).read(0, merged.split(split).num_tokens), expected)
        assert merged.split(split).documents == sum(d.split(split).documents for d in part_sets)
    manifest = merged.metadata
    assert [p["metadata_sha256"] for p in manifest["merged_from"]] == [d.metadata_sha256 for d in part_sets]
    shards = manifest["splits"]["train"]["shards"]
    assert [s["file"] for s in shards] == [f"train_{i:05d}.npy" for i in range(len(shards))]  # one sequence
    assert [s["part"] for s in shards] == sorted(s["part"] for s in shards) and shards[-1]["part"] == 2
    assert str(tmp_path) not in (out / "metadata.json").read_text()
    assert (out / "tokenizer.json").read_bytes() == (parts[0] / "tokenizer.json").read_bytes()
    assert {str(p): _tree(p) for p in parts} == before  # the parts are left as they were
    assert not [name for name in os.listdir(tmp_path) if ".merge-" in name]


def test_the_same_parts_give_the_same_identity_wherever_they_lie_copied_or_linked(tmp_path, parts):
    first = merge_data(tmp_path / "a", parts)
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    copies = [Path(shutil.copytree(p, moved / p.name)) for p in parts]
    placed: dict[str, int] = {}
    second = merge_data(tmp_path / "b", copies, copy=True, placed=placed)
    assert metadata_sha256(first) == metadata_sha256(second) and set(placed) == {"copied"}
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    reordered = merge_data(tmp_path / "c", [parts[1], parts[0], parts[2]])
    assert metadata_sha256(reordered) != metadata_sha256(first)  # the order is part of the data


def _refused(tmp_path, capsys, out: Path, folders: list[Path], existed: bool = False) -> str:
    capsys.readouterr()
    assert main(["data", "merge", "--out", str(out), *map(str, folders)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert os.path.lexists(out) == existed
    assert not [name for name in os.listdir(out.parent) if ".merge-" in name]
    return err


def test_parts_with_another_tokenizer_vocab_eos_or_options_are_refused(tmp_path, capsys, parts, sources,
                                                                       gpt2_tokenizer_path):
    out = tmp_path / "merged"
    bpe = _prepare(tmp_path / "bpe", sources[0], "bpe:300")
    err = _refused(tmp_path, capsys, out, [parts[0], bpe])
    assert "parts differ in tokenizer (sha256 of tokenizer.json)" in err and str(bpe) in err
    edited = json.loads(gpt2_tokenizer_path.read_text())
    edited["added_tokens"].append({**edited["added_tokens"][0], "id": 50257, "content": "<|extra|>"})
    bigger = tmp_path / "bigger.json"
    bigger.write_text(json.dumps(edited))
    other = _prepare(tmp_path / "bigger", sources[1], bigger)
    assert "parts differ in tokenizer" in _refused(tmp_path, capsys, out, [parts[0], other])
    seeded = _prepare(tmp_path / "seeded", sources[1], gpt2_tokenizer_path, "--seed", "9")
    assert "parts differ in options.seed: " in _refused(tmp_path, capsys, out, [parts[0], seeded])
    fraction = _prepare(tmp_path / "fraction", sources[1], gpt2_tokenizer_path, "--val-fraction", "0.2")
    assert "options.val_fraction" in _refused(tmp_path, capsys, out, [parts[0], fraction])
    assert "same data" in _refused(tmp_path, capsys, out, [parts[0], parts[0]])


def test_a_part_whose_manifest_claims_differ_is_refused_by_field(tmp_path, capsys, parts):
    """The vocab, dtype and EOS checks (same tokenizer bytes, a hand-edited manifest), named in one line
    each."""
    for field, value, what in (("vocab_size", 60000, "vocab_size"), ("eos_id", 0, "EOS id")):
        edited = tmp_path / f"edited-{field}"
        shutil.copytree(parts[1], edited)
        manifest = json.loads((edited / "metadata.json").read_text())
        manifest["tokenizer"][field] = value
        (edited / "metadata.json").write_text(json.dumps(manifest))
        assert f"parts differ in {what}: " in _refused(
            tmp_path, capsys, tmp_path / "merged", [parts[0], edited]
        )
    edited = tmp_path / "edited-dtype"
    shutil.copytree(parts[1], edited)
    manifest = json.loads((edited / "metadata.json").read_text())
    manifest["dtype"] = "uint32"
    (edited / "metadata.json").write_text(json.dumps(manifest))
    assert "parts differ in dtype: " in _refused(tmp_path, capsys, tmp_path / "merged", [parts[0], edited])


def test_a_damaged_part_is_refused_and_nothing_is_left(tmp_path, capsys, parts):
    damaged = tmp_path / "damaged"
    shutil.copytree(parts[2], damaged)
    shard = damaged / "train_00001.npy"
    data = bytearray(shard.read_bytes())
    data[-2:] = b"\x00\x00"
    shard.write_bytes(bytes(data))
    err = _refused(tmp_path, capsys, tmp_path / "merged", [parts[0], damaged])
    assert "train_00001.npy: sha256 differs" in err


def test_an_existing_or_linked_out_and_an_out_inside_a_part_are_refused(tmp_path, capsys, parts):
    existing = tmp_path / "existing"
    existing.mkdir()
    assert "already exists" in _refused(tmp_path, capsys, existing, parts[:2], existed=True)
    assert os.listdir(existing) == []
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    assert "already exists" in _refused(tmp_path, capsys, link, parts[:2], existed=True)
    assert not (tmp_path / "nowhere").exists()
    assert "inside part" in _refused(tmp_path, capsys, parts[0] / "merged", parts[:2])
    assert "at least two parts" in _refused(tmp_path, capsys, tmp_path / "merged", parts[:1])
