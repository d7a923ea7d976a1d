"""Which documents global batches read, checked by brute force against the concatenated shards: the batch that
holds the end of the documents a spiking batch reads (a folder's and a mixture's, per source), their indices
and token positions, and what a range of batches reads across an epoch's end."""

from __future__ import annotations

import numpy as np
import pytest

from pilotrun.data.mixed_reader import MixedLoader, open_data
from pilotrun.data.prepare import prepare_corpus
from pilotrun.data.reader import BatchLoader, open_dataset
from pilotrun.data.skipped_documents import document_index, read_documents, segments, spiking_documents
from tests.conftest import write_mixture


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """The built-in corpus cut to ~12k training tokens over 4,000-token shards (prepared once)."""
    out = tmp_path_factory.mktemp("skipped") / "small"
    prepare_corpus(out, source="builtin", tokenizer="bpe:512", train_tokens=12_000, shard_tokens=4_000,
                   val_fraction=0.05, workers=1, progress=False)
    return out


def tokens_of(split) -> np.ndarray:
    return split.read(0, split.num_tokens).astype(np.int64)


def brute_index(everything: np.ndarray, eos: int, position: int) -> int:
    return int(np.count_nonzero(everything[:position] == eos))


def brute_start(everything: np.ndarray, eos: int, position: int) -> int:
    hits = np.flatnonzero(everything[:position] == eos)
    return int(hits[-1]) + 1 if len(hits) else 0


def test_count_rfind_and_find_match_the_concatenated_shards(small_data):
    split, eos = open_dataset(small_data).split("train"), open_dataset(small_data).eos_id
    everything = tokens_of(split)
    assert len(split.files) >= 3  # ranges below cross shard boundaries
    for start, stop in [(0, split.num_tokens), (0, 4_000), (3_990, 8_010), (5, 5), (4_000, 12_001)]:
        stop = min(stop, split.num_tokens)
        hits = np.flatnonzero(everything[start:stop] == eos)
        assert split.count(eos, start, stop) == len(hits)
        assert split.count(eos, start, stop) == len(hits)  # a whole shard's count, kept, gives the same
        assert split.find(eos, start, stop) == (start + int(hits[0]) if len(hits) else None)
        assert split.rfind(eos, start, stop, chunk=97) == (start + int(hits[-1]) if len(hits) else None)
    # the last one ends the split
    assert document_index(split, eos, split.num_tokens - 1) == split.documents - 1


def test_a_folder_batch_is_skipped_to_the_batch_holding_the_end_of_its_documents(small_data):
    """For every batch of an epoch and the next: the documents a batch reads end at the first EOS at or after
    its last target (within its epoch: the dropped tail ends there), the batch returned is the one whose
    targets hold that end, and the documents are named by index and the positions they span."""
    dataset = open_dataset(small_data)
    split, eos = dataset.split("train"), dataset.eos_id
    everything = tokens_of(split)
    loader = BatchLoader(split, batch_size=2, seq_len=16)
    span, per_epoch = 2 * 16, loader.batches_per_epoch
    limit = per_epoch * span + 1
    for b in range(per_epoch + 3):
        epoch, k = divmod(b, per_epoch)
        hits = np.flatnonzero(everything[(k + 1) * span:limit] == eos)
        end = (k + 1) * span + int(hits[0]) + 1 if len(hits) else limit
        through, (documents,) = spiking_documents(loader, [b], eos)
        assert epoch * per_epoch <= b <= through < (epoch + 1) * per_epoch
        last = through - epoch * per_epoch
        assert last == per_epoch - 1 or last * span + 1 <= end - 1 <= (last + 1) * span
        assert documents == {"pass": epoch, "first": brute_index(everything, eos, k * span),
                             "last": brute_index(everything, eos, end - 1),
                             "tokens": [brute_start(everything, eos, k * span), end]}
    # Two spiking batches (accumulation) join into one entry; repeat_batch reads batch 0 alone.
    through, (joined,) = spiking_documents(loader, [3, 4], eos)
    assert through == spiking_documents(loader, [4], eos)[0]
    assert joined["first"] == spiking_documents(loader, [3], eos)[1][0]["first"]
    repeat = BatchLoader(split, batch_size=2, seq_len=16, mode="repeat_batch")
    through, (first,) = spiking_documents(repeat, [7], eos)
    assert through == 7 and first["tokens"][1] == span + 1


def test_what_a_range_of_batches_reads_is_named_per_epoch(small_data):
    dataset = open_dataset(small_data)
    split, eos = dataset.split("train"), dataset.eos_id
    everything = tokens_of(split)
    loader = BatchLoader(split, batch_size=2, seq_len=16)
    span, per_epoch = 2 * 16, loader.batches_per_epoch
    first = per_epoch - 2
    assert segments(loader, first, first + 3) == [
        (0, 0, first * span, per_epoch * span + 1),
        (0, 1, 0, 2 * span + 1),
    ]
    read = read_documents(loader, eos, first, 4)
    assert read == [
        {
            "pass": 0,
            "tokens": [first * span, per_epoch * span + 1],
            "documents": [
                brute_index(everything, eos, first * span),
                brute_index(everything, eos, per_epoch * span),
            ],
        },
        {"pass": 1, "tokens": [0, 2 * span + 1], "documents": [0, brute_index(everything, eos, 2 * span)]},
    ]


def test_a_mixture_names_the_source_and_skips_to_the_batch_holding_each_sources_document_end(mixture_sources,
                                                                                              tmp_path):
    """Brute force over the batches' rows: for each source a spiking batch reads, the batch returned is at
    least the first one whose rows of that source hold the end of its documents there (and exactly the latest
    of them)."""
    dataset = open_data(write_mixture(tmp_path / "mix.yaml", [(mixture_sources["edu"], 0.7),
                                                             (mixture_sources["builtin"], 0.3)]))
    loader = MixedLoader(dataset, batch_size=4, seq_len=32)
    eos = dataset.eos_id
    everything = [tokens_of(split) for split in loader.splits]
    for b in (0, 5, 17):
        rows = loader.describe_batch(b)
        through, documents = spiking_documents(loader, [b], eos)
        holding = []
        for source in sorted({row["source_index"] for row in rows}):
            mine = [row for row in rows if row["source_index"] == source]
            passes = {row["epoch"] for row in mine}
            assert len(passes) == 1  # these batches lie inside one pass of each source
            tokens = everything[source]
            windows_end = loader.windows[source] * 32 + 1
            last_target = max(row["start"] for row in mine) + 32
            hits = np.flatnonzero(tokens[last_target:windows_end] == eos)
            end = last_target + int(hits[0]) + 1 if len(hits) else windows_end
            later = b
            while not any(
                row["source_index"] == source
                and row["epoch"] in passes
                and row["start"] + 1 <= end - 1 <= row["start"] + 32
                for row in loader.describe_batch(later)
            ):
                if end - 1 <= last_target:
                    break
                later += 1
            holding.append(later)
            start = min(row["start"] for row in mine)
            assert {"source": loader.names[source], "pass": passes.pop(),
                    "first": brute_index(tokens, eos, start), "last": brute_index(tokens, eos, end - 1),
                    "tokens": [brute_start(tokens, eos, start), end]} in documents
        assert through == max(holding)
        assert len(documents) == len(holding)
    read = read_documents(loader, eos, 5, 3)
    assert sorted(r["source"] for r in read) == sorted(loader.names)
    for entry in read:
        source = loader.names.index(entry["source"])
        mine = [row for b in range(5, 8) for row in loader.describe_batch(b) if row["source_index"] == source]
        assert entry["tokens"] == [min(r["start"] for r in mine), max(r["start"] for r in mine) + 33]
