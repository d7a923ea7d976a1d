"""The mixture file and its schedule: bad input refused with one line naming the entry; the per-batch counts
track the weights to within a row, add up to every global batch, and are a pure, seeded function."""

from __future__ import annotations

import os
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotrun.common.errors import DataError
from pilotrun.data.mixture import MixtureSchedule, exact_weights, mixture_identity, parse_mixture


@pytest.fixture
def folders(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    (tmp_path / "plain.txt").write_text("not a folder")
    return tmp_path


def write(folder, text):
    path = folder / "mix.yaml"
    path.write_text(text)
    return path


def test_a_mixture_file_names_its_sources_relative_to_itself(folders):
    spec = parse_mixture(
        write(folders, "mixture:\n  - {path: a, weight: 0.7}\n  - {path: b, weight: 0.3, name: B}\nseed: 5\n")
    )
    assert [(s.name, s.weight) for s in spec.sources] == [("a", 0.7), ("B", 0.3)]
    assert spec.sources[0].path == str(folders / "a") and spec.seed == 5
    assert parse_mixture(write(folders, "mixture: [{path: a, weight: 2}]\n")).seed == 0


@pytest.mark.parametrize(
    "entries,said",
    [
        ("[{path: a, weight: 0}, {path: b, weight: 1}]", "weight 0 must be a finite number above 0"),
        ("[{path: a, weight: -1}, {path: b, weight: 1}]", "weight -1 must be"),
        ("[{path: a, weight: .nan}, {path: b, weight: 1}]", "weight nan must be"),
        ("[{path: a, weight: .inf}, {path: b, weight: 1}]", "weight inf must be"),
        ("[{path: a, weight: lots}, {path: b, weight: 1}]", "weight 'lots' is not a number"),
        ("[{path: a, weight: true}, {path: b, weight: 1}]", "weight True is not a number"),
        ("[{path: a, weight: 1}, {path: missing, weight: 1}]", "entry 2: data folder"),
        (
            "[{path: a, weight: 1e3}, {path: b, weight: 1}]",
            "weight '1e3' was read by YAML as text, not a number",
        ),
        (
            "[{path: a, weight: 1}, {path: /dev/zero, weight: 1}]",
            "entry 2: /dev/zero is a device, not a prepared data",
        ),
        (
            "[{path: a, weight: 1}, {path: plain.txt, weight: 1}]",
            "plain.txt is a file, not a prepared data folder",
        ),
        ("[{path: a, weight: 1}, {path: ./a, weight: 1}]", "the same folder twice"),
        ("[{path: a, weight: 1, colour: red}]", "unknown key(s) ['colour']"),
        ("[{path: a}]", "needs `path` and `weight`"),
        (
            "[{path: a, weigth: 1}]",
            "unknown key(s) ['weigth']; did you mean 'weight'? (known: path, weight, name)",
        ),
        ("[]", "non-empty list"),
    ],
)
def test_bad_mixtures_are_one_line_naming_the_entry(folders, entries, said):
    path = write(folders, f"mixture: {entries}\n")
    with pytest.raises(DataError) as caught:
        parse_mixture(path)
    assert said in str(caught.value) and str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_a_typo_of_the_top_level_key_is_named_with_the_nearest_one(folders):
    with pytest.raises(DataError, match=r"unknown key\(s\) \['mixtures'\]; did you mean 'mixture'\?"):
        parse_mixture(write(folders, "mixtures: [{path: a, weight: 1}]\n"))


def test_a_weight_total_that_is_not_positive_is_refused(folders):
    # Each weight is checked above 0, so a total of 0 cannot arise; huge weights overflow to inf.
    with pytest.raises(DataError, match="not a positive total"):
        parse_mixture(write(folders, "mixture: [{path: a, weight: 1.0e+308}, {path: b, weight: 1.0e+308}]\n"))


def test_the_weights_are_exact_decimals():
    assert exact_weights([0.7, 0.3]) == [7, 3]
    assert exact_weights([2, 4, 6]) == [1, 2, 3]
    assert exact_weights([0.1, 0.2]) == [1, 2]


def test_the_identity_is_the_sources_and_one_source_is_its_folder():
    assert mixture_identity(["x"]) == "x"
    assert mixture_identity(["x", "y"]) != mixture_identity(["y", "x"])


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.integers(1, 50).map(lambda w: w / 10), min_size=2, max_size=5),
       rows=st.integers(1, 24), seed=st.integers(0, 2**32))
def test_every_batch_is_whole_and_cumulative_rows_track_the_weights(weights, rows, seed):
    schedule = MixtureSchedule(weights, seed, rows)
    total = sum(Fraction(repr(w)) for w in weights)
    for batch in range(60):
        counts = schedule.counts(batch)
        assert sum(counts) == rows and min(counts) >= 0
        had = schedule.rows_before(batch + 1)
        for share, got in zip(weights, had, strict=True):
            assert abs(got - (batch + 1) * rows * Fraction(repr(share)) / total) < 2
    # Sources owed at least a row a batch keep within one row of their share at every batch.
    if all(rows * Fraction(repr(w)) / total >= 1 for w in weights):
        for batch in range(60):
            had = schedule.rows_before(batch)
            assert all(abs(got - batch * rows * Fraction(repr(w)) / total) < 1
                       for w, got in zip(weights, had, strict=True))


def test_the_schedule_is_a_pure_seeded_function():
    one, two = MixtureSchedule([0.5, 0.5], 1, 7), MixtureSchedule([0.5, 0.5], 1, 7)
    assert [one.counts(b) for b in range(20)] == [two.counts(b) for b in reversed(range(20))][::-1]
    assert (one.row_sources(3) == two.row_sources(3)).all()
    other = MixtureSchedule([0.5, 0.5], 2, 7)
    assert [one.counts(b) for b in range(20)] != [other.counts(b) for b in range(20)] or \
        any((one.row_sources(b) != other.row_sources(b)).any() for b in range(20))
    assert sorted(one.row_sources(3).tolist()) == [0] * one.counts(3)[0] + [1] * one.counts(3)[1]


def test_seventy_thirty_to_the_row():
    schedule = MixtureSchedule([0.7, 0.3], 0, 8)
    assert schedule.rows_before(10) == [56, 24]
    assert [schedule.counts(b) for b in range(5)] == [[6, 2], [5, 3], [6, 2], [5, 3], [6, 2]]


def test_a_new_schedule_continues_from_the_rows_already_served():
    first = MixtureSchedule([0.7, 0.3], 0, 8)
    changed = MixtureSchedule([0.5, 0.5], 0, 8, start_batch=10, start_rows=first.rows_before(10))
    assert changed.rows_before(10) == [56, 24] and changed.rows_before(20) == [96, 64]
    with pytest.raises(DataError, match="before this schedule's start"):
        changed.rows_before(9)


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.integers(1, 50).map(lambda w: w / 10), min_size=2, max_size=4),
       rows=st.integers(8, 40), seed=st.integers(0, 2**32), start=st.integers(0, 9))
def test_the_closed_form_is_what_the_running_account_accumulates(weights, rows, seed, start):
    recursive = MixtureSchedule(weights, seed, rows)
    recursive.memoryless = False  # the batch-by-batch account, every schedule's general case
    direct = MixtureSchedule(weights, seed, rows)
    if not direct.memoryless:
        return
    assert all(direct.rows_before(b) == recursive.rows_before(b) for b in range(80))
    # And from where a weight change started a new schedule.
    had = recursive.rows_before(start)
    later = [w * 2 + 0.1 for w in weights]
    resumed, stepped = (
        MixtureSchedule(later, seed, rows, start, had),
        MixtureSchedule(later, seed, rows, start, had),
    )
    stepped.memoryless = False
    if resumed.memoryless:
        assert all(resumed.rows_before(b) == stepped.rows_before(b) for b in range(start, start + 60))


def test_a_fifo_given_as_a_source_is_named_as_one_and_not_opened(folders):
    os.mkfifo(folders / "pipe")
    with pytest.raises(DataError, match="entry 2: .*pipe is a FIFO, not a prepared data folder"):
        parse_mixture(write(folders, "mixture: [{path: a, weight: 1}, {path: pipe, weight: 1}]\n"))


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.sampled_from([0.01, 0.05, 0.2, 1.0, 3.0]), min_size=2, max_size=4),
    rows=st.integers(1, 8),
    seed=st.integers(0, 1000),
    batch=st.integers(1, 600),
)
def test_the_planned_rows_are_the_schedules_exactly_or_within_a_row(weights, rows, seed, batch):
    planned, exact = MixtureSchedule(weights, seed, rows).rows_planned(batch)
    walked = MixtureSchedule(weights, seed, rows)
    truth = walked.rows_before(batch)
    assert exact == walked.memoryless
    if exact:
        assert planned == truth
    else:
        assert sum(planned) == sum(truth) == batch * rows
        assert max(abs(p - t) for p, t in zip(planned, truth, strict=True)) <= 1
    assert walked.rows_planned(batch) == (truth, True)  # a schedule that has walked there knows
