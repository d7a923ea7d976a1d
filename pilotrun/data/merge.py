"""`pilotrun data merge`: one data folder from folders prepared separately (one per source glob, file range or
node), so that a corpus too large for one prepare is still one identified, verifiable data folder.

What the parts must share, or the merge is refused (DataError, nothing written): tokenizer.json's bytes
(sha256), hence vocabulary, dtype and EOS; and the options (`--val-fraction` above all: the split rule is a
function of the text and val_fraction, so with one fraction identical texts share a split across parts too,
and with two it would not be one rule). What stays per part: the shuffle and its seed (the merged stream is
each part's stream in turn, never interleaved), a `--train-tokens` cap, and the count of documents in each.

Each split of the merged folder is the parts' splits concatenated in the order the parts are given.
Concatenated, not interleaved by shard: a shard may end inside a document (prepare cuts the token stream
anywhere), so only a part's own shards in their own order keep every document whole and followed by its EOS.
Shards are renamed into one sequence (`train_00000.npy` ...), each entry recording the part and file it came
from, so that names cannot clash; each is hard-linked (same file system; `copy=True` or another file system:
copied) and then read once from the merged folder, checked against its part's manifest (sha256, header,
largest id) and counted (EOS ids = documents, ends with EOS), so a damaged part is refused and the result
passes `pilotrun data verify`.

The merged manifest has no paths: the parts are recorded by identity (metadata_sha256, source, stream,
counts), so the same parts merged in the same order give the same `metadata_sha256` wherever they lie. It is
built as a hidden temporary folder beside `out` and renamed into place when complete; a refusal or failure
leaves nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from pilotrun.common.errors import DataError
from pilotrun.common.files import fsync_directory, sha256_of_file
from pilotrun.data.shards import (
    FORMAT,
    METADATA_FILE,
    TOKENIZER_FILE,
    check_shard,
    load_manifest,
    manifest_text,
    metadata_sha256,
    shard_name,
)
from pilotrun.data.stream import SPLITS
from pilotrun.data.verify import _scan_shard

LAYOUT = (
    "each split is the parts' same split concatenated in the order of merged_from (each part's shards in "
    "their own order, so every document stays whole), shards renamed into one sequence"
)
# Must agree across parts, with the name a refusal uses for each.
SHARED_TOKENIZER_FIELDS = (("sha256", "tokenizer (sha256 of tokenizer.json)"), ("vocab_size", "vocab_size"),
                           ("eos_id", "EOS id"), ("eos_token", "EOS token"))


def _differ(what: str, parts: list[str], values: list[Any]) -> None:
    first = values[0]
    for part, value in zip(parts[1:], values[1:]):
        if value != first:
            raise DataError(
                f"parts differ in {what}: {parts[0]} has {first!r}, {part} has {value!r}: not merged"
            )


def _load_parts(parts: list[str]) -> list[dict[str, Any]]:
    manifests, seen = [], {}
    for part in parts:
        if not os.path.isdir(part):
            raise DataError(f"part {part} is not a data folder")
        manifest = load_manifest(part)
        identity = metadata_sha256(manifest)
        if identity in seen:
            raise DataError(
                f"parts {seen[identity]} and {part} are the same data (metadata_sha256 {identity}): "
                "each would be read twice"
            )
        seen[identity] = part
        unknown = sorted(set(manifest["splits"]) - set(SPLITS))
        if unknown:
            raise DataError(f"part {part} has splits {unknown} besides {list(SPLITS)}: not merged")
        tokenizer_path = os.path.join(part, TOKENIZER_FILE)
        if not os.path.isfile(tokenizer_path) or sha256_of_file(tokenizer_path) != manifest["tokenizer"].get(
            "sha256"
        ):
            raise DataError(
                f"{tokenizer_path} is missing or not the tokenizer its manifest names: not merged"
            )
        manifests.append(manifest)
    return manifests


def _check_compatible(parts: list[str], manifests: list[dict[str, Any]]) -> None:
    for field, what in SHARED_TOKENIZER_FIELDS:
        _differ(what, parts, [m["tokenizer"].get(field) for m in manifests])
    _differ("dtype", parts, [m["dtype"] for m in manifests])
    _differ("split_rule", parts, [m.get("split_rule") for m in manifests])
    keys = sorted({key for m in manifests for key in (m.get("options") or {})})
    for key in keys:
        _differ(f"options.{key}", parts, [(m.get("options") or {}).get(key) for m in manifests])


def _place(source: str, target: str, copy: bool) -> str:
    """Hard-link (or copy) `source` to `target`; returns which was done."""
    if not copy:
        try:
            os.link(source, target)
            return "hard-linked"
        except OSError:
            pass  # another file system, or links not allowed there: a copy is the same bytes
    shutil.copyfile(source, target)
    with open(target, "rb+") as handle:
        os.fsync(handle.fileno())
    return "copied"


def _merge_split(split: str, parts: list[str], manifests: list[dict[str, Any]], folder: str, copy: bool,
                 eos_id: int, dtype: str, placed: dict[str, int]) -> dict[str, Any]:
    shards, documents, tokens = [], 0, 0
    for index, (part, manifest) in enumerate(zip(parts, manifests)):
        record = manifest["splits"].get(split, {"documents": 0, "tokens": 0, "shards": []})
        eos_count, last, part_tokens = 0, None, 0
        for shard in record["shards"]:
            name = shard["file"]
            if os.path.basename(name) != name:
                raise DataError(f"part {part}: shard {name!r} is not a plain file name inside the folder")
            target_name = shard_name(split, len(shards))
            target = os.path.join(folder, target_name)
            how = _place(os.path.join(part, name), target, copy)
            placed[how] = placed.get(how, 0) + 1
            header = check_shard(target, dtype, shard["tokens"])
            sha, shard_eos, largest, shard_last = _scan_shard(target, header.dtype, eos_id)
            where = f"part {part}: shard {name}"
            if sha != shard["sha256"]:
                raise DataError(f"{where}: sha256 differs from its manifest (damaged): not merged")
            if shard.get("max_token_id") not in (None, largest):
                raise DataError(
                    f"{where}: largest id {largest}, its manifest records {shard['max_token_id']}"
                )
            eos_count += shard_eos
            last = shard_last if shard_last is not None else last
            part_tokens += shard["tokens"]
            shards.append(
                {
                    "file": target_name,
                    "tokens": shard["tokens"],
                    "sha256": sha,
                    "max_token_id": largest,
                    "part": index,
                    "part_file": name,
                }
            )
        if (
            part_tokens != record["tokens"]
            or eos_count != record["documents"]
            or (part_tokens and last != eos_id)
        ):
            raise DataError(
                f"part {part}: its {split} shards hold {part_tokens} tokens and {eos_count} EOS ids, "
                f"its manifest says {record['tokens']} tokens in {record['documents']} documents "
                f"(or the split does not end with EOS): run `pilotrun data verify {part}`"
            )
        documents += record["documents"]
        tokens += record["tokens"]
    return {"documents": documents, "tokens": tokens, "shards": shards}


def _check_out(out: str, parts: list[str]) -> str:
    if os.path.lexists(out):
        raise DataError(f"--out {out} already exists: choose another folder (merge never replaces one)")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise DataError(f"--out {out}: its parent folder {parent} does not exist")
    real_out = os.path.join(os.path.realpath(parent), os.path.basename(out))
    for part in parts:
        real_part = os.path.realpath(part)
        if os.path.commonpath([real_out, real_part]) == real_part:
            raise DataError(f"--out {out} lies inside part {part}: choose a folder outside every part")
    return parent


def merge_data(out: str | os.PathLike, parts: list[str | os.PathLike], copy: bool = False,
               placed: dict[str, int] | None = None) -> dict[str, Any]:
    """Merge the data folders `parts` (in reading order) into the new folder `out`; returns its manifest.
    `placed` (optional) receives how many shards were hard-linked and how many copied."""
    if len(parts) < 2:
        raise DataError("data merge needs at least two parts")
    return merge_parts(out, parts, copy, placed)


def merge_parts(out: str | os.PathLike, parts: list[str | os.PathLike], copy: bool = False,
                placed: dict[str, int] | None = None,
                amend: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """`merge_data` for an engine that writes its output as parts (one or more): `amend` turns the merged
    manifest into the one written (an engine's own source, layout and record), before the folder is renamed
    into place, so the folder is never seen with a manifest other than its final one."""
    out = os.path.normpath(os.fspath(out))
    parts = [os.path.normpath(os.fspath(p)) for p in parts]
    if not parts:
        raise DataError("nothing to merge: no parts")
    parent = _check_out(out, parts)
    manifests = _load_parts(parts)
    _check_compatible(parts, manifests)
    first = manifests[0]
    placed = {} if placed is None else placed
    # mkdtemp: a fresh real folder (never an existing path or a symbolic link) that only this process writes.
    folder = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.merge-", dir=parent)
    try:
        splits = {
            split: _merge_split(
                split,
                parts,
                manifests,
                folder,
                copy,
                int(first["tokenizer"]["eos_id"]),
                first["dtype"],
                placed,
            )
            for split in SPLITS
        }
        if splits["train"]["tokens"] == 0:
            raise DataError("the parts hold no training tokens: not merged")
        manifest = {
            "format": FORMAT,
            "source": {"kind": "merge", "parts": [m.get("source") for m in manifests]},
            "tokenizer": first["tokenizer"],
            "dtype": first["dtype"],
            "options": first.get("options"),
            "split_rule": first.get("split_rule"),
            "layout": LAYOUT,
            "merged_from": [{"metadata_sha256": metadata_sha256(m), "source": m.get("source"),
                             "stream": m.get("stream"), "software": m.get("software"),
                             "splits": {s: {"documents": m["splits"].get(s, {}).get("documents", 0),
                                            "tokens": m["splits"].get(s, {}).get("tokens", 0),
                                            "shards": len(m["splits"].get(s, {}).get("shards", []))}
                                        for s in SPLITS}} for m in manifests],
            "splits": splits,
        }
        if amend is not None:
            manifest = amend(manifest)
        _place(os.path.join(parts[0], TOKENIZER_FILE), os.path.join(folder, TOKENIZER_FILE), copy=True)
        with open(os.path.join(folder, METADATA_FILE), "w", encoding="utf-8", newline="\n") as handle:
            handle.write(manifest_text(manifest))
            handle.flush()
            os.fsync(handle.fileno())
        # mkdtemp makes it 0700; a data folder is as readable as prepare's
        os.chmod(folder, 0o777 & ~_umask())
        fsync_directory(folder)
        if os.path.lexists(out):  # appeared while merging: never replace it
            raise DataError(f"--out {out} appeared while merging: not replaced")
        os.rename(folder, out)
        fsync_directory(parent)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return manifest


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def merged_line(out: str, manifest: dict[str, Any], placed: dict[str, int]) -> str:
    """What `pilotrun data merge` prints: the totals, how the shards were placed, the merged identity."""
    splits = manifest["splits"]
    how = ", ".join(f"{count} {kind}" for kind, count in sorted(placed.items())) or "no shards"
    return (
        f"merged {len(manifest['merged_from'])} parts into {out}: train {splits['train']['tokens']} tokens "
        "in "
        f"{splits['train']['documents']} documents, val {splits['val']['tokens']} tokens in "
        f"{splits['val']['documents']} documents ({how}, each rehashed), metadata_sha256 "
        f"{metadata_sha256(manifest)}"
    )
