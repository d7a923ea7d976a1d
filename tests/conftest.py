"""Shared fixtures: one prepared copy of the built-in corpus per test session (prepare takes seconds)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def builtin_data_dir(tmp_path_factory):
    """The built-in offline corpus prepared with the default byte-level BPE (4,096 tokens): read-only for tests."""
    from pilotrun.data.prepare import prepare_corpus

    out = tmp_path_factory.mktemp("data") / "builtin"
    prepare_corpus(out, source="builtin", tokenizer="bpe:4096", progress=False)
    return out
