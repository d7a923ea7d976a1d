"""Shuffle buffer and split rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pilotrun.data.stream import shuffled, split_of, text_position


def test_shuffle_is_a_seeded_permutation():
    items = [f"doc {i}" for i in range(1000)]
    a = list(shuffled(iter(items), 100, seed=1))
    assert sorted(a) == sorted(items) and a != items
    assert list(shuffled(iter(items), 100, seed=1)) == a
    assert list(shuffled(iter(items), 100, seed=2)) != a
    assert list(shuffled(iter(items), 0, seed=1)) == items and list(shuffled(iter(items), 1, seed=1)) == items


def test_shuffle_buffer_is_bounded():
    # Count how far the shuffle reads ahead of what it has emitted: never more than the buffer.
    state = {"read": 0}

    def source():
        for i in range(5000):
            state["read"] += 1
            yield str(i)

    worst = 0
    for emitted, _ in enumerate(shuffled(source(), 64, seed=0), start=1):
        worst = max(worst, state["read"] - emitted)
    assert worst == 64


def test_shuffle_moves_documents_far_but_only_within_reach():
    items = [str(i) for i in range(2000)]
    out = list(shuffled(iter(items), 50, seed=0))
    # A document can come out no earlier than (its index - buffer) positions.
    assert all(position >= int(text) - 50 for position, text in enumerate(out))
    assert max(abs(position - int(text)) for position, text in enumerate(out)) > 50


@pytest.mark.slow
def test_split_depends_on_text_only_and_matches_the_fraction():
    texts = [f"document number {i}" for i in range(20_000)]
    val = [t for t in texts if split_of(t, 0.1) == "val"]
    assert 1800 < len(val) < 2200
    # Stable across processes: no hash randomization or other per-process state decides a document's split.
    code = ("import sys; from pilotrun.data.stream import split_of; "
            "print(sum(split_of(f'document number {i}', 0.1) == 'val' for i in range(20_000)), "
            "split_of('document number 7', 0.5))")
    for seed in ("0", "12345"):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                env={**os.environ, "PYTHONHASHSEED": seed})
        assert result.stdout.split() == [str(len(val)), split_of("document number 7", 0.5)]
    # Pinned to the text's bytes: the first 8 bytes of sha256(b"document number 7") as a fraction of 2**64.
    # A change of rule would silently move documents between the splits of corpora already prepared.
    assert text_position("document number 7") == 3476615739218622483 / 2.0**64
    assert text_position("document number 7") != text_position("document number 7 ")
    assert all(0.0 <= text_position(t) < 1.0 for t in texts[:100])
    assert all(split_of(t, 0.0) == "train" for t in texts[:1000])
    # A larger fraction only adds documents to val: none moves from val to train.
    assert set(val) <= {t for t in texts if split_of(t, 0.2) == "val"}


def test_shuffle_buffer_is_bounded_in_bytes_and_reports_what_it_held():
    import sys as _sys

    from pilotrun.data.stream import ShuffleBuffer

    texts = [("x" * (10 if i % 7 else 5000)) + str(i) for i in range(3000)]  # some long documents among short
    limit = 20_000
    buffer = ShuffleBuffer(1000, limit, seed=3)
    state = {"read": [], "held_bytes": 0}

    def source():
        for text in texts:
            state["read"].append(text)
            yield text, text

    emitted = []
    for text, held in buffer.shuffle(source()):
        emitted.append(text)
        pending = set(state["read"]) - set(emitted)
        # At each emission the buffer held at most `limit` bytes besides the document waiting to enter.
        assert sum(_sys.getsizeof(t) for t in pending) - _sys.getsizeof(state["read"][-1]) <= limit
        assert held >= 1
    assert sorted(emitted) == sorted(texts)
    # The document count bound still applies when the bytes are not what binds.
    counts = [held for _, held in ShuffleBuffer(50, 10**9, seed=0).shuffle((t, "s") for t in range(500))]
    assert max(counts) == 50


def test_order_correlation_matches_numpy_and_resumes_from_its_state():
    import numpy as np

    from pilotrun.data.stream import OrderCorrelation

    positions = [int(p) for p in np.random.default_rng(0).permutation(500)[:300]]
    whole = OrderCorrelation()
    whole.add(positions)
    assert whole.value() == pytest.approx(np.corrcoef(np.arange(300), positions)[0, 1], abs=1e-6)
    first = OrderCorrelation()
    first.add(positions[:120])
    second = OrderCorrelation(json.loads(json.dumps(first.state())))
    second.add(positions[120:])
    assert second.value() == whole.value()
    ordered = OrderCorrelation()
    ordered.add(range(100))
    assert ordered.value() == 1.0 and OrderCorrelation().value() is None
