"""A finished data folder against a new prepare request: what is compared, offline, and how it is named."""

from __future__ import annotations

from pilotrun.data.identity import (
    prepared_differences,
    request_options,
    requested_source,
    requested_tokenizer,
)
from pilotrun.data.source_hub import FINEWEB_EDU_REPO

OPTIONS = request_options(
    train_tokens=None,
    val_fraction=0.01,
    shard_tokens=2**24,
    seed=0,
    shuffle_buffer=10000,
    shuffle_buffer_bytes=64 << 20,
    text_field="text",
    eos=None,
)


def hub_manifest(**options) -> dict:
    """A manifest of FineWeb-Edu at a resolved commit with a hub tokenizer (as prepare writes them)."""
    return {"source": {"kind": "hub", "dataset": FINEWEB_EDU_REPO, "config": "sample-10BT", "split": "train",
                       "revision_requested": "main", "revision": "f" * 40, "text_field": "text"},
            "tokenizer": {"kind": "hub", "name": "gpt2", "revision_requested": "main", "revision": "e" * 40,
                          "sha256": "d" * 64, "vocab_size": 50257},
            "options": {**OPTIONS, **options}}


def test_options_are_recorded_in_one_normalised_form():
    assert request_options(
        train_tokens=2e9,
        val_fraction=0,
        shard_tokens=1024.0,
        seed=3,
        shuffle_buffer=0,
        shuffle_buffer_bytes=0,
        text_field="body",
        eos="</s>",
    ) == {
        "train_tokens": 2_000_000_000,
        "val_fraction": 0.0,
        "shard_tokens": 1024,
        "seed": 3,
        "shuffle_buffer": 0,
        "shuffle_buffer_bytes": 0,
        "text_field": "body",
        "eos": "</s>",
    }


def test_hub_requests_are_compared_as_requested_without_the_network():
    # No hub client is given and none is reached: the commit a branch resolved to is what the manifest keeps.
    assert requested_source("fineweb-edu:sample-10BT") == {
        "kind": "hub",
        "dataset": FINEWEB_EDU_REPO,
        "config": "sample-10BT",
        "revision_requested": "main",
        "text_field": "text",
    }
    assert requested_tokenizer("hub:gpt2") == {"kind": "hub", "name": "gpt2", "revision_requested": "main"}
    assert requested_tokenizer("bpe:2048") == {"kind": "bpe", "requested_vocab_size": 2048}
    assert (
        prepared_differences(hub_manifest(), "fineweb-edu:sample-10BT@main", "hub:gpt2@main", OPTIONS) == []
    )


def test_each_difference_is_named_with_both_sides():
    found = prepared_differences(hub_manifest(seed=1), "fineweb-edu:sample-100BT", "hub:gpt2@v2", OPTIONS)
    assert found == [
        "source: prepared from fineweb-edu:sample-10BT@main (commit ffffffffffff), this call asks for "
        "fineweb-edu:sample-100BT@main",
        "tokenizer: prepared with hub:gpt2@main, this call asks for hub:gpt2@v2",
        "seed: prepared with 1, this call asks for 0",
    ]
