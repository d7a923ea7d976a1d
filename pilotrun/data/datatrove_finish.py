"""The last step of `prepare --engine datatrove`: every task's folder merged into `--out`, or a refusal by
name.

A task is complete when its folder `tasks/NNNNN/` exists under its final name (written whole, then renamed)
and datatrove's completion mark `completions/NNNNN` is in the logs folder; anything less is refused, naming
each incomplete task and its log, and nothing is written. The merge is `pilotrun data merge`'s own
(merge.merge_parts: hard links, every shard reread against its task's manifest), with the manifest amended to
the whole input's identity (the files in source order with their sha256, as `pilotrun prepare` records them),
the engine, its version, the task count, the input order and how the order within a split arises.
"""

from __future__ import annotations

import os
from typing import Any

from pilotrun.common.errors import DataError
from pilotrun.data.merge import merge_parts
from pilotrun.data.prepare_state import REPLACED_SUFFIX, PartialFolder, _remove
from pilotrun.data.shards import METADATA_FILE
from pilotrun.data.stream import SPLITS

ENGINE = "datatrove"
TASKS_FOLDER = "tasks"
LAYOUT = (
    "each split is task 0's documents, then task 1's, ... (a task's documents in the order of its files "
    "and of the rows within each file, each followed by eos_id), cut into shards of at most shard_tokens "
    "per task"
)
ORDER_WITHIN_SPLIT = ("no document shuffle (pilotrun prepare's seeded buffer is not applied): the files are "
                      "permuted by the seed (engine.input_order) and dealt to the tasks, so a split's order "
                      "depends on the seed and the task count; the same documents land in each split as with "
                      "pilotrun prepare, in another order")


def task_folder(staging: str, rank: int) -> str:
    return os.path.join(staging, TASKS_FOLDER, f"{rank:05d}")


def completion_mark(logs: str, rank: int) -> str:
    return os.path.join(logs, "completions", f"{rank:05d}")


def task_log(logs: str, rank: int) -> str:
    return os.path.join(logs, "logs", f"task_{rank:05d}.log")


def incomplete_tasks(staging: str, logs: str, tasks: int) -> list[int]:
    return [
        rank
        for rank in range(tasks)
        if not (
            os.path.isfile(completion_mark(logs, rank))
            and os.path.isfile(os.path.join(task_folder(staging, rank), METADATA_FILE))
        )
    ]


def incomplete_line(logs: str, incomplete: list[int], tasks: int) -> str:
    named = []
    for rank in incomplete[:5]:
        log = task_log(logs, rank)
        named.append(
            f"task {rank} (log {log})" if os.path.isfile(log) else f"task {rank} (not started: no log)"
        )
    more = f" and {len(incomplete) - 5} more" if len(incomplete) > 5 else ""
    return f"{len(incomplete)} of {tasks} tasks have no complete output: {', '.join(named)}{more}"


def forget_marks_without_output(staging: str, logs: str, tasks: int) -> None:
    """A completion mark whose task folder is gone (the partial folder removed, the logs kept) would make
    datatrove skip a task whose output no longer exists: the mark is dropped so the task runs again."""
    for rank in range(tasks):
        mark = completion_mark(logs, rank)
        if os.path.isfile(mark) and not os.path.isdir(task_folder(staging, rank)):
            os.remove(mark)


def finish_prepare(out: str, force: bool = False) -> dict[str, Any]:
    """Merge the complete tasks of `out`'s partial folder into `out`; returns the manifest written."""
    out = os.path.normpath(out)
    partial = PartialFolder(out)
    if not os.path.isdir(partial.path):
        raise DataError(f"{partial.path} does not exist: no datatrove prepare of {out} to finish")
    recorded = partial.open()
    try:
        request = (recorded or {}).get("request") or {}
        if request.get("engine") != ENGINE:
            raise DataError(f"{partial.path} is not the folder of a `pilotrun prepare --engine datatrove`")
        tasks, logs = int(request["tasks"]), recorded["logs"]
        incomplete = incomplete_tasks(partial.path, logs, tasks)
        if incomplete:
            raise DataError(f"{incomplete_line(logs, incomplete, tasks)}: not merged; run the same "
                            "command again to redo them")
        replaced = _set_aside(out, force)
        parts = [task_folder(partial.path, rank) for rank in range(tasks)]
        try:
            manifest = merge_parts(out, parts, amend=lambda merged: amended(merged, request))
        except BaseException:
            if replaced is not None and not os.path.lexists(out):
                os.rename(replaced, out)
            raise
        if replaced is not None:
            _remove(replaced)
    finally:
        partial.close()
    partial.discard()
    return manifest


def _set_aside(out: str, force: bool) -> str | None:
    """An existing `out` (with --force) moved to `out.partial.replaced` for the swap (put back on failure, and
    by the next prepare after a kill: prepare_state.recover_replaced)."""
    if not os.path.lexists(out):
        return None
    if not force:
        raise DataError(f"{out} appeared while preparing: not replacing it without --force")
    replaced = out + REPLACED_SUFFIX
    _remove(replaced)
    os.rename(out, replaced)
    return replaced


def amended(merged: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The merged manifest as the whole input's: its files in source order (name, bytes, sha256), the
    engine."""
    records = {f["name"]: f for part in merged["merged_from"] for f in part["source"]["files"]}
    names = request["source"]["files"]
    if sorted(records) != sorted(names):
        raise DataError(f"the tasks read {len(records)} files, the input has {len(names)}: not merged")
    manifest = dict(merged)
    manifest["source"] = {"kind": "local", "text_field": request["source"]["text_field"],
                          "files": [{k: records[n][k] for k in ("name", "bytes", "sha256")} for n in names]}
    manifest["layout"] = LAYOUT
    manifest["software"] = request["software"]
    manifest["engine"] = {"name": ENGINE, "version": request["software"][ENGINE], "tasks": request["tasks"],
                          "input_order": request["order"], "order_within_split": ORDER_WITHIN_SPLIT}
    manifest["stream"] = {"empty_documents_skipped": sum(int(part["stream"]["empty_documents_skipped"])
                                                         for part in merged["merged_from"])}
    return manifest


def finished_line(out: str, manifest: dict[str, Any]) -> str:
    from pilotrun.data.shards import metadata_sha256

    splits = manifest["splits"]
    counts = ", ".join(
        f"{s} {splits[s]['tokens']} tokens in {splits[s]['documents']} documents" for s in SPLITS
    )
    return (f"prepared {out} with datatrove {manifest['engine']['version']} ({manifest['engine']['tasks']} "
            f"tasks): {counts}, vocab {manifest['tokenizer']['vocab_size']} ({manifest['dtype']}), "
            f"metadata_sha256 {metadata_sha256(manifest)}")
