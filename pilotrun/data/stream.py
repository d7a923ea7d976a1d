"""Shuffle and split: the two steps between reading documents and tokenizing them.

The shuffle is a seeded, bounded buffer: it holds at most `max_documents` documents and at most `max_bytes`
bytes of text (`sys.getsizeof` of each str: what the buffer really costs, so long documents cannot inflate
it), so memory does not grow with the corpus; before each incoming document is added, uniformly drawn
occupants are emitted until it fits. Its randomness comes from `random.Random(seed)` alone, so the order
depends only on (source order, the two bounds, seed). A buffer too small for one document still holds that
one.

The order correlation (Pearson's r between each written document's output index and its position in the
source's own order) says how much of the source order survives: near 1 for a buffer that only mixes
neighbours, near 0 for a full shuffle. It is computed from exact integer sums, so it is the same on every run
and can be carried across an interrupted prepare.

The split is a function of the document's text only (a sha256 of its UTF-8 bytes mapped to [0, 1)), not of its
position or the seed: identical texts always share a split, and a re-prepare with another seed or buffer never
moves a validation document into training.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

TRAIN, VAL = "train", "val"
SPLITS = (TRAIN, VAL)


def shuffled(
    documents: Iterable[str], buffer_size: int, seed: int, buffer_bytes: int | None = None
) -> Iterator[str]:
    """Bounded-buffer shuffle of texts; `buffer_size` <= 1 keeps the source order."""
    buffer = ShuffleBuffer(buffer_size, buffer_bytes, seed)
    for text, _ in buffer.shuffle((text, text) for text in documents):
        yield text


class ShuffleBuffer:
    """The bounded shuffle over (item, text) pairs; `shuffle` yields (item, documents held at its
    emission)."""

    def __init__(self, max_documents: int, max_bytes: int | None, seed: int) -> None:
        self.max_documents, self.max_bytes, self.seed = int(max_documents), max_bytes, seed

    @property
    def active(self) -> bool:
        return self.max_documents > 1 and (self.max_bytes is None or self.max_bytes > 0)

    def shuffle(self, pairs: Iterable[tuple[T, str]]) -> Iterator[tuple[T, int]]:
        if not self.active:
            for item, _ in pairs:
                yield item, 0
            return
        rng = random.Random(self.seed)
        limit = math.inf if self.max_bytes is None else self.max_bytes
        items: list[Any] = []
        sizes: list[int] = []
        held = 0
        for item, text in pairs:
            size = sys.getsizeof(text)
            while items and (len(items) >= self.max_documents or held + size > limit):
                slot = rng.randrange(len(items))
                held -= sizes[slot]
                yield _take(slot, items, sizes), len(items) + 1
            items.append(item)
            sizes.append(size)
            held += size
        # Drain the remainder in a seeded random order too (a stable tail order would favour late documents).
        order = list(range(len(items)))
        rng.shuffle(order)
        for count, index in enumerate(order):
            yield items[index], len(items) - count


def _take(slot: int, items: list, sizes: list[int]) -> Any:
    """Remove the occupant of `slot` (the last one moves into its place: O(1))."""
    item = items[slot]
    items[slot], sizes[slot] = items[-1], sizes[-1]
    items.pop()
    sizes.pop()
    return item


class OrderCorrelation:
    """Pearson's r between output index and source position, from exact integer sums (resumable as a dict)."""

    def __init__(self, state: dict[str, int] | None = None) -> None:
        state = state or {}
        self.n, self.sum_p, self.sum_pp, self.sum_ip = (
            int(state.get(k, 0)) for k in ("n", "sum_p", "sum_pp", "sum_ip")
        )

    def add(self, positions: Iterable[int]) -> None:
        for position in positions:
            self.sum_p += position
            self.sum_pp += position * position
            self.sum_ip += self.n * position
            self.n += 1

    def state(self) -> dict[str, int]:
        return {"n": self.n, "sum_p": self.sum_p, "sum_pp": self.sum_pp, "sum_ip": self.sum_ip}

    def value(self) -> float | None:
        """r rounded to 6 decimals; None for fewer than two documents or a constant order."""
        n = self.n
        sum_i, sum_ii = n * (n - 1) // 2, (n - 1) * n * (2 * n - 1) // 6
        spread_i, spread_p = n * sum_ii - sum_i * sum_i, n * self.sum_pp - self.sum_p * self.sum_p
        if n < 2 or spread_i <= 0 or spread_p <= 0:
            return None
        return round((n * self.sum_ip - sum_i * self.sum_p) / (math.sqrt(spread_i) * math.sqrt(spread_p)), 6)


def text_position(text: str) -> float:
    """A uniform number in [0, 1) that depends only on the text."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_of(text: str, val_fraction: float) -> str:
    return VAL if text_position(text) < val_fraction else TRAIN


def with_splits(documents: Iterable[str], val_fraction: float) -> Iterator[tuple[str, str]]:
    for text in documents:
        yield text, split_of(text, val_fraction)
