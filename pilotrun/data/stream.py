"""Shuffle and split: the two steps between reading documents and tokenizing them.

The shuffle is a seeded, bounded buffer: it holds at most `buffer_size` documents, so memory does not grow with
the corpus; each incoming document replaces a uniformly drawn slot whose occupant is emitted. Its randomness
comes from `random.Random(seed)` alone, so the order depends only on (source order, buffer size, seed).

The split is a function of the document's text only (a sha256 of its UTF-8 bytes mapped to [0, 1)), not of
its position or the seed: identical texts always share a split, and a re-prepare with another seed or
buffer never moves a validation document into training.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator

TRAIN, VAL = "train", "val"
SPLITS = (TRAIN, VAL)


def shuffled(documents: Iterable[str], buffer_size: int, seed: int) -> Iterator[str]:
    """Bounded-buffer shuffle; `buffer_size` <= 1 keeps the source order."""
    if buffer_size <= 1:
        yield from documents
        return
    rng = random.Random(seed)
    buffer: list[str] = []
    for text in documents:
        if len(buffer) < buffer_size:
            buffer.append(text)
            continue
        slot = rng.randrange(buffer_size)
        yield buffer[slot]
        buffer[slot] = text
    # Drain the remainder in a seeded random order too (a stable tail order would favour late documents).
    rng.shuffle(buffer)
    yield from buffer


def text_position(text: str) -> float:
    """A uniform number in [0, 1) that depends only on the text."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_of(text: str, val_fraction: float) -> str:
    return VAL if text_position(text) < val_fraction else TRAIN


def with_splits(documents: Iterable[str], val_fraction: float) -> Iterator[tuple[str, str]]:
    for text in documents:
        yield text, split_of(text, val_fraction)
