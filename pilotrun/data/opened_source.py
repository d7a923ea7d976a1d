"""What every source kind gives `prepare`: an `OpenedSource` (its identity for the manifest and fresh passes
over its documents), the reading units a local source is visited in, and `SourceKind`, the one registration
of a kind in data/sources.py.

An `OpenedSource` can be iterated more than once (`documents()` starts a fresh pass), because training a BPE
tokenizer needs one pass before the tokenizing pass. Local sources are read in units (a .txt or .jsonl file,
one parquet row group) that `positioned(order_seed)` can visit in a seeded random order, so that the bounded
shuffle buffer after it mixes documents from the whole corpus instead of only neighbours; every document keeps
its position in the source's own order (what the manifest's order correlation is measured against). Empty or
whitespace-only texts are skipped and counted, since they would only add an EOS.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pilotrun.common.errors import DataError
from pilotrun.data.hub import HubClient

UNIT_ORDER_RULE = ("reading units (a .txt or .jsonl file, a parquet row group) in the order "
                   "random.Random('pilotrun-unit-order/' + str(seed)).shuffle(units in source order)")


@dataclass(frozen=True)
class ReadUnit:
    """A piece of a local source read in one go: its name, its first row's position in the source's own order,
    its row count (empty rows included) and how to read it."""

    name: str
    start: int
    rows: int
    read: Callable[[], Iterator[str | None]]


def unit_order(count: int, seed: int) -> list[int]:
    # A string seed of its own: the unit order and the shuffle buffer draw from independent streams.
    order = list(range(count))
    random.Random(f"pilotrun-unit-order/{seed}").shuffle(order)
    return order


@dataclass
class OpenedSource:
    identity: dict[str, Any]
    _iterate: Callable[[], Iterator[str | None]]
    skipped_empty: int = field(default=0)  # of the latest complete or partial pass
    # Documents a full pass reads (empty ones included) when the source knows it up front: the progress bar's
    # total when no --train-tokens cap is given. None for streamed hub data.
    expected_documents: int | None = None
    units: list[ReadUnit] | None = None  # local sources only

    def documents(self) -> Iterator[str]:
        """A fresh pass over the non-empty documents, in the source's own order."""
        for _, text in self.positioned(None):
            yield text

    def positioned(self, order_seed: int | None) -> Iterator[tuple[int, str]]:
        """A fresh pass of (position in the source's own order, text) over the non-empty documents; with
        `order_seed` (and a local source) the reading units come in `unit_order(len(units), order_seed)`."""
        self.skipped_empty = 0
        if order_seed is None or not self.units:
            rows = enumerate(self._iterate())
        else:
            rows = ((unit.start + offset, text) for index in unit_order(len(self.units), order_seed)
                    for unit in (self.units[index],) for offset, text in enumerate(unit.read()))
        for position, text in rows:
            if text is None or not text.strip():
                self.skipped_empty += 1
                continue
            yield position, text

    def order_record(self, order_seed: int | None) -> dict[str, Any]:
        """What the manifest records of the reading order (the units and their order's digest)."""
        from pilotrun.common.files import canonical_sha256

        if order_seed is None or not self.units:
            return {"units": len(self.units or ()) or None, "shuffled": False}
        order = [self.units[i].name for i in unit_order(len(self.units), order_seed)]
        return {
            "units": len(order),
            "shuffled": True,
            "rule": UNIT_ORDER_RULE,
            "order_sha256": canonical_sha256(order),
            "first_units": order[:8],
        }


@dataclass(frozen=True)
class SourceKind:
    """One kind of `--source`: `name` is the manifest identity's `kind`; `spec` how `--source` names it (its
    help); `claims(spec)` whether a spec is this kind's; `open(spec, text_field, hub)` the source itself;
    `requested(spec, text_field)` what the spec alone decides of the identity, without the network (a
    pilot's reuse of a prepared folder); `describe(identity)` a recorded identity in one line."""

    name: str
    spec: str
    claims: Callable[[str], bool]
    open: Callable[[str, str, HubClient | None], OpenedSource]
    requested: Callable[[str, str], dict[str, Any]]
    describe: Callable[[dict[str, Any]], str]


def text_of_row(row: Any, text_field: str, where: str) -> str | None:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with a '{text_field}' field, got {type(row).__name__}")
    if text_field not in row:
        raise DataError(f"{where}: no field '{text_field}' (fields: {', '.join(sorted(map(str, row)))}); "
                        "choose one with --text-field")
    text = row[text_field]
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: field '{text_field}' is {type(text).__name__}, not text")
    return text

