"""pilotrun's steps inside a datatrove pipeline: the row adapter, the split rule, and the task's shard writer.

The pipeline of one task is datatrove's reader (JsonlReader / ParquetReader with `row_adapter`), then
`SplitByTextHash` (the split rule of `pilotrun prepare`, on the text alone), then `WriteTaskShards`, which
tokenizes with the data's tokenizer.json and writes the task's documents as a complete pilotrun data folder
of its own, `tasks/NNNNN/` of the partial folder: shards (sha256 and largest id recorded by ShardWriter),
tokenizer.json and a manifest naming the task, its files (with their sha256) and its counts. The folder is
written under a hidden name and renamed when whole, before datatrove marks the task complete, so a folder
under the final name is always whole; a task killed midway leaves only the hidden one, which its rerun
removes. `FinishPrepare` is the one-task pipeline of the merge (run after the tasks: by the command itself
with the local executor, as a SLURM job depending on the task array with the slurm one).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from pilotrun.common.errors import DataError
from pilotrun.common.files import fsync_directory
from pilotrun.common.strict_json import strict_dumps
from pilotrun.data.datatrove_finish import finish_prepare, task_folder
from pilotrun.data.datatrove_inputs import file_record
from pilotrun.data.prepare import _chunks
from pilotrun.data.shards import FORMAT, METADATA_FILE, TOKENIZER_FILE, ShardWriter, manifest_text
from pilotrun.data.stream import SPLITS, TRAIN, VAL, split_of
from pilotrun.data.tokenizer import encode_documents, plain_encoder

SPLIT_KEY = "pilotrun_split"
EMPTY = "empty"  # a blank document: counted and skipped, as `pilotrun prepare` skips it (it would be one EOS)


def row_adapter(reader: Any, data: dict, path: str, id_in_file: int | str) -> dict:
    """A row as a datatrove document, refusing what `pilotrun prepare` refuses (no text field, text that is
    not a string). An empty or missing text becomes one space rather than being dropped by the reader, so that
    every row reaches the writer, which counts the rows of each file against the file's own count."""
    if reader.text_key not in data:
        raise DataError(f"{path}: row {id_in_file}: no field '{reader.text_key}' (fields: "
                        f"{', '.join(sorted(map(str, data)))}); choose one with --text-field")
    text = data[reader.text_key]
    if text is not None and not isinstance(text, str):
        raise DataError(
            f"{path}: row {id_in_file}: field '{reader.text_key}' is {type(text).__name__}, not text"
        )
    return {"text": text or " ", "id": f"{path}#{id_in_file}", "metadata": {}}


class SplitByTextHash(PipelineStep):
    """pilotrun's split rule (stream.split_of: sha256 of the UTF-8 text against val_fraction) as a step."""

    name = "pilotrun split by text hash"
    type = "SPLIT"

    def __init__(self, val_fraction: float) -> None:
        super().__init__()
        self.val_fraction = float(val_fraction)

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        for document in data:
            text = document.text
            split = EMPTY if not text.strip() else split_of(text, self.val_fraction)
            document.metadata[SPLIT_KEY] = split
            self.stat_update(split)
            yield document


class WriteTaskShards(PipelineStep):
    """Tokenize a task's documents (EOS after each) and write them as the task's own data folder."""

    name = "pilotrun task shards"
    type = "WRITER"

    def __init__(self, staging: str, plan: dict[str, Any]) -> None:
        super().__init__()
        self.staging, self.plan = staging, plan

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        final = task_folder(self.staging, rank)
        temporary = os.path.join(os.path.dirname(final), f".{rank:05d}.tmp")
        for stale in (temporary, final):  # a killed attempt's, or one whose completion mark never came
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(temporary)
        rows, counts = self._write(temporary, data)
        files = self._file_records(rank, world_size, rows)
        self._write_manifest(temporary, rank, world_size, files, counts)
        fsync_directory(temporary)
        os.rename(temporary, final)
        fsync_directory(os.path.dirname(final))
        return iter(())

    def _write(self, folder: str, data: DocumentsPipeline) -> tuple[dict[str, int], dict[str, Any]]:
        plan = self.plan
        encoder = plain_encoder(_read(os.path.join(self.staging, TOKENIZER_FILE)))
        writers = {split: ShardWriter(folder, split, plan["shard_tokens"], plan["dtype"]) for split in SPLITS}
        documents, tokens, rows = dict.fromkeys((*SPLITS, EMPTY), 0), dict.fromkeys(SPLITS, 0), {}
        for texts, extras in _chunks(_texts_with_splits(data, rows)):
            kept = [index for index, split in enumerate(extras) if split != EMPTY]
            documents[EMPTY] += len(extras) - len(kept)
            if not kept:
                continue
            ids, lengths = encode_documents(encoder, [texts[i] for i in kept], plan["eos_id"], plan["dtype"])
            is_val = np.fromiter((extras[i] == VAL for i in kept), dtype=bool, count=len(kept))
            token_is_val = np.repeat(is_val, lengths)
            for split, mask in ((TRAIN, ~token_is_val), (VAL, token_is_val)):
                part = ids[mask]
                writers[split].add(part)
                tokens[split] += len(part)
            documents[VAL] += int(is_val.sum())
            documents[TRAIN] += int((~is_val).sum())
            self.stat_update("tokens", value=len(ids))
        shards = {split: writers[split].close() for split in SPLITS}
        return rows, {"documents": documents, "tokens": tokens, "shards": shards}

    def _file_records(self, rank: int, world_size: int, rows: dict[str, int]) -> list[dict[str, Any]]:
        """Each of the task's files hashed and its rows counted: a row the reader skipped (a line that is not
        JSON, a file cut short by a decoding error: datatrove logs these and goes on) is refused here, by
        file."""
        records = []
        folder, kind = self.plan["folder"], self.plan["kind"]
        for name in self.plan["ordered_names"][rank::world_size]:
            record = file_record(os.path.join(folder, name), name, kind)
            if rows.get(name, 0) != record["rows"]:
                raise DataError(
                    f"{os.path.join(folder, name)}: the reader gave {rows.get(name, 0)} of its "
                    f"{record['rows']} rows (the task log names the rows it skipped): not prepared"
                )
            records.append(record)
        return records

    def _write_manifest(self, folder: str, rank: int, world_size: int, files: list[dict[str, Any]],
                        counts: dict[str, Any]) -> None:
        plan = self.plan
        os.link(os.path.join(self.staging, TOKENIZER_FILE), os.path.join(folder, TOKENIZER_FILE))
        manifest = {
            "format": FORMAT,
            "source": {"kind": "datatrove-task", "task": rank, "tasks": world_size, "files": files,
                       "text_field": plan["text_field"]},
            "tokenizer": plan["tokenizer"], "dtype": plan["dtype"], "options": plan["options"],
            "split_rule": plan["split_rule"], "software": plan["software"],
            "layout": "the task's documents in its files' order, each followed by eos_id",
            "stream": {"empty_documents_skipped": counts["documents"][EMPTY]},
            "splits": {split: {"documents": counts["documents"][split], "tokens": counts["tokens"][split],
                               "shards": counts["shards"][split]} for split in SPLITS},
        }
        with open(os.path.join(folder, METADATA_FILE), "w", encoding="utf-8", newline="\n") as handle:
            handle.write(manifest_text(manifest))
            handle.flush()
            os.fsync(handle.fileno())


def _texts_with_splits(data: DocumentsPipeline, rows: dict[str, int]) -> Iterator[tuple[str, str]]:
    """(text, split) per document, counting the rows of each file (by its name relative to the input
    folder)."""
    document: Document
    for document in data:
        # row_adapter's id: the path as listed in the paths file, "#", row
        name = document.id.rsplit("#", 1)[0]
        rows[name] = rows.get(name, 0) + 1
        yield document.text, document.metadata[SPLIT_KEY]


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


class FinishPrepare(PipelineStep):
    """The merge as a one-task pipeline, for the SLURM job that runs once every task has succeeded."""

    name = "pilotrun merge"
    type = "MERGE"

    def __init__(self, out: str, force: bool) -> None:
        super().__init__()
        self.out, self.force = out, force

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        manifest = finish_prepare(self.out, self.force)
        print(strict_dumps({"prepared": self.out, "splits": {s: {k: manifest["splits"][s][k] for k in
                                                               ("documents", "tokens")} for s in SPLITS}}))
        return iter(())
