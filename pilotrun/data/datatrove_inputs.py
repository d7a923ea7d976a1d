"""What `prepare --engine datatrove` reads: local .parquet or .jsonl files, checked before any task starts.

datatrove's readers shard the input by file: task r of T reads files r, r + T, r + 2T ... of the list it is
given (`paths_file`). pilotrun writes that list in a seeded order of the files (the same rule as the reading
units of `pilotrun prepare`, with files as the units), so that a split's documents are not the corpus in file
order, and records it in the manifest. Everything a refusal needs is looked at here, in the command's own
process: the files exist, are regular, of one kind, and hold the text field (a parquet file's schema from
its footer, a jsonl file's first row). What needs a full read (each file's sha256, its row count) is done by
the task that reads the file, so a trillion-token input is not read once in one process before the tasks
start.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from pilotrun.common.errors import DataError
from pilotrun.common.files import canonical_sha256
from pilotrun.data.opened_source import unit_order
from pilotrun.data.source_local import expand_local_files

KINDS = {".parquet": "parquet", ".jsonl": "jsonl"}
ORDER_RULE = ("files in the order random.Random('pilotrun-unit-order/' + str(seed)).shuffle(files in source "
              "order); datatrove's paths_file sharding gives file k of that order to task k % tasks")
READ_BYTES = 8 << 20


@dataclass(frozen=True)
class DatatroveInputs:
    folder: str  # the files' common folder: datatrove's data_folder
    names: list[str]  # relative to `folder`, in source order (sorted, as `pilotrun prepare` lists them)
    kind: str  # "parquet" or "jsonl"
    text_field: str
    has_id: bool  # every parquet file has an `id` column: read only it and the text (else all columns)
    order: list[int]  # indices into `names`, the order written to the paths file

    def ordered_names(self) -> list[str]:
        return [self.names[i] for i in self.order]

    def task_names(self, rank: int, tasks: int) -> list[str]:
        """The files task `rank` reads, as datatrove's paths_file sharding gives them."""
        return self.ordered_names()[rank::tasks]

    def identity(self) -> dict[str, Any]:
        """What the request records of the input before any file is hashed (the manifest adds the hashes)."""
        return {
            "kind": "local",
            "format": self.kind,
            "files": list(self.names),
            "text_field": self.text_field,
            "bytes": [os.path.getsize(os.path.join(self.folder, n)) for n in self.names],
        }

    def order_record(self, tasks: int) -> dict[str, Any]:
        ordered = self.ordered_names()
        return {"rule": ORDER_RULE, "files": len(ordered), "order_sha256": canonical_sha256(ordered),
                "first_files": ordered[:8], "tasks": tasks}


def resolve_inputs(spec: str, text_field: str, seed: int) -> DatatroveInputs:
    spec = str(spec).strip()
    if spec == "builtin" or spec.startswith("fineweb-edu"):
        raise DataError(
            f"--engine datatrove reads local .parquet or .jsonl files, not '{spec}': download the "
            "dataset's parquet files first (FineWeb-Edu: `hf download HuggingFaceFW/fineweb-edu "
            "--repo-type dataset --include 'sample/10BT/*'`) and pass a glob, or use --engine pilotrun"
        )
    files = expand_local_files(spec)
    kinds = {KINDS.get(os.path.splitext(path)[1]) for path in files}
    if None in kinds:
        odd = next(p for p in files if os.path.splitext(p)[1] not in KINDS)
        raise DataError(
            f"--engine datatrove: '{odd}' is not a .parquet or .jsonl file (datatrove has no reader "
            "for one-document .txt files: use --engine pilotrun)"
        )
    if len(kinds) > 1:
        raise DataError(
            f"--engine datatrove reads one kind of file per run, '{spec}' matches both .parquet and "
            ".jsonl files: prepare each kind apart and `pilotrun data merge` them"
        )
    kind = kinds.pop()
    folder = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in files])
    names = [os.path.relpath(os.path.abspath(p), folder) for p in files]
    has_id = True
    for path in files:
        columns = _parquet_columns(path) if kind == "parquet" else _first_jsonl_fields(path)
        if columns is not None and text_field not in columns:
            raise DataError(f"{path}: no {'column' if kind == 'parquet' else 'field'} '{text_field}' "
                            f"({'columns' if kind == 'parquet' else 'fields'}: {', '.join(columns)}); "
                            "choose one with --text-field")
        has_id = has_id and kind == "parquet" and "id" in (columns or ())
    return DatatroveInputs(folder, names, kind, text_field, has_id, unit_order(len(names), seed))


def _parquet_columns(path: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a damaged footer
        raise DataError(f"{path}: not a readable parquet file ({' '.join(str(exc).split())[:160]})") from None
    return list(schema.names) if isinstance(schema, pa.Schema) else []


def _first_jsonl_fields(path: str) -> list[str] | None:
    """The first non-blank row's fields (None for a file with no row: nothing to refuse)."""
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise DataError(f"{path}:{number}: not valid JSON text ({exc})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{number}: expected an object, got {type(row).__name__}")
            return sorted(map(str, row))
    return None


def file_record(path: str, name: str, kind: str) -> dict[str, Any]:
    """A file as the manifest names it (as `pilotrun prepare` does: name, bytes, sha256) and the rows a reader
    must give (a jsonl's non-blank lines, counted in the same pass as the hash; a parquet's footer count)."""
    digest, size, rows, blank = hashlib.sha256(), 0, 0, True
    with open(path, "rb") as handle:
        while chunk := handle.read(READ_BYTES):
            digest.update(chunk)
            size += len(chunk)
            if kind == "jsonl":
                rows, blank = _count_lines(chunk, rows, blank)
    if kind == "jsonl":
        rows += not blank
    else:
        import pyarrow.parquet as pq

        rows = int(pq.ParquetFile(path).metadata.num_rows)
    return {"name": name, "bytes": size, "sha256": digest.hexdigest(), "rows": rows}


def _count_lines(chunk: bytes, rows: int, blank: bool) -> tuple[int, bool]:
    """Non-blank lines so far; `blank` says whether the line in progress has only whitespace yet."""
    pieces = chunk.split(b"\n")
    for index, piece in enumerate(pieces):
        blank = blank and not piece.strip()
        if index < len(pieces) - 1:  # a newline ends this line
            rows += not blank
            blank = True
    return rows, blank
