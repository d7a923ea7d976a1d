"""`--source` local files: a path or a glob of `.parquet` (column `text_field`), `.jsonl` (field `text_field`)
and `.txt` (one file = one document). Globs are expanded and sorted, every file is hashed into the manifest,
and files are named relative to their common folder (no absolute path enters the identity). Each file is read
in units (a .txt or .jsonl file, a parquet row group) as it is read, never the whole corpus in memory."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

from pilotrun.common.errors import DataError
from pilotrun.common.files import not_regular, sha256_of_file
from pilotrun.data.hub import HubClient
from pilotrun.data.opened_source import OpenedSource, ReadUnit, SourceKind, text_of_row

LOCAL_SUFFIXES = (".parquet", ".jsonl", ".txt")
GLOB_CHARACTERS = set("*?[")
# Documents per Arrow batch within a row group: memory is this batch (and one page buffer), not the file.
PARQUET_BATCH_ROWS = 1024
PARQUET_READ_BUFFER_BYTES = 1 << 20


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
            raise DataError(
                f"--source '{spec}' is a folder: give a file or a glob such as '{spec}/*.parquet'"
            )
        files = [spec]
    for path in files:
        if not path.endswith(LOCAL_SUFFIXES):
            raise DataError(f"--source: '{path}' is not a .parquet, .jsonl or .txt file")
    return files


def open_local(spec: str, text_field: str = "text", hub: HubClient | None = None) -> OpenedSource:
    files = expand_local_files(spec)
    common = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in files])
    names = [os.path.relpath(os.path.abspath(p), common) for p in files]
    records = [
        {"name": name, "bytes": os.path.getsize(p), "sha256": sha256_of_file(p)}
        for name, p in zip(names, files)
    ]
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
            yield text_of_row(row, text_field, f"{path}:{line_number}")


def _read_parquet(path: str, text_field: str, group: int | None) -> Iterator[str | None]:
    """One row group (all of them for None) in batches, without pre-buffering: Arrow's default reads a whole
    file's column chunks ahead, so memory followed the file's size; here it follows one batch and its
    pages."""
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
        for batch in parquet.iter_batches(
            batch_size=PARQUET_BATCH_ROWS, row_groups=[index], columns=[text_field], use_threads=False
        ):
            try:
                texts = batch.column(0).to_pylist()
            except (UnicodeDecodeError, ValueError) as exc:  # a writer that did not validate UTF-8
                reason = (
                    exc.reason if isinstance(exc, UnicodeDecodeError) else " ".join(str(exc).split())[:120]
                )
                raise DataError(
                    f"{path}: column '{text_field}', row group {index}, rows "
                    f"{row}..{row + batch.num_rows - 1}: "
                    f"not valid UTF-8 text ({reason})"
                ) from None
            row += batch.num_rows
            yield from texts


def describe_local(identity: dict[str, Any]) -> str:
    files = identity.get("files") or []
    named = ", ".join(f"{f.get('name')} (sha256 {str(f.get('sha256'))[:12]})" for f in files[:3])
    return "local " + named + (f" and {len(files) - 3} more files" if len(files) > 3 else "")


# Last in the registry: any spec no other kind claims is a path or a glob, refused here when it names nothing.
LOCAL = SourceKind("local", "local .parquet/.jsonl/.txt files or a glob", claims=lambda spec: True,
                   open=open_local, requested=lambda spec, text_field: open_local(spec, text_field).identity,
                   describe=describe_local)
