"""prepare_corpus on real data (150 FineWeb-Edu documents, the real GPT-2 tokenizer) and the built-in
corpus."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from pilotrun.commands.cli import main
from pilotrun.common.errors import DataError
from pilotrun.data import prepare as prepare_module
from pilotrun.data.prepare import prepare_corpus
from pilotrun.data.reader import open_dataset
from pilotrun.data.shards import metadata_sha256
from pilotrun.data.stream import split_of

from .conftest import FAKE_SHA, LocalHub


def all_tokens(data_dir: Path, split: str) -> np.ndarray:
    manifest = json.loads((data_dir / "metadata.json").read_text())
    parts = [np.load(data_dir / s["file"]) for s in manifest["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.empty(0, dtype=manifest["dtype"])


def documents_of(tokens: np.ndarray, eos_id: int) -> list[np.ndarray]:
    ends = np.flatnonzero(tokens == eos_id)
    assert len(tokens) == 0 or ends[-1] == len(tokens) - 1, "the split must end with EOS"
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[s:e] for s, e in zip(starts, ends)]


def plain_gpt2(path: Path) -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.encode_special_tokens = True
    return tokenizer


def test_exact_token_counts_and_eos_after_every_document(
    tmp_path, fineweb_jsonl, fineweb_texts, gpt2_tokenizer_path
):
    out = tmp_path / "edu"
    manifest = prepare_corpus(
        out,
        source=str(fineweb_jsonl),
        tokenizer=str(gpt2_tokenizer_path),
        val_fraction=0.1,
        shuffle_buffer=0,
        workers=1,
        progress=False,
    )
    gpt2 = plain_gpt2(gpt2_tokenizer_path)
    # Independent count: the tokenizer's own one-at-a-time output, plus one EOS per document.
    expected = {"train": [], "val": []}
    for text in fineweb_texts:
        expected[split_of(text, 0.1)].append(gpt2.encode(text, add_special_tokens=False).ids)
    total = sum(len(ids) + 1 for ids in expected["train"] + expected["val"])
    assert total == 89_438  # the figure in ../shared/fixtures/README.md
    assert manifest["tokenizer"]["eos_id"] == 50256 and manifest["dtype"] == "uint16"
    for split in ("train", "val"):
        tokens = all_tokens(out, split)
        assert manifest["splits"][split]["tokens"] == len(tokens) == sum(len(i) + 1 for i in expected[split])
        assert manifest["splits"][split]["documents"] == len(expected[split])
        # shuffle_buffer=0 keeps source order: every document's ids are exactly the tokenizer's, then EOS.
        documents = documents_of(tokens, 50256)
        assert [d.tolist() for d in documents] == expected[split]
    assert manifest["splits"]["val"]["documents"] > 0


def test_literal_endoftext_in_text_is_not_eos(tmp_path, gpt2_tokenizer_path):
    source = tmp_path / "docs.jsonl"
    texts = ["before <|endoftext|> after", "a plain second document"]
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare_corpus(tmp_path / "out", source=str(source), tokenizer=str(gpt2_tokenizer_path), val_fraction=0.0,
                   shuffle_buffer=0, workers=1, progress=False)
    tokens = all_tokens(tmp_path / "out", "train")
    assert np.count_nonzero(tokens == 50256) == 2  # one per document, none from the literal text
    first = documents_of(tokens, 50256)[0]
    assert Tokenizer.from_file(str(gpt2_tokenizer_path)).decode(first.tolist()) == texts[0]


def test_shuffle_keeps_every_document_once_and_depends_on_seed(tmp_path, fineweb_jsonl, fineweb_texts,
                                                               gpt2_tokenizer_path):
    common = dict(source=str(fineweb_jsonl), tokenizer=str(gpt2_tokenizer_path), val_fraction=0.0, workers=1,
                  progress=False, shuffle_buffer=32)
    prepare_corpus(tmp_path / "s0", seed=0, **common)
    prepare_corpus(tmp_path / "s1", seed=1, **common)
    gpt2 = Tokenizer.from_file(str(gpt2_tokenizer_path))
    orders = []
    for name in ("s0", "s1"):
        texts = [gpt2.decode(d.tolist()) for d in documents_of(all_tokens(tmp_path / name, "train"), 50256)]
        assert sorted(texts) == sorted(fineweb_texts)
        orders.append(texts)
    assert orders[0] != orders[1] and orders[0] != fineweb_texts


def test_split_is_by_text_so_duplicates_share_a_split(tmp_path, fineweb_texts, gpt2_tokenizer_path):
    # Every text three times, scattered through the stream: each copy must land in its text's split.
    texts = fineweb_texts[:40] * 3
    source = tmp_path / "dup.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    manifest = prepare_corpus(tmp_path / "out", source=str(source), tokenizer=str(gpt2_tokenizer_path),
                              val_fraction=0.3, seed=5, shuffle_buffer=50, workers=1, progress=False)
    gpt2 = Tokenizer.from_file(str(gpt2_tokenizer_path))
    found = {}
    for split in ("train", "val"):
        for document in documents_of(all_tokens(tmp_path / "out", split), 50256):
            found.setdefault(gpt2.decode(document.tolist()), []).append(split)
    assert set(found) == set(fineweb_texts[:40])
    for text, splits in found.items():
        assert splits == [split_of(text, 0.3)] * 3
    assert 0 < manifest["splits"]["val"]["documents"] < manifest["splits"]["train"]["documents"]


def test_train_tokens_stops_after_the_document_that_reaches_it(tmp_path, fineweb_jsonl, gpt2_tokenizer_path):
    common = dict(source=str(fineweb_jsonl), tokenizer=str(gpt2_tokenizer_path), val_fraction=0.1,
                  shuffle_buffer=0, workers=1, progress=False)
    full = prepare_corpus(tmp_path / "full", **common)
    lengths = [len(d) + 1 for d in documents_of(all_tokens(tmp_path / "full", "train"), 50256)]
    cumulative = np.cumsum(lengths)
    target = int(cumulative[9]) - 5  # reached inside the 10th training document
    cut = prepare_corpus(tmp_path / "cut", train_tokens=target, **common)
    assert cut["splits"]["train"]["documents"] == 10
    assert cut["splits"]["train"]["tokens"] == int(cumulative[9]) >= target
    assert np.array_equal(
        all_tokens(tmp_path / "cut", "train"), all_tokens(tmp_path / "full", "train")[: cumulative[9]]
    )
    assert (
        cut["stream"]["stopped_at_train_tokens"] is True
        and full["stream"]["stopped_at_train_tokens"] is False
    )
    exact = prepare_corpus(tmp_path / "exact", train_tokens=int(cumulative[9]), **common)
    assert exact["splits"]["train"]["documents"] == 10  # exactly reaching N also stops there
    # Val holds exactly the val documents that came before the stop in the stream.
    assert cut["splits"]["val"]["documents"] <= full["splits"]["val"]["documents"]


def test_uint32_when_the_vocabulary_exceeds_65536(tmp_path):
    from tokenizers import models, pre_tokenizers, trainers

    # Train a word-level tokenizer on 70,000 distinct made-up words: more ids than uint16 can hold.
    words = [f"w{i:05d}" for i in range(70_000)]
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(
        vocab_size=80_000, special_tokens=["[UNK]", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator(
        [" ".join(words[i : i + 1000]) for i in range(0, 70_000, 1000)], trainer=trainer
    )
    assert tokenizer.get_vocab_size() > 65_536
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    texts = [" ".join(words[-200:]), " ".join(words[65_000:65_300])]
    (tmp_path / "a.txt").write_text(texts[0])
    (tmp_path / "b.txt").write_text(texts[1])
    manifest = prepare_corpus(
        tmp_path / "out",
        source=str(tmp_path / "*.txt"),
        tokenizer=str(tmp_path / "tokenizer.json"),
        val_fraction=0.0,
        shuffle_buffer=0,
        workers=1,
        progress=False,
    )
    assert manifest["dtype"] == "uint32" and manifest["tokenizer"]["eos_token"] == "</s>"
    tokens = all_tokens(tmp_path / "out", "train")
    assert tokens.dtype == np.uint32 and tokens.max() > 65_535
    eos = manifest["tokenizer"]["eos_id"]
    assert [d.tolist() for d in documents_of(tokens, eos)] == [tokenizer.encode(t).ids for t in texts]
    dataset = open_dataset(tmp_path / "out")
    assert dataset.split("train").read(0, 5).tolist() == tokens[:5].tolist()


def _tree_bytes(folder: Path) -> dict[str, bytes]:
    """Every file of a data folder but build_info.json (peak memory, seconds: this machine's figures, not
    data)."""
    return {
        p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != prepare_module.BUILD_INFO_FILE
    }


@pytest.mark.slow
def test_byte_identical_across_reruns_and_worker_counts(tmp_path, fineweb_parquet, gpt2_tokenizer_path):
    common = dict(source=str(fineweb_parquet), tokenizer=str(gpt2_tokenizer_path), val_fraction=0.05,
                  shard_tokens=20_000, shuffle_buffer=64, seed=3, progress=False)
    prepare_corpus(tmp_path / "w1", workers=1, **common)
    prepare_corpus(tmp_path / "w1_again", workers=1, **common)
    prepare_corpus(tmp_path / "w2", workers=2, **common)
    reference = _tree_bytes(tmp_path / "w1")
    # several shards, documents cut across them
    assert len([n for n in reference if n.startswith("train_")]) >= 4
    assert _tree_bytes(tmp_path / "w1_again") == reference
    assert _tree_bytes(tmp_path / "w2") == reference
    text = (tmp_path / "w1" / "metadata.json").read_text()
    assert str(tmp_path) not in text and "time" not in json.loads(text)


@pytest.mark.slow
def test_bpe_tokenizer_on_builtin_corpus_is_byte_identical_across_processes(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from pilotrun.data.prepare import prepare_corpus; "
            "prepare_corpus(sys.argv[1], source='builtin', tokenizer='bpe:1024', train_tokens=150000, "
            "workers=int(sys.argv[2]), progress=False)")
    for name, workers in (("a", "1"), ("b", "2")):
        subprocess.run([sys.executable, "-c", code, str(tmp_path / name), workers], check=True)
    assert _tree_bytes(tmp_path / "a") == _tree_bytes(tmp_path / "b")
    manifest = json.loads((tmp_path / "a" / "metadata.json").read_text())
    assert manifest["tokenizer"]["kind"] == "bpe" and manifest["tokenizer"]["vocab_size"] == 1024
    assert manifest["tokenizer"]["eos_token"] == "<|endoftext|>"
    assert manifest["source"]["characters"] >= 1_000_000 and manifest["splits"]["train"]["tokens"] >= 150_000


def test_manifest_whitespace_does_not_change_metadata_sha256(tmp_path, fineweb_jsonl, gpt2_tokenizer_path):
    manifest = prepare_corpus(tmp_path / "out", source=str(fineweb_jsonl), tokenizer=str(gpt2_tokenizer_path),
                              workers=1, progress=False)
    before = open_dataset(tmp_path / "out").metadata_sha256
    assert before == metadata_sha256(manifest)
    path = tmp_path / "out" / "metadata.json"
    path.write_text(json.dumps(json.loads(path.read_text()), indent=7) + "\n\n")
    assert open_dataset(tmp_path / "out").metadata_sha256 == before
    reordered = json.loads(path.read_text())
    reordered["options"]["seed"] = 99  # a real change does change it
    path.write_text(json.dumps(reordered))
    assert open_dataset(tmp_path / "out").metadata_sha256 != before


def test_existing_folder_is_refused_without_force_and_replaced_with_it(
    tmp_path, fineweb_jsonl, gpt2_tokenizer_path
):
    out = tmp_path / "out"
    common = dict(source=str(fineweb_jsonl), tokenizer=str(gpt2_tokenizer_path), workers=1, progress=False)
    first = prepare_corpus(out, train_tokens=1000, **common)
    with pytest.raises(DataError, match="already exists"):
        prepare_corpus(out, **common)
    assert json.loads((out / "metadata.json").read_text()) == first  # untouched
    second = prepare_corpus(out, force=True, **common)
    assert json.loads((out / "metadata.json").read_text()) == second != first
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary or replaced folder left behind


def test_force_never_replaces_a_folder_that_is_not_a_data_folder(
    tmp_path, fineweb_jsonl, gpt2_tokenizer_path
):
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("keep me")
    with pytest.raises(DataError, match="not a pilotrun data folder"):
        prepare_corpus(precious, source=str(fineweb_jsonl), tokenizer=str(gpt2_tokenizer_path), force=True,
                       progress=False)
    assert (precious / "thesis.tex").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    prepare_corpus(
        tmp_path / "empty",
        source=str(fineweb_jsonl),
        tokenizer=str(gpt2_tokenizer_path),
        force=True,
        train_tokens=1000,
        workers=1,
        progress=False,
    )
    assert (tmp_path / "empty" / "metadata.json").exists()


def test_interrupted_prepare_leaves_a_visible_partial_folder_not_a_finished_one(
    tmp_path, fineweb_jsonl, gpt2_tokenizer_path, monkeypatch
):
    calls = {"n": 0}
    original = prepare_module.ShardWriter.add

    def failing_add(self, tokens):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-way
        return original(self, tokens)

    monkeypatch.setattr(prepare_module.ShardWriter, "add", failing_add)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(tmp_path / "out", source=str(fineweb_jsonl), tokenizer=str(gpt2_tokenizer_path),
                       shard_tokens=1000, workers=1, progress=False)
    # The work so far stays, under a name that says what it is, and nothing looks like a finished folder.
    assert [p.name for p in tmp_path.iterdir()] == ["out.partial"]
    assert (tmp_path / "out.partial" / "progress.json").exists()
    assert not (tmp_path / "out.partial" / "metadata.json").exists()
    with pytest.raises(DataError, match="metadata.json is missing"):
        open_dataset(tmp_path / "out.partial")


@pytest.mark.slow
def test_folders_left_by_a_killed_prepare_are_cleaned_up(tmp_path, fineweb_jsonl, gpt2_tokenizer_path):
    import subprocess
    import sys

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    dead_pid = int(finished.stdout)  # a process that has exited: its partial folder is abandoned
    abandoned = tmp_path / f".out.partial-{dead_pid}"
    abandoned.mkdir()
    (abandoned / "train_00000.npy").write_bytes(b"half")
    alive = tmp_path / f".out.partial-{os.getppid()}"  # a live process: maybe a concurrent prepare
    alive.mkdir()
    prepare_corpus(tmp_path / "out", source=str(fineweb_jsonl), tokenizer=str(gpt2_tokenizer_path),
                   train_tokens=1000, workers=1, progress=False)
    assert not abandoned.exists() and alive.exists()


def test_fineweb_edu_through_the_hub_seam(tmp_path, fineweb_jsonl, fineweb_texts, gpt2_tokenizer_path):
    # No network: LocalHub serves the fixture texts as FineWeb-Edu rows and the GPT-2 tokenizer as gpt2's
    # file.
    hub = LocalHub(fineweb_texts, files={"gpt2/tokenizer.json": str(gpt2_tokenizer_path)})
    manifest = prepare_corpus(tmp_path / "hub", source="fineweb-edu@main", tokenizer="hub:gpt2", hub=hub,
                              shuffle_buffer=0, val_fraction=0.1, workers=1, progress=False)
    assert manifest["source"] == {
        "kind": "hub",
        "dataset": "HuggingFaceFW/fineweb-edu",
        "config": "sample-10BT",
        "split": "train",
        "revision_requested": "main",
        "revision": FAKE_SHA,
        "text_field": "text",
    }
    assert manifest["tokenizer"]["kind"] == "hub" and manifest["tokenizer"]["revision"] == FAKE_SHA
    # streamed at the SHA
    assert ("stream", "HuggingFaceFW/fineweb-edu", "sample-10BT", FAKE_SHA) in hub.calls
    assert ("download", "gpt2", "tokenizer.json", FAKE_SHA) in hub.calls
    # Same tokens as preparing the same texts from the local file.
    local = prepare_corpus(tmp_path / "local", source=str(fineweb_jsonl), tokenizer=str(gpt2_tokenizer_path),
                           shuffle_buffer=0, val_fraction=0.1, workers=1, progress=False)
    assert manifest["splits"] == local["splits"]


def test_hub_revision_that_is_not_a_commit_is_refused(tmp_path, fineweb_texts):
    hub = LocalHub(fineweb_texts, sha="main")
    with pytest.raises(DataError, match="not a commit SHA"):
        prepare_corpus(tmp_path / "x", source="fineweb-edu:sample-10BT", hub=hub, progress=False)


def test_bad_options_are_data_errors(tmp_path):
    for kwargs, message in (({"val_fraction": 1.0}, "val-fraction"), ({"shard_tokens": 0}, "shard-tokens"),
                            ({"shard_tokens": 2**31}, "shard-tokens"),
                            ({"train_tokens": 0}, "train-tokens"), ({"source": str(tmp_path / "none.jsonl")},
                                                                    "no such file"),
                            ({"tokenizer": "bpe:10"}, "VOCAB"), ({"tokenizer": str(tmp_path / "t.json")},
                                                                 "no such file")):
        with pytest.raises(DataError, match=message):
            prepare_corpus(tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out").exists()


def test_cli_prepare_then_verify(tmp_path, capsys, fineweb_jsonl, gpt2_tokenizer_path):
    out = tmp_path / "cli"
    args = [
        "prepare",
        "--out",
        str(out),
        "--source",
        str(fineweb_jsonl),
        "--tokenizer",
        str(gpt2_tokenizer_path),
        "--train-tokens",
        "2e4",
        "--shard-tokens",
        "1e4",
        "--workers",
        "1",
    ]
    assert main(args) == 0
    assert "metadata_sha256" in capsys.readouterr().out
    assert main(["data", "verify", str(out)]) == 0
    assert main(args) == 2  # exists, no --force
    err = capsys.readouterr().err
    assert err.startswith("pilotrun: error: ") and "already exists" in err and "Traceback" not in err
    assert main(["prepare", "--out", str(tmp_path / "x"), "--source", str(tmp_path / "missing.parquet")]) == 2
    assert main(["prepare", "--out", str(tmp_path / "x"), "--train-tokens", "1.5"]) == 2
    assert sorted(os.listdir(tmp_path)) == ["cli"]


@pytest.mark.slow
def test_an_endless_source_streams_with_bounded_read_ahead(tmp_path, fineweb_texts, gpt2_tokenizer_path):
    # A source that never ends (like a corpus far larger than memory): prepare must stream it, stop at
    # --train-tokens, and have read only a bounded number of documents beyond those it used.
    class EndlessHub(LocalHub):
        pulled = 0

        def stream_rows(self, repo_id, config, revision):
            index = 0
            while True:
                EndlessHub.pulled += 1
                yield {"text": f"Row {index}.\n{fineweb_texts[index % len(fineweb_texts)]}"}
                index += 1

    manifest = prepare_corpus(tmp_path / "endless", source="fineweb-edu", tokenizer=str(gpt2_tokenizer_path),
                              hub=EndlessHub([]), train_tokens=200_000, shuffle_buffer=100, workers=2,
                              progress=False)
    used = manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"]
    assert manifest["splits"]["train"]["tokens"] >= 200_000 and manifest["stream"]["stopped_at_train_tokens"]
    # Read-ahead: the shuffle buffer plus at most 8 chunks per worker of ~64k characters (~25 of these rows
    # each).
    assert EndlessHub.pulled - used <= 100 + 8 * 2 * 40


@pytest.mark.slow
def test_order_correlation_with_source_order_is_recorded_and_lowered_by_the_unit_order(
        tmp_path, fineweb_texts, gpt2_tokenizer_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "parts"
    folder.mkdir()
    for index in range(5):
        pq.write_table(
            pa.table({"text": fineweb_texts[index * 30 : (index + 1) * 30]}),
            folder / f"p{index}.parquet",
            row_group_size=10,
        )
    common = dict(
        tokenizer=str(gpt2_tokenizer_path), val_fraction=0.0, shuffle_buffer=8, workers=1, progress=False
    )
    mixed = prepare_corpus(tmp_path / "mixed", source=str(folder / "*.parquet"), **common)
    gpt2 = Tokenizer.from_file(str(gpt2_tokenizer_path))
    texts = [gpt2.decode(d.tolist()) for d in documents_of(all_tokens(tmp_path / "mixed", "train"), 50256)]
    positions = [fineweb_texts.index(t) for t in texts]
    expected = float(np.corrcoef(np.arange(len(positions)), positions)[0, 1])
    assert mixed["stream"]["order_correlation"] == pytest.approx(expected, abs=1e-6)
    assert mixed["stream"]["read_order"]["units"] == 15 and mixed["stream"]["read_order"]["shuffled"]
    assert mixed["stream"]["shuffle_buffer_peak_documents"] == 8
    # The same buffer over one file (one unit) only mixes neighbours: the source order survives.
    source = tmp_path / "one.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in fineweb_texts))
    local = prepare_corpus(tmp_path / "local", source=str(source), **common)
    assert local["stream"]["order_correlation"] > 0.95 > 0.7 > mixed["stream"]["order_correlation"]
    kept = prepare_corpus(tmp_path / "kept", source=str(source), **{**common, "shuffle_buffer": 0})
    assert kept["stream"]["order_correlation"] == 1.0 and not kept["stream"]["read_order"]["shuffled"]


def test_a_refused_prepare_leaves_a_replaced_folder_beside_its_out_untouched(tmp_path, fineweb_jsonl,
                                                                            gpt2_tokenizer_path):
    """Refused (the folder exists, no --force): nothing changes, a folder named OUT.partial.replaced included
    (what an interrupted --force left, or a folder of the user's that bears the name)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine").write_text("kept")
    beside = tmp_path / "out.partial.replaced"
    beside.mkdir()
    (beside / "also-mine").write_text("kept")
    with pytest.raises(DataError, match="already exists"):
        prepare_corpus(out, source=str(fineweb_jsonl), tokenizer=str(gpt2_tokenizer_path), progress=False)
    assert (beside / "also-mine").read_text() == "kept" and (out / "mine").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.partial.replaced"]
