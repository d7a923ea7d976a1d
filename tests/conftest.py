"""Shared fixtures: one intra-op thread for every in-process test, and one prepared built-in corpus."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def single_intra_op_thread():
    """Bit-exact comparisons need a fixed thread count, and one thread is also the fast choice here: on a
    busy 2-core machine two OpenMP threads made small matmuls up to ~100x slower (measured while building
    the model tests). Subprocess tests choose their threads through the recipe's train.num_threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def builtin_data_dir(tmp_path_factory):
    """The built-in offline corpus prepared with the default byte-level BPE (4,096 tokens): read-only for tests."""
    from pilotrun.data.prepare import prepare_corpus

    out = tmp_path_factory.mktemp("data") / "builtin"
    prepare_corpus(out, source="builtin", tokenizer="bpe:4096", progress=False)
    return out
