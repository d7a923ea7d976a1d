"""Durable file primitives shared by every writer: data manifests, run records, checkpoints, reports.

One place for the things crash safety and identity rest on: a file's sha256 (how damage is found), the one
canonical JSON of the project (what every identity hash is taken over: a data manifest's metadata_sha256,
run.json's digests, a frozen lock's sha256, the recipe all ranks compare), an atomic text write (temp file,
fsync, rename: a crash leaves the old file or the new one, never half of either), and an fsync of a folder
(so that a rename inside it survives a power loss).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

HASH_CHUNK_BYTES = 8 << 20


def sha256_of_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8 (not ASCII escapes), and no NaN or infinity (JSON has none; an identity
    that held one could not be recomputed by another reader): the same value always gives the same bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def canonical_sha256(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def fsync_directory(path: str | Path) -> None:
    """Make a rename or a new file inside `path` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening a folder; the rename itself is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Temp file in the same folder, fsync, rename over the target, fsync the folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)
