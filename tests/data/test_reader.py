"""The reader: startup checks that name the bad file, reads across shards, and exact global cursors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotrun.common.errors import DataError
from pilotrun.data.prepare import prepare_corpus
from pilotrun.data.reader import BatchLoader, open_dataset


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """The built-in corpus cut to ~30k training tokens over several 4,000-token shards (prepared once)."""
    out = tmp_path_factory.mktemp("reader") / "small"
    prepare_corpus(out, source="builtin", tokenizer="bpe:512", train_tokens=30_000, shard_tokens=4_000,
                   val_fraction=0.05, workers=1, progress=False)
    return out


@pytest.fixture
def damaged_copy(small_data, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(small_data, copy)
    return copy


def concatenated(data_dir, split):
    manifest = json.loads((data_dir / "metadata.json").read_text())
    return np.concatenate([np.load(data_dir / s["file"]) for s in manifest["splits"][split]["shards"]])


def test_read_and_locate_cross_shard_boundaries(small_data):
    split = open_dataset(small_data).split("train")
    everything = concatenated(small_data, "train")
    assert split.num_tokens == len(everything) and len(split.files) >= 7
    assert np.array_equal(split.read(0, split.num_tokens), everything)
    assert np.array_equal(split.read(3_990, 25), everything[3_990:4_015])
    assert split.locate(3_990, 25) == [("train_00000.npy", 3_990, 10), ("train_00001.npy", 0, 15)]
    assert split.locate(4_000, 8_001) == [("train_00001.npy", 0, 4_000), ("train_00002.npy", 0, 4_000),
                                          ("train_00003.npy", 0, 1)]
    with pytest.raises(IndexError):
        split.read(split.num_tokens - 2, 3)


def test_batches_follow_the_documented_window_layout(small_data):
    split = open_dataset(small_data).split("train")
    everything = concatenated(small_data, "train").astype(np.int64)
    loader = BatchLoader(split, batch_size=3, seq_len=16)
    for b in range(4):
        inputs, targets = loader.next_batch()
        assert inputs.dtype == torch.int64 and inputs.shape == (3, 16) and targets.shape == (3, 16)
        for j in range(3):
            window = everything[(b * 3 + j) * 16:(b * 3 + j) * 16 + 17]
            assert torch.equal(inputs[j], torch.from_numpy(window[:-1]))
            assert torch.equal(targets[j], torch.from_numpy(window[1:]))


def test_a_ranks_rows_are_a_pure_function_of_batch_rank_and_world_size(small_data):
    split = open_dataset(small_data).split("train")
    single = BatchLoader(split, batch_size=4, seq_len=8, world_size=1)
    ranks = [BatchLoader(split, batch_size=2, seq_len=8, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        whole, whole_targets = single.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), whole)
        assert torch.equal(torch.cat([p[1] for p in parts]), whole_targets)
    # Jumping straight to batch 4 (a fresh loader given only the cursor) gives the same rows as walking there.
    jumped = BatchLoader(split, batch_size=2, seq_len=8, rank=1, world_size=2)
    walked = BatchLoader(split, batch_size=2, seq_len=8, rank=1, world_size=2)
    for _ in range(4):
        walked.next_batch()
    jumped.load_state_dict(walked.state_dict())
    assert torch.equal(jumped.next_batch()[0], walked.next_batch()[0])


def test_cursor_state_round_trips_exactly_through_json(small_data):
    split = open_dataset(small_data).split("train")
    original = BatchLoader(split, batch_size=4, seq_len=32)
    for _ in range(7):
        original.next_batch()
    state = json.loads(json.dumps(original.state_dict()))
    assert all(type(v) is int for v in state.values())
    restored = BatchLoader(split, batch_size=4, seq_len=32)
    restored.load_state_dict(state)
    assert restored.state_dict() == original.state_dict()
    for _ in range(40):  # past an exhaustion restart too
        a, b = original.next_batch(), restored.next_batch()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert (original.epoch, original.restarts, original.last_batch_restarted) == \
               (restored.epoch, restored.restarts, restored.last_batch_restarted)


def test_exhaustion_restarts_at_the_beginning_drops_the_tail_and_is_counted(small_data):
    split = open_dataset(small_data).split("train")
    loader = BatchLoader(split, batch_size=4, seq_len=64)
    per_epoch = loader.batches_per_epoch
    assert per_epoch == ((split.num_tokens - 1) // 64) // 4
    first = loader.next_batch()
    assert not loader.last_batch_restarted and loader.epoch == 0
    for _ in range(per_epoch - 1):
        loader.next_batch()
        assert not loader.last_batch_restarted
    # The last batch of the epoch ends before the incomplete tail; the next batch is batch 0 again.
    last_window_end = (per_epoch * 4 - 1) * 64 + 65
    assert last_window_end <= split.num_tokens
    again = loader.next_batch()
    assert loader.last_batch_restarted and loader.epoch == 1 and loader.restarts == 1
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    loader.next_batch()
    assert not loader.last_batch_restarted and loader.restarts == 1


def test_repeat_batch_serves_one_fixed_batch(small_data):
    split = open_dataset(small_data).split("train")
    loader = BatchLoader(split, batch_size=2, seq_len=16, mode="repeat_batch")
    first = loader.next_batch()
    for _ in range(3):
        inputs, targets = loader.next_batch()
        assert torch.equal(inputs, first[0]) and torch.equal(targets, first[1])
    assert loader.state_dict()["batch_index"] == 4 and loader.restarts == 0
    successive = BatchLoader(split, batch_size=2, seq_len=16)
    with pytest.raises(DataError, match="repeat_batch"):
        successive.load_state_dict(loader.state_dict())


def test_describe_batch_names_the_tokens_each_row_read(small_data):
    split = open_dataset(small_data).split("train")
    loader = BatchLoader(split, batch_size=2, seq_len=40, rank=1, world_size=3)
    for _ in range(3):
        loader.next_batch()
    inputs, targets = loader.next_batch()  # global batch 3
    rows = loader.describe_batch(3)
    assert [(r["rank"], r["row"]) for r in rows] == [(r, j) for r in range(3) for j in range(2)]
    for j, row in enumerate(r for r in rows if r["rank"] == 1):
        pieces = np.concatenate([np.load(small_data / f)[o:o + n] for f, o, n in row["pieces"]])
        assert torch.equal(torch.from_numpy(pieces.astype(np.int64)), torch.cat([inputs[j], targets[j][-1:]]))
    assert loader.describe_batch(3) == rows  # pure


def test_wrong_geometry_and_too_small_splits_are_refused(small_data):
    dataset = open_dataset(small_data)
    loader = BatchLoader(dataset.split("train"), batch_size=4, seq_len=32)
    other = BatchLoader(dataset.split("train"), batch_size=4, seq_len=16)
    with pytest.raises(DataError, match="seq_len"):
        other.load_state_dict(loader.state_dict())
    val_tokens = dataset.split("val").num_tokens
    with pytest.raises(DataError, match="fewer than one global batch"):
        BatchLoader(dataset.split("val"), batch_size=val_tokens, seq_len=8)


def test_missing_shard_is_named(damaged_copy):
    (damaged_copy / "train_00002.npy").unlink()
    with pytest.raises(DataError, match="train_00002.npy is missing"):
        open_dataset(damaged_copy)


def test_truncated_shard_is_named(damaged_copy):
    path = damaged_copy / "train_00003.npy"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(DataError, match=r"train_00003\.npy is truncated"):
        open_dataset(damaged_copy)


def test_wrong_dtype_and_shape_are_named(damaged_copy):
    path = damaged_copy / "train_00001.npy"
    np.save(path, np.load(path).astype(np.uint32))
    with pytest.raises(DataError, match=r"train_00001\.npy has dtype uint32"):
        open_dataset(damaged_copy)
    np.save(path, np.zeros(10, dtype=np.uint16))
    with pytest.raises(DataError, match=r"train_00001\.npy has shape \(10,\)"):
        open_dataset(damaged_copy)


def test_manifest_totals_and_tokenizer_are_checked(damaged_copy):
    path = damaged_copy / "metadata.json"
    manifest = json.loads(path.read_text())
    manifest["splits"]["train"]["tokens"] += 1
    path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="the train shards hold"):
        open_dataset(damaged_copy)
    manifest["splits"]["train"]["tokens"] -= 1
    path.write_text(json.dumps(manifest))
    (damaged_copy / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match="tokenizer.json does not match"):
        open_dataset(damaged_copy)
    path.unlink()
    with pytest.raises(DataError, match="metadata.json is missing"):
        open_dataset(damaged_copy)


def test_load_tokenizer_decodes_the_data(small_data):
    from pilotrun.data.builtin_corpus import builtin_documents

    dataset = open_dataset(small_data)
    tokenizer = dataset.load_tokenizer()
    assert tokenizer.get_vocab_size() == dataset.vocab_size
    assert tokenizer.id_to_token(dataset.eos_id) == "<|endoftext|>"
    tokens = dataset.split("train").read(0, 5000)
    first_document = tokens[: int(np.flatnonzero(tokens == dataset.eos_id)[0])]
    assert tokenizer.decode(first_document.tolist()) in builtin_documents()


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 40_000), length=st.integers(0, 9_000))
def test_read_matches_the_concatenated_shards_anywhere(small_data, start, length):
    split = open_dataset_cached(small_data).split("train")
    everything = concatenated_cached(small_data)
    if start + length > split.num_tokens:
        with pytest.raises(IndexError):
            split.read(start, length)
        return
    assert np.array_equal(split.read(start, length), everything[start:start + length])
    pieces = split.locate(start, length)
    assert sum(n for _, _, n in pieces) == length and all(n > 0 for _, _, n in pieces)


@settings(max_examples=60, deadline=None)
@given(batch_size=st.integers(1, 5), world_size=st.integers(1, 4), seq_len=st.integers(1, 50),
       batch_index=st.integers(0, 10_000))
def test_ranks_partition_the_global_batch(small_data, batch_size, world_size, seq_len, batch_index):
    """Rank r's rows of global batch b are the windows the module docstring promises, written out here from
    the split's length alone (not from the loader's own arithmetic), and they are the tokens it serves."""
    split = open_dataset_cached(small_data).split("train")
    everything = concatenated_cached(small_data).astype(np.int64)
    windows_per_batch = batch_size * world_size
    batches_per_epoch = ((len(everything) - 1) // seq_len) // windows_per_batch
    k = batch_index % batches_per_epoch
    for rank in range(world_size):
        loader = BatchLoader(split, batch_size, seq_len, rank=rank, world_size=world_size)
        cursor = {**loader.state_dict(), "batch_index": batch_index}
        del cursor["epoch"]  # a jump: the epoch follows from the batch index
        loader.load_state_dict(cursor)
        inputs, targets = loader.next_batch()
        for j in range(batch_size):
            start = (k * windows_per_batch + rank * batch_size + j) * seq_len
            assert torch.equal(inputs[j], torch.from_numpy(everything[start:start + seq_len]))
            assert torch.equal(targets[j], torch.from_numpy(everything[start + 1:start + seq_len + 1]))


_cache: dict = {}


def open_dataset_cached(data_dir):
    if data_dir not in _cache:
        _cache[data_dir] = open_dataset(data_dir)
    return _cache[data_dir]


def concatenated_cached(data_dir):
    key = (data_dir, "all")
    if key not in _cache:
        _cache[key] = concatenated(data_dir, "train")
    return _cache[key]


def test_a_cursor_saved_with_another_global_batch_continues_at_the_same_window(small_data):
    split = open_dataset(small_data).split("train")
    walked = BatchLoader(split, batch_size=4, seq_len=32)
    for _ in range(3):
        walked.next_batch()
    halves = BatchLoader(split, batch_size=2, seq_len=32)
    halves.load_state_dict(walked.state_dict())
    doubles = BatchLoader(split, batch_size=8, seq_len=32)
    doubles.load_state_dict(BatchLoader(split, batch_size=4, seq_len=32).state_dict())
    # The next 8 windows, whichever batch size reads them: batch 3 of 4 windows is windows 12..15.
    expected = torch.cat([walked.next_batch()[0], walked.next_batch()[0]])
    assert halves.batch_index == 6
    assert torch.equal(torch.cat([halves.next_batch()[0] for _ in range(4)]), expected)
    walked_from_start = BatchLoader(split, batch_size=4, seq_len=32)
    assert torch.equal(doubles.next_batch()[0],
                       torch.cat([walked_from_start.next_batch()[0], walked_from_start.next_batch()[0]]))
    odd = BatchLoader(split, batch_size=4, seq_len=32)
    odd.next_batch()
    with pytest.raises(DataError, match="no global batch of 8 windows starts there"):
        BatchLoader(split, batch_size=8, seq_len=32).load_state_dict(odd.state_dict())
