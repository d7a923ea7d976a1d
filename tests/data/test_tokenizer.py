"""Tokenizer resolution: EOS found or named (or a clear error), identity hashed, plain encoding."""

from __future__ import annotations

import hashlib

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from pilotrun.common.errors import DataError
from pilotrun.data.tokenizer import encode_documents, plain_encoder, resolve_tokenizer

from .conftest import FAKE_SHA, LocalHub


def test_gpt2_file_identity_and_eos(gpt2_tokenizer_path):
    resolved = resolve_tokenizer(str(gpt2_tokenizer_path))
    identity = resolved.identity
    assert identity["kind"] == "file" and identity["name"] == "tokenizer.json"
    assert (identity["eos_token"], identity["eos_id"], identity["vocab_size"]) == (
        "<|endoftext|>",
        50256,
        50257,
    )
    assert identity["sha256"] == hashlib.sha256(resolved.json_text.encode()).hexdigest()
    assert resolved.dtype == "uint16"
    assert Tokenizer.from_str(resolved.json_text).encode("Hello world").ids == [15496, 995]


def test_plain_encoding_appends_eos_and_ignores_literal_special_tokens(gpt2_tokenizer_path):
    resolved = resolve_tokenizer(str(gpt2_tokenizer_path))
    encoder = plain_encoder(resolved.json_text)
    tokens, lengths = encode_documents(encoder, ["Hello world", "x<|endoftext|>y"], 50256, "uint16")
    assert tokens[:3].tolist() == [15496, 995, 50256]
    assert lengths.tolist() == [3, len(tokens) - 3]
    assert tokens.tolist().count(50256) == 2 and tokens[-1] == 50256


def test_eos_can_be_named_and_must_exist(gpt2_tokenizer_path, tmp_path):
    assert resolve_tokenizer(str(gpt2_tokenizer_path), eos="<|endoftext|>").eos_id == 50256
    with pytest.raises(DataError, match="--eos '</s>' is not a token"):
        resolve_tokenizer(str(gpt2_tokenizer_path), eos="</s>")
    bare = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    bare.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(DataError, match="no end-of-document token.*--eos"):
        resolve_tokenizer(str(tmp_path / "bare.json"))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        resolve_tokenizer(str(tmp_path / "broken.json"))


def test_truncation_in_a_stored_tokenizer_is_switched_off(gpt2_tokenizer_path, tmp_path):
    tokenizer = Tokenizer.from_file(str(gpt2_tokenizer_path))
    tokenizer.enable_truncation(8)
    tokenizer.save(str(tmp_path / "truncating.json"))
    text = " ".join(["word"] * 50)  # 50 GPT-2 tokens
    assert len(Tokenizer.from_file(str(tmp_path / "truncating.json")).encode(text).ids) == 8
    resolved = resolve_tokenizer(str(tmp_path / "truncating.json"))
    tokens, _ = encode_documents(plain_encoder(resolved.json_text), [text], 50256, "uint16")
    assert len(tokens) == 51


def test_hub_tokenizer_through_the_seam(gpt2_tokenizer_path):
    hub = LocalHub([], files={"openai-community/gpt2/tokenizer.json": str(gpt2_tokenizer_path)})
    resolved = resolve_tokenizer("hub:openai-community/gpt2@v2", hub=hub)
    assert resolved.identity["revision"] == FAKE_SHA and resolved.identity["revision_requested"] == "v2"
    assert resolved.identity["sha256"] == resolve_tokenizer(str(gpt2_tokenizer_path)).identity["sha256"]
    assert hub.calls == [("resolve", "openai-community/gpt2", "v2", "model"),
                         ("download", "openai-community/gpt2", "tokenizer.json", FAKE_SHA)]


def test_trained_bpe_is_deterministic_and_has_an_eos():
    texts = [f"The {i}th sentence about tokenizers, merges and byte pairs." for i in range(300)]
    first = resolve_tokenizer("bpe:400", training_texts=lambda: iter(texts))
    second = resolve_tokenizer("bpe:400", training_texts=lambda: iter(texts))
    assert first.json_text == second.json_text and first.vocab_size == 400
    assert first.identity["eos_token"] == "<|endoftext|>" and first.identity["trained_on_documents"] == 300
    with pytest.raises(DataError, match="no documents"):
        resolve_tokenizer("bpe:400", training_texts=lambda: iter([]))


def test_a_word_level_tokenizer_without_an_unknown_token_is_a_data_error():
    tokenizer = Tokenizer(models.WordLevel({"hello": 0, "<|endoftext|>": 1}))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(DataError, match="cannot encode the documents: WordLevel error"):
        encode_documents(tokenizer, ["hello there"], 1, "uint16")
