"""Sources: where documents come from, and the identity of that origin for the manifest.

`open_source(spec, text_field, hub)` accepts
- `builtin`: the offline corpus of builtin_corpus.py;
- `fineweb-edu[:CONFIG][@REVISION]`: HuggingFaceFW/fineweb-edu streamed through the hub seam, the revision
  resolved to a commit SHA (default config `sample-10BT`, default revision `main`);
- local files: a path or a glob of `.parquet` (column `text_field`), `.jsonl` (field `text_field`) and `.txt`
  (one file = one document); globs are expanded and sorted, and every file is hashed into the manifest.

An `OpenedSource` can be iterated more than once (`documents()` starts a fresh pass), because training a BPE
tokenizer needs one pass before the tokenizing pass. Local sources are read in units (a .txt or .jsonl file,
one parquet row group) that `positioned(order_seed)` can visit in a seeded random order, so that the bounded
shuffle buffer after it mixes documents from the whole corpus instead of only neighbours; every document keeps
its position in the source's own order (what the manifest's order correlation is measured against). Documents are yielded as they are read (never the whole
corpus in memory). Empty or whitespace-only texts are skipped and counted, since they would only add an EOS.
No absolute path enters the identity: local files are named relative to their common folder.
"""

from __future__ import annotations

import glob
import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pilotrun.common.errors import DataError
from pilotrun.common.files import not_regular, sha256_of_file
from pilotrun.data.builtin_corpus import builtin_corpus_info, iter_builtin_documents
from pilotrun.data.hub import HubClient, HuggingFaceHub, resolve_commit

FINEWEB_EDU_REPO = "HuggingFaceFW/fineweb-edu"
FINEWEB_EDU_DEFAULT_CONFIG = "sample-10BT"
LOCAL_SUFFIXES = (".parquet", ".jsonl", ".txt")
GLOB_CHARACTERS = set("*?[")
# Documents per Arrow batch within a row group: memory is this batch (and one page buffer), not the file.
PARQUET_BATCH_ROWS = 1024
PARQUET_READ_BUFFER_BYTES = 1 << 20
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
        return {"units": len(order), "shuffled": True, "rule": UNIT_ORDER_RULE, "order_sha256": canonical_sha256(order),
                "first_units": order[:8]}


def open_source(spec: str, text_field: str = "text", hub: HubClient | None = None) -> OpenedSource:
    spec = str(spec).strip()
    if not spec:
        raise DataError("--source is empty")
    if spec == "builtin":
        info = builtin_corpus_info()
        return OpenedSource(identity=info.to_manifest(), _iterate=iter_builtin_documents,
                            expected_documents=info.documents)
    if spec == "fineweb-edu" or spec.startswith(("fineweb-edu:", "fineweb-edu@")):
        return _open_fineweb_edu(spec, text_field, hub or HuggingFaceHub())
    return _open_local(spec, text_field)


# ---------------------------------------------------------------------------------------------- hub
def parse_fineweb_spec(spec: str) -> tuple[str, str]:
    """`fineweb-edu[:CONFIG][@REVISION]` -> (config, revision)."""
    rest = spec[len("fineweb-edu"):]
    revision = "main"
    if "@" in rest:
        rest, revision = rest.split("@", 1)
        if not revision:
            raise DataError(f"--source '{spec}': empty revision after '@'")
    config = FINEWEB_EDU_DEFAULT_CONFIG
    if rest:
        if not rest.startswith(":") or len(rest) == 1:
            raise DataError(f"--source '{spec}': expected fineweb-edu[:CONFIG][@REVISION]")
        config = rest[1:]
    return config, revision


def _open_fineweb_edu(spec: str, text_field: str, hub: HubClient) -> OpenedSource:
    config, revision = parse_fineweb_spec(spec)
    sha = resolve_commit(hub, FINEWEB_EDU_REPO, revision, "dataset")

    def iterate() -> Iterator[str | None]:
        for index, row in enumerate(hub.stream_rows(FINEWEB_EDU_REPO, config, sha)):
            yield _text_of_row(row, text_field, f"{FINEWEB_EDU_REPO}:{config}@{sha} row {index}")

    identity = {
        "kind": "hub",
        "dataset": FINEWEB_EDU_REPO,
        "config": config,
        "split": "train",
        "revision_requested": revision,
        "revision": sha,
        "text_field": text_field,
    }
    return OpenedSource(identity=identity, _iterate=iterate)


def _text_of_row(row: Any, text_field: str, where: str) -> str | None:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with a '{text_field}' field, got {type(row).__name__}")
    if text_field not in row:
        raise DataError(f"{where}: no field '{text_field}' (fields: {', '.join(sorted(map(str, row)))}); "
                        "choose one with --text-field")
    text = row[text_field]
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: field '{text_field}' is {type(text).__name__}, not text")
    return text


# ---------------------------------------------------------------------------------------------- local files
def expand_local_files(spec: str) -> list[str]:
    if GLOB_CHARACTERS & set(spec):
        files = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError(f"--source '{spec}': the pattern matches no files")
    else:
        if not os.path.exists(spec):
            raise DataError(f"--source '{spec}': no such file (sources: builtin, fineweb-edu[:CONFIG][@REV], "
                            "or .parquet/.jsonl/.txt files or a glob)")
        odd = not_regular(spec)
        if odd is not None:
            raise DataError(f"--source '{spec}' is {odd}")
        if not os.path.isfile(spec):
            raise DataError(f"--source '{spec}' is a folder: give a file or a glob such as '{spec}/*.parquet'")
        files = [spec]
    for path in files:
        if not path.endswith(LOCAL_SUFFIXES):
            raise DataError(f"--source: '{path}' is not a .parquet, .jsonl or .txt file")
    return files


def _open_local(spec: str, text_field: str) -> OpenedSource:
    files = expand_local_files(spec)
    common = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in files])
    names = [os.path.relpath(os.path.abspath(p), common) for p in files]
    records = [{"name": name, "bytes": os.path.getsize(p), "sha256": sha256_of_file(p)} for name, p in zip(names, files)]
    units: list[ReadUnit] = []
    for path, name in zip(files, names):
        start = units[-1].start + units[-1].rows if units else 0
        units.extend(_units_of_local_file(path, name, text_field, start))

    def iterate() -> Iterator[str | None]:
        for unit in units:
            yield from unit.read()

    identity = {"kind": "local", "files": records, "text_field": text_field}
    return OpenedSource(identity=identity, _iterate=iterate, expected_documents=sum(u.rows for u in units),
                        units=units)


def _units_of_local_file(path: str, name: str, text_field: str, start: int) -> list[ReadUnit]:
    """A parquet file's row groups (counted from its footer), else the file as one unit (a jsonl's non-blank
    lines counted in one binary scan, one document for a .txt). A damaged parquet is one unit of 0 rows:
    reading it gives the error that names the problem."""
    if path.endswith(".txt"):
        return [ReadUnit(name, start, 1, lambda: _read_local_file(path, text_field))]
    if path.endswith(".jsonl"):
        count = 0
        with open(path, "rb") as handle:
            for line in handle:
                count += bool(line.strip())
        return [ReadUnit(name, start, count, lambda: _read_jsonl(path, text_field))]
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(path).metadata
    except Exception:
        return [ReadUnit(name, start, 0, lambda: _read_parquet(path, text_field, None))]
    units = []
    for group in range(metadata.num_row_groups):
        rows = int(metadata.row_group(group).num_rows)
        units.append(ReadUnit(f"{name}#{group}", start, rows,
                              lambda group=group: _read_parquet(path, text_field, group)))
        start += rows
    return units


def _read_local_file(path: str, text_field: str) -> Iterator[str | None]:
    if path.endswith(".txt"):
        try:
            with open(path, encoding="utf-8") as handle:
                yield handle.read()
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    elif path.endswith(".jsonl"):
        yield from _read_jsonl(path, text_field)
    else:
        yield from _read_parquet(path, text_field, None)


def _read_jsonl(path: str, text_field: str) -> Iterator[str | None]:
    with open(path, encoding="utf-8") as handle:
        line_number = 0
        while True:
            try:
                line = handle.readline()
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}: not UTF-8 near line {line_number + 1} ({exc.reason})") from None
            if not line:
                return
            line_number += 1
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{line_number}: not valid JSON ({exc.msg})") from None
            yield _text_of_row(row, text_field, f"{path}:{line_number}")


def _read_parquet(path: str, text_field: str, group: int | None) -> Iterator[str | None]:
    """One row group (all of them for None) in batches, without pre-buffering: Arrow's default reads a whole
    file's column chunks ahead, so memory followed the file's size; here it follows one batch and its pages."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path, pre_buffer=False, buffer_size=PARQUET_READ_BUFFER_BYTES)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for damaged files
        raise DataError(f"{path}: not a readable parquet file ({exc})") from None
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise DataError(f"{path}: no column '{text_field}' (columns: {', '.join(names)}); "
                        "choose one with --text-field")
    column_type = parquet.schema_arrow.field(text_field).type
    # A dictionary-encoded string column (what pandas' category dtype writes) reads as its strings.
    # Only a dictionary's values: a list column (list<string>) has a value_type too, and is no text.
    value_type = column_type.value_type if pa.types.is_dictionary(column_type) else column_type
    if str(value_type) not in ("string", "large_string", "string_view"):
        raise DataError(f"{path}: column '{text_field}' has type {column_type}, not string")
    groups = range(parquet.metadata.num_row_groups) if group is None else (group,)
    for index in groups:
        row = 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[index], columns=[text_field],
                                          use_threads=False):
            try:
                texts = batch.column(0).to_pylist()
            except (UnicodeDecodeError, ValueError) as exc:  # a writer that did not validate UTF-8
                reason = exc.reason if isinstance(exc, UnicodeDecodeError) else " ".join(str(exc).split())[:120]
                raise DataError(f"{path}: column '{text_field}', row group {index}, rows {row}..{row + batch.num_rows - 1}: "
                                f"not valid UTF-8 text ({reason})") from None
            row += batch.num_rows
            yield from texts
