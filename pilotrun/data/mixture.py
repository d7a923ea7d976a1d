"""A data mixture: several prepared folders with weights, and the seeded schedule that decides each global
batch.

`--data` takes a prepared folder or a mixture file (YAML):

    mixture:
      - {path: data/edu, weight: 0.7}        # a path relative to the mixture file, or absolute
      - {path: data/code, weight: 0.3, name: code}
    seed: 0                                  # the schedule's seed (optional, default 0)

A source is identified by its folder's metadata_sha256, never by its path, so the same mixture elsewhere is
the same data: the mixture's identity (`mixture_identity`) is a sha256 over the sources' metadata_sha256 in
order; the weights and the seed are recorded beside it and compared on resume as their own keys. A name (the
folder's base name unless given) labels a source in the record and the report.

The schedule (`MixtureSchedule`) works in whole rows (windows of `seq_len + 1` tokens) of a global batch of G
= batch_size * world_size rows. Batch b gives each source its quota of the rows still owed to it: quota_i =
(rows the weights owe source i after b + 1 batches) - (rows it has had), floors first, the remaining rows to
the largest remainders (ties broken by a seeded hash of (seed, b, source)). The running account keeps every
source's cumulative rows within one row of its weight's share after each batch (the quota property; a source
owed less than a row per batch can lag one more row at most). Where every source is owed at least a row a
batch, no quota is ever negative and the account has a closed form (the rows owed after b batches, apportioned
by largest remainders), so any batch is found at once; otherwise it is accumulated batch by batch and cached.
Which of the G rows come from which source is a seeded permutation per batch (`row_sources`). Everything is a
pure function of (weights, seed, G, b) and of where the weights last changed, so the stream is the same at any
world size with the same global batch, and after any resume. Integer arithmetic only: a weight is taken as the
decimal it was written as (0.7 is 7/10), so no rounding differs between machines.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from pilotrun.common.errors import DataError
from pilotrun.common.files import canonical_sha256
from pilotrun.common.parsing import parse_yaml_text, read_text_bounded
from pilotrun.config.typed import nearest_hint

MIXTURE_SUFFIXES = (".yaml", ".yml")
SOURCE_KEYS = ("path", "weight", "name")
MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SourceSpec:
    name: str
    path: str  # resolved at run time; never part of the identity
    weight: float


@dataclass(frozen=True)
class MixtureSpec:
    sources: tuple[SourceSpec, ...]
    seed: int
    file: str

    @property
    def weights(self) -> list[float]:
        return [source.weight for source in self.sources]


def is_mixture_file(path: str | os.PathLike) -> bool:
    """A `--data` that names a file (not a folder) is a mixture file."""
    return os.path.isfile(path)


def _weight(value: Any, where: str) -> float:
    if isinstance(value, str) and _reads_as_number(value):
        # YAML 1.1 (PyYAML) reads an exponent without a dot or a sign (1e3) as text, where Python reads a
        # number.
        raise DataError(
            f"{where}: weight {value!r} was read by YAML as text, not a number (YAML needs a dot and a "
            f"signed exponent, 1.0e+3, or plain digits); write {float(value):g}"
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DataError(f"{where}: weight {value!r} is not a number")
    weight = float(value)
    if not math.isfinite(weight) or weight <= 0:
        raise DataError(f"{where}: weight {value!r} must be a finite number above 0")
    return weight


def _reads_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _folder_problem(folder: Path) -> str | None:
    """Why `folder` cannot be a source's data folder: missing, or something else than a folder (a file, a
    FIFO, a device such as /dev/zero), said as what it is."""
    if folder.is_dir():
        return None
    if not folder.exists():
        return f"data folder {folder} not found"
    kind = (
        "a FIFO"
        if folder.is_fifo()
        else "a device"
        if folder.is_char_device() or folder.is_block_device()
        else "a socket"
        if folder.is_socket()
        else "a file"
    )
    return f"{folder} is {kind}, not a prepared data folder"


def parse_mixture(path: str | os.PathLike) -> MixtureSpec:
    """Read and check a mixture file; every problem is one DataError line naming the file and the entry."""
    path = os.fspath(path)
    data = parse_yaml_text(read_text_bounded(path, error=DataError), path, DataError)
    if not isinstance(data, dict) or set(data) - {"mixture", "seed"}:
        extra = sorted(set(data) - {"mixture", "seed"}) if isinstance(data, dict) else None
        raise DataError(
            f"{path}: a mixture file is a mapping with `mixture: [{{path: DIR, weight: W}}, ...]` and an "
            f"optional `seed`"
            + (f"; unknown key(s) {extra}{nearest_hint(str(extra[0]), ('mixture', 'seed'))}" if extra else "")
        )
    entries = data.get("mixture")
    if not isinstance(entries, list) or not entries:
        raise DataError(f"{path}: `mixture` must be a non-empty list of {{path: DIR, weight: W}}")
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise DataError(f"{path}: seed {seed!r} must be a whole number >= 0")
    base = Path(path).parent
    sources: list[SourceSpec] = []
    seen_paths: dict[str, int] = {}
    for index, entry in enumerate(entries):
        where = f"{path}: mixture entry {index + 1}"
        # an unknown key first: `weigth` is a typo of `weight`, which is then missing too
        unknown = sorted(set(entry) - set(SOURCE_KEYS), key=str) if isinstance(entry, dict) else []
        if unknown:
            raise DataError(f"{where}: unknown key(s) {unknown}{nearest_hint(str(unknown[0]), SOURCE_KEYS)} "
                            f"(known: {', '.join(SOURCE_KEYS)})")
        if not isinstance(entry, dict) or "path" not in entry or "weight" not in entry:
            raise DataError(f"{where}: each entry needs `path` and `weight`")
        if not isinstance(entry["path"], str) or not entry["path"].strip():
            raise DataError(f"{where}: path {entry['path']!r} is not a folder name")
        weight = _weight(entry["weight"], where)
        folder = Path(entry["path"]).expanduser()
        folder = folder if folder.is_absolute() else base / folder
        problem = _folder_problem(folder)
        if problem is not None:
            raise DataError(f"{where}: {problem}")
        real = os.path.realpath(folder)
        if real in seen_paths:
            raise DataError(
                f"{where}: folder {folder} is already mixture entry {seen_paths[real] + 1}: the same "
                "folder twice (give it one entry with the summed weight)"
            )
        seen_paths[real] = index
        name = entry.get("name", folder.resolve().name)
        if not isinstance(name, str) or not name or name in {s.name for s in sources}:
            raise DataError(
                f"{where}: source name {name!r} is empty or already used; give each source a distinct `name`"
            )
        sources.append(SourceSpec(name=name, path=str(folder), weight=weight))
    total = sum(s.weight for s in sources)
    if not math.isfinite(total) or total <= 0:
        raise DataError(f"{path}: the weights sum to {total}, not a positive total")
    return MixtureSpec(sources=tuple(sources), seed=int(seed), file=path)


def mixture_identity(source_sha256s: list[str]) -> str:
    """The identity of a mixture's data: its sources' metadata_sha256 in order (weights and seed are recorded
    and compared apart, so a weight change is a recipe change, not other data). One source is its own
    identity, so a mixture of one folder is that folder."""
    if len(source_sha256s) == 1:
        return source_sha256s[0]
    return canonical_sha256({"mixture_sources": list(source_sha256s)})


def exact_weights(weights: list[float]) -> list[int]:
    """The weights as integers in the same ratios, each read as the decimal it prints as (0.7 -> 7/10)."""
    fractions = [Fraction(repr(float(w))) for w in weights]
    denominator = math.lcm(*(f.denominator for f in fractions))
    integers = [int(f * denominator) for f in fractions]
    common = math.gcd(*integers)
    return [value // common for value in integers]


def _mix(*values: int) -> int:
    """A 64-bit hash of integers (splitmix64 steps): the schedule's tie-break, the same on every machine."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state + (value & MASK64) + 0x9E3779B97F4A7C15) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        state = z ^ (z >> 31)
    return state


class MixtureSchedule:
    """Rows per source of every global batch from `start_batch` on, given the cumulative rows at its start
    (zeros from the first batch; a resume with changed weights starts a new schedule where it resumes)."""

    def __init__(self, weights: list[float], seed: int, rows_per_batch: int, start_batch: int = 0,
                 start_rows: list[int] | None = None) -> None:
        if rows_per_batch < 1:
            raise DataError(f"a global batch needs at least one row, got {rows_per_batch}")
        self.weights = [float(w) for w in weights]
        self.integer_weights = exact_weights(self.weights)
        self.total_weight = sum(self.integer_weights)
        self.seed, self.rows_per_batch, self.start_batch = int(seed), int(rows_per_batch), int(start_batch)
        self.start_rows = [int(r) for r in (start_rows or [0] * len(weights))]
        if len(self.start_rows) != len(weights):
            raise DataError(
                f"the schedule has {len(weights)} sources, its start counts {len(self.start_rows)}"
            )
        # Every source owed at least a row a batch: no quota is ever below zero, so the rows before batch b
        # are the largest-remainder apportionment of the rows owed at b alone (`_closed_form`), whatever came
        # before.
        self.memoryless = all(rows_per_batch * w >= self.total_weight for w in self.integer_weights)
        # Cumulative rows before batch start_batch + j, row j; grown on demand (the general case).
        self._cumulative = np.zeros((1024, len(weights)), dtype=np.int64)
        self._cumulative[0] = self.start_rows
        self._known = 1

    def _counts_after(self, batch: int, had: list[int]) -> list[int]:
        """Rows per source of batch `batch`, given `had` rows before it (the module docstring's
        apportionment)."""
        total, weights, rows = self.total_weight, self.integer_weights, self.rows_per_batch
        batches = batch + 1 - self.start_batch
        owed = [(start * total + batches * rows * w) - h * total for start, w, h in
                zip(self.start_rows, weights, had, strict=True)]  # quota_i * total, exactly
        counts = [max(0, q // total) for q in owed]
        left = rows - sum(counts)
        order = sorted(
            range(len(counts)), key=lambda i: (-(owed[i] - counts[i] * total), _mix(self.seed, batch, i))
        )
        while left > 0:
            for i in order[:left]:
                counts[i] += 1
            left = rows - sum(counts)
        while left < 0:
            for i in reversed(order):
                if counts[i] > 0 and left < 0:
                    counts[i] -= 1
                    left += 1
        return counts

    def _closed_form(self, batch: int) -> list[int]:
        """Rows before `batch` when every quota is a row or more: what `_counts_after` accumulates to, since
        each step gives source i the floor or the ceiling of what it is owed, ranked by the same
        remainders."""
        total, batches = self.total_weight, batch - self.start_batch
        owed = [start * total + batches * self.rows_per_batch * w for start, w in
                zip(self.start_rows, self.integer_weights, strict=True)]
        rows = [q // total for q in owed]
        left = self.rows_per_batch * batches + sum(self.start_rows) - sum(rows)
        order = sorted(
            range(len(rows)), key=lambda i: (-(owed[i] - rows[i] * total), _mix(self.seed, batch - 1, i))
        )
        for i in order[:left]:
            rows[i] += 1
        return rows

    def rows_before(self, batch: int) -> list[int]:
        """Cumulative rows per source before global batch `batch` (batch >= start_batch)."""
        offset = batch - self.start_batch
        if offset < 0:
            raise DataError(
                f"global batch {batch} comes before this schedule's start at batch {self.start_batch} "
                "(the weights changed there)"
            )
        if self.memoryless:
            return list(self.start_rows) if offset == 0 else self._closed_form(batch)
        while self._known <= offset:
            if self._known == len(self._cumulative):
                self._cumulative = np.concatenate([self._cumulative, np.zeros_like(self._cumulative)])
            had = [int(x) for x in self._cumulative[self._known - 1]]
            counts = self._counts_after(self.start_batch + self._known - 1, had)
            self._cumulative[self._known] = [h + c for h, c in zip(had, counts, strict=True)]
            self._known += 1
        return [int(x) for x in self._cumulative[offset]]

    def rows_planned(self, batch: int) -> tuple[list[int], bool]:
        """Rows per source before `batch`, and whether they are exact, without walking every batch before
        it (the plan at a session's start): exact where the schedule is memoryless or has walked that far;
        else the apportionment of the rows owed at `batch` alone (`_closed_form`), within a row of each
        source's exact count, since every batch keeps each source's cumulative rows within a row of what it
        is owed."""
        if batch < self.start_batch:
            return self.rows_before(batch), True  # refused there by name
        if self.memoryless or batch - self.start_batch < self._known:
            return self.rows_before(batch), True
        return self._closed_form(batch), False

    def counts(self, batch: int) -> list[int]:
        """Rows per source of global batch `batch`."""
        before, after = self.rows_before(batch), self.rows_before(batch + 1)
        return [a - b for a, b in zip(after, before, strict=True)]

    def row_sources(self, batch: int) -> np.ndarray:
        """The source of each of the batch's G global rows: the counts laid out by a seeded permutation."""
        labels = np.repeat(np.arange(len(self.weights), dtype=np.int64), self.counts(batch))
        order = np.random.default_rng([self.seed, batch]).permutation(self.rows_per_batch)
        return labels[order]

    def state(self) -> dict[str, Any]:
        return {"weights": list(self.weights), "seed": self.seed, "start_batch": self.start_batch,
                "start_rows": list(self.start_rows)}
