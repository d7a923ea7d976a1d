"""Reading a mixture: each row comes from the source the schedule names, at its own cursor; the stream is the
same at any world size and after a restored cursor; sources with another tokenizer are refused naming both."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pilotrun.common.errors import DataError
from pilotrun.data.mixed_reader import MixedDataset, MixedLoader, open_data
from pilotrun.data.reader import TokenDataset, open_dataset
from tests.conftest import write_mixture


@pytest.fixture
def seventy_thirty(mixture_sources, tmp_path):
    return open_data(write_mixture(tmp_path / "mix.yaml", [(mixture_sources["edu"], 0.7),
                                                           (mixture_sources["builtin"], 0.3)]))


def test_rows_come_from_the_named_source_and_match_the_weights_to_the_row(seventy_thirty):
    dataset = seventy_thirty
    assert isinstance(dataset, MixedDataset) and dataset.names == ["edu", "builtin"]
    loader = MixedLoader(dataset, batch_size=4, seq_len=32)
    served = [0, 0]
    for batch in range(25):
        described = loader.describe_batch(batch)
        inputs, targets = loader.next_batch()
        served = [s + r for s, r in zip(served, loader.last_batch_rows, strict=True)]
        for row, info in enumerate(described):
            split = dataset.datasets[info["source_index"]].split("train")
            tokens = torch.from_numpy(split.read(info["start"], 33).astype(np.int64))
            assert torch.equal(inputs[row], tokens[:-1]) and torch.equal(targets[row], tokens[1:])
        for share, got in zip((0.7, 0.3), served, strict=True):
            assert abs(got - (batch + 1) * 4 * share) < 1  # within a row of the weight, every batch
    assert sum(served) == 100 and served == [70, 30]


def test_the_same_global_batches_at_any_world_size(seventy_thirty):
    one = MixedLoader(seventy_thirty, batch_size=4, seq_len=32)
    ranks = [MixedLoader(seventy_thirty, batch_size=2, seq_len=32, rank=r, world_size=2) for r in range(2)]
    for _ in range(12):
        whole, _ = one.next_batch()
        parts = [loader.next_batch()[0] for loader in ranks]
        assert torch.equal(whole, torch.cat(parts))
        assert one.last_batch_rows == ranks[0].last_batch_rows == ranks[1].last_batch_rows


def test_a_restored_cursor_continues_bit_for_bit(seventy_thirty):
    straight = MixedLoader(seventy_thirty, batch_size=4, seq_len=32)
    expected = [straight.next_batch()[0] for _ in range(10)]
    first = MixedLoader(seventy_thirty, batch_size=4, seq_len=32)
    for _ in range(4):
        first.next_batch()
    second = MixedLoader(seventy_thirty, batch_size=4, seq_len=32)
    second.load_state_dict(first.state_dict())
    assert all(torch.equal(second.next_batch()[0], want) for want in expected[4:])


def test_changed_weights_take_effect_from_the_restored_batch(mixture_sources, tmp_path, seventy_thirty):
    before = MixedLoader(seventy_thirty, batch_size=4, seq_len=32)
    for _ in range(5):
        before.next_batch()
    even = open_data(write_mixture(tmp_path / "even.yaml", [(mixture_sources["edu"], 1),
                                                            (mixture_sources["builtin"], 1)]))
    after = MixedLoader(even, batch_size=4, seq_len=32)
    after.load_state_dict(before.state_dict())
    assert after.rows_served() == before.rows_served() == [14, 6]
    for _ in range(5):
        after.next_batch()
    assert after.rows_served() == [24, 16]  # 10 + 10 more rows: the new weights from batch 5 on


def test_a_small_source_restarts_alone(mixture_sources, tmp_path):
    dataset = open_data(write_mixture(tmp_path / "mix.yaml", [(mixture_sources["edu"], 0.5),
                                                              (mixture_sources["tiny"], 0.5)]))
    loader = MixedLoader(dataset, batch_size=4, seq_len=32)
    restarts = 0
    for _ in range(30):
        loader.next_batch()
        restarts += loader.last_batch_restarted
    passes = loader.passes(loader.rows_served())
    assert passes[0] == 0 and passes[1] == restarts >= 2 and loader.epoch == passes[1]
    tiny = [row for row in loader.describe_batch(29) if row["source"] == "tiny"]
    assert tiny and all(row["epoch"] == row["source_row"] // loader.windows[1] for row in tiny)


def test_sources_with_another_tokenizer_are_refused_naming_both(mixture_sources, tmp_path):
    path = write_mixture(
        tmp_path / "mix.yaml", [(mixture_sources["builtin"], 1), (mixture_sources["other"], 1)]
    )
    with pytest.raises(DataError) as caught:
        open_data(path)
    said = str(caught.value)
    assert "builtin" in said and "other" in said and "tokenizer sha256" in said and "\n" not in said


def test_the_same_data_under_two_paths_is_refused(mixture_sources, tmp_path):
    (tmp_path / "again").symlink_to(mixture_sources["edu"])  # another path, the same folder
    with pytest.raises(DataError, match="the same folder twice"):
        open_data(
            write_mixture(tmp_path / "mix.yaml", [(mixture_sources["edu"], 1), (tmp_path / "again", 1)])
        )


def test_a_mixture_of_one_folder_is_that_folder(mixture_sources, tmp_path):
    dataset = open_data(write_mixture(tmp_path / "mix.yaml", [(mixture_sources["edu"], 3)]))
    assert isinstance(dataset, TokenDataset) and dataset.data_dir == str(mixture_sources["edu"])
    assert dataset.metadata_sha256 == open_dataset(mixture_sources["edu"]).metadata_sha256


def test_a_cursor_whose_rows_its_schedule_does_not_give_is_refused(seventy_thirty):
    loader = MixedLoader(seventy_thirty, batch_size=4, seq_len=32)
    for _ in range(3):
        loader.next_batch()
    state = loader.state_dict()
    assert [s["rows"] for s in state["sources"]] == loader.rows_served() and sum(loader.rows_served()) == 12
    state["sources"][0]["rows"] += 1
    with pytest.raises(DataError, match="not what its schedule gives"):
        MixedLoader(seventy_thirty, batch_size=4, seq_len=32).load_state_dict(state)
