"""Tokenizers: resolve `--tokenizer`, find the end-of-document id, and encode documents plainly.

Specs:
- `bpe:VOCAB`: a byte-level BPE trained with `tokenizers` on the training split (a pass over the same
  shuffled, split stream that is then tokenized), with `<|endoftext|>` as its one special token;
- `hub:NAME[@REVISION]`: `tokenizer.json` of a hub model repo, the revision resolved to a commit SHA;
- a path to a `tokenizer.json`.

Whatever the origin, the tokenizer is normalized for document encoding (truncation and padding off, which
would otherwise silently cut documents) and serialized; that exact JSON text is what the data folder stores
as tokenizer.json and what `sha256` in the manifest hashes, so the identity is checkable from the folder.

Encoding is plain: `encode_special_tokens = True` makes a literal `<|endoftext|>` inside a document encode as
ordinary text (never as the EOS id), `add_special_tokens=False` keeps post-processors from adding BOS/EOS, and
the EOS id is appended after every document by `encode_documents`.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from pilotrun.common.errors import DataError
from pilotrun.common.files import not_regular
from pilotrun.data.hub import HubClient, HuggingFaceHub, resolve_commit

# End-of-document tokens of common tokenizer families, tried in this order when --eos is not given.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|end|>")
BPE_EOS_TOKEN = "<|endoftext|>"
# A trained BPE reads at most this many characters of training documents: word counts are what training
# keeps in memory, and a few hundred MB of text already gives stable merges for small vocabularies.
BPE_MAX_TRAINING_CHARACTERS = 200_000_000
UINT16_VOCAB_LIMIT = 65536


@dataclass
class ResolvedTokenizer:
    tokenizer: Tokenizer
    json_text: str
    identity: dict[str, Any]

    @property
    def eos_id(self) -> int:
        return int(self.identity["eos_id"])

    @property
    def vocab_size(self) -> int:
        return int(self.identity["vocab_size"])

    @property
    def dtype(self) -> str:
        return self.identity["dtype"]


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= UINT16_VOCAB_LIMIT else "uint32"


def parse_bpe_spec(spec: str) -> int:
    text = spec[len("bpe:"):]
    try:
        vocab = int(float(text)) if text and float(text).is_integer() else None
    except ValueError:
        vocab = None
    if vocab is None or vocab < 258:
        raise DataError(f"--tokenizer '{spec}': expected bpe:VOCAB with VOCAB an integer >= 258 "
                        "(256 byte tokens, the EOS token and at least one merge)")
    return vocab


def train_bpe(
    vocab_size: int, texts: Iterator[str], progress: bool = False
) -> tuple[Tokenizer, dict[str, int]]:
    """A GPT-2-style byte-level BPE: ByteLevel pre-tokenizer (GPT-2 split regex), no normalizer."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its bar writes blank lines to stdout; prepare reports on stderr instead
    )
    seen = {"documents": 0, "characters": 0}

    def counted() -> Iterator[str]:
        for text in texts:
            if seen["characters"] >= BPE_MAX_TRAINING_CHARACTERS:
                return
            seen["documents"] += 1
            seen["characters"] += len(text)
            yield text

    if progress:
        print(f"training a byte-level BPE of {vocab_size} tokens on the training split...", file=sys.stderr)
    tokenizer.train_from_iterator(counted(), trainer=trainer)
    if progress:
        print(f"trained on {seen['documents']} documents, {seen['characters']} characters", file=sys.stderr)
    if seen["documents"] == 0:
        raise DataError("cannot train a BPE tokenizer: the training split has no documents")
    return tokenizer, seen


def find_eos(tokenizer: Tokenizer, eos: str | None, where: str) -> tuple[str, int]:
    if eos is not None:
        token_id = tokenizer.token_to_id(eos)
        if token_id is None:
            raise DataError(f"--eos '{eos}' is not a token of tokenizer {where}")
        return eos, int(token_id)
    for name in EOS_CANDIDATES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return name, int(token_id)
    raise DataError(
        f"tokenizer {where} has no end-of-document token (looked for {', '.join(EOS_CANDIDATES)}); "
        "name one with --eos TOKEN"
    )


def resolve_tokenizer(
    spec: str,
    eos: str | None = None,
    training_texts: Callable[[], Iterator[str]] | None = None,
    hub: HubClient | None = None,
    progress: bool = False,
) -> ResolvedTokenizer:
    """Load or train the tokenizer named by `spec`; `training_texts` starts a pass over the training split."""
    spec = str(spec).strip()
    identity: dict[str, Any]
    if spec.startswith("bpe:"):
        vocab = parse_bpe_spec(spec)
        if training_texts is None:
            raise DataError("internal: a bpe tokenizer needs the training split to train on")
        tokenizer, seen = train_bpe(vocab, training_texts(), progress=progress)
        identity = {"kind": "bpe", "requested_vocab_size": vocab, "trained_on_documents": seen["documents"],
                    "trained_on_characters": seen["characters"]}
        where = spec
    elif spec.startswith("hub:"):
        name, _, revision = spec[len("hub:"):].partition("@")
        if not name:
            raise DataError(f"--tokenizer '{spec}': expected hub:NAME[@REVISION]")
        revision = revision or "main"
        hub = hub or HuggingFaceHub()
        sha = resolve_commit(hub, name, revision, "model")
        path = hub.download_file(name, "tokenizer.json", sha)
        tokenizer = _load_file(path, spec)
        identity = {"kind": "hub", "name": name, "revision_requested": revision, "revision": sha}
        where = f"{name}@{sha}"
    else:
        # A folder (a model folder, an export) stands for its tokenizer.json: the same file, the same
        # identity.
        path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
        if not os.path.isfile(path):
            # A folder is a valid kind here: say what it lacks, not that it does not exist.
            found = (f"{path} is a folder, not a file" if os.path.isdir(path) else
                     f"{path} is {not_regular(path)}" if not_regular(path) else
                     "a folder without a tokenizer.json" if os.path.isdir(spec) else "no such file")
            raise DataError(f"--tokenizer '{spec}': {found} (expected bpe:VOCAB, hub:NAME[@REVISION], a "
                            "path to a tokenizer.json or a folder holding one)")
        tokenizer = _load_file(path, spec)
        identity = {"kind": "file", "name": os.path.basename(path)}
        where = spec
    # Truncation or padding would silently cut or pad documents: the data step encodes whole documents.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    eos_token, eos_id = find_eos(tokenizer, eos, where)
    json_text = tokenizer.to_str()
    vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    identity.update({
        "sha256": hashlib.sha256(json_text.encode("utf-8")).hexdigest(),
        "vocab_size": vocab_size,
        "eos_token": eos_token,
        "eos_id": eos_id,
        "dtype": token_dtype(vocab_size),
    })
    if eos_id >= vocab_size:
        raise DataError(f"tokenizer {where}: EOS id {eos_id} is outside its vocabulary of {vocab_size}")
    return ResolvedTokenizer(tokenizer=tokenizer, json_text=json_text, identity=identity)


def _load_file(path: str, spec: str) -> Tokenizer:
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises a bare Exception for malformed JSON
        raise DataError(f"--tokenizer '{spec}': {path} is not a valid tokenizer.json ({exc})") from None


def plain(tokenizer: Tokenizer) -> Tokenizer:
    """Set `tokenizer` to encode special-token strings in text as ordinary text (not serialized: the stored
    tokenizer.json is unchanged by it)."""
    tokenizer.encode_special_tokens = True
    return tokenizer


def plain_encoder(json_text: str) -> Tokenizer:
    """A fresh tokenizer from stored JSON, encoding special-token strings as ordinary text."""
    return plain(Tokenizer.from_str(json_text))


def encode_documents(
    tokenizer: Tokenizer, texts: list[str], eos_id: int, dtype: str
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated ids with EOS after every document, and each document's length (EOS included)."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # same ids, no offsets
    try:
        encodings = encode(texts, add_special_tokens=False)
    except Exception as exc:  # the tokenizers library raises a bare Exception (a WordLevel without [UNK] ...)
        if type(exc) is not Exception:
            raise  # a TypeError for a non-text document is a caller's bug, named as itself
        raise DataError(
            f"the tokenizer cannot encode the documents: {' '.join(str(exc).split())[:160]} (a "
            "word-level or unigram tokenizer needs an unknown token for words it lacks)"
        ) from None
    ids: list[int] = []
    lengths = np.empty(len(encodings), dtype=np.int64)
    for index, encoding in enumerate(encodings):
        document_ids = encoding.ids
        ids.extend(document_ids)
        ids.append(eos_id)
        lengths[index] = len(document_ids) + 1
    return np.asarray(ids, dtype=dtype), lengths
