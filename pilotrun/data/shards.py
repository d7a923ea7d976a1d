"""Shard files and the manifest's canonical form: what both the writer (prepare) and the readers rely on.

A shard is a 1-D `.npy` array (format version 1.0, C order) of `uint16` or `uint32` token ids. The writer
fills one in-memory shard of at most `shard_tokens` ids (bounded memory), writes it in one go and hashes the
exact bytes it wrote, so the manifest's sha256 is of the file as it lies on disk.

For an interruptible prepare the writer can `persist()` its unfinished shard: the tokens added since the last
call are appended to `<split>_<index>.pending` and fsynced (only the new ones: a split's pending file is
written once over, not at every checkpoint), and `restore()` takes a writer back to a recorded state: the
completed shards and that many pending tokens (the file is cut back to them, so tokens added after the
checkpoint, by a process that was then killed, are dropped). A pending file is obsolete once its shard is
complete; the caller deletes it (`take_obsolete`) only after recording the new state, so a crash always finds
the state it recorded.

`metadata_sha256` is the sha256 of the canonical JSON (sorted keys, no whitespace, UTF-8): it identifies the
data regardless of the folder it sits in or how metadata.json happens to be formatted.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from pilotrun.common.errors import DataError
from pilotrun.common.files import canonical_sha256, not_regular
from pilotrun.common.parsing import read_json_file

METADATA_FILE = "metadata.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = "pilotrun-data/1"
SHARD_DTYPES = ("uint16", "uint32")


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.npy"


def pending_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.pending"


def metadata_sha256(manifest: dict[str, Any]) -> str:
    return canonical_sha256(manifest)


def manifest_text(manifest: dict[str, Any]) -> str:
    """The human-readable form written to metadata.json (deterministic, so the file is byte-identical too)."""
    return json.dumps(manifest, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


class _HashingFile:
    """A write-only file wrapper that hashes every byte on its way to disk."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self.handle.write(data)


class ShardWriter:
    """Appends token arrays for one split and cuts them into shards of exactly `shard_tokens` (last:
    fewer)."""

    def __init__(self, folder: str, split: str, shard_tokens: int, dtype: str) -> None:
        self.folder, self.split, self.shard_tokens, self.dtype = folder, split, int(shard_tokens), dtype
        self.buffer = np.empty(self.shard_tokens, dtype=dtype)
        self.filled = 0
        self.shards: list[dict[str, Any]] = []
        self.total_tokens = 0
        self.persisted = 0  # tokens of the unfinished shard already in its pending file
        self.pending_digest = hashlib.sha256()  # of those tokens' bytes, updated as they are appended
        self.obsolete: list[str] = []

    def add(self, tokens: np.ndarray) -> None:
        position = 0
        while position < len(tokens):
            take = min(len(tokens) - position, self.shard_tokens - self.filled)
            self.buffer[self.filled:self.filled + take] = tokens[position:position + take]
            self.filled += take
            position += take
            if self.filled == self.shard_tokens:
                self._flush()

    def _flush(self) -> None:
        if self.filled == 0:
            return
        name = shard_name(self.split, len(self.shards))
        with open(os.path.join(self.folder, name), "wb") as handle:
            hashing = _HashingFile(handle)
            np.lib.format.write_array(hashing, self.buffer[:self.filled], version=(1, 0), allow_pickle=False)
            handle.flush()
            os.fsync(handle.fileno())
        # The largest id, so that a trainer can refuse data beyond its model's vocabulary before it starts.
        max_token_id = int(self.buffer[:self.filled].max())
        self.shards.append({"file": name, "tokens": int(self.filled), "sha256": hashing.digest.hexdigest(),
                            "max_token_id": max_token_id})
        self.total_tokens += self.filled
        self.filled = 0
        pending = os.path.join(self.folder, pending_name(self.split, len(self.shards) - 1))
        if self.persisted or os.path.exists(pending):
            self.obsolete.append(pending)
        self.persisted = 0
        self.pending_digest = hashlib.sha256()

    def close(self) -> list[dict[str, Any]]:
        self._flush()
        self.buffer = np.empty(0, dtype=self.dtype)
        return self.shards

    def persist(self) -> dict[str, Any]:
        """Append the unfinished shard's new tokens to its pending file and fsync it; returns the state that
        `restore` takes back: the completed shards and the pending token count."""
        if self.filled > self.persisted:
            new = self.buffer[self.persisted:self.filled].tobytes()
            with open(os.path.join(self.folder, pending_name(self.split, len(self.shards))), "ab") as handle:
                handle.write(new)
                handle.flush()
                os.fsync(handle.fileno())
            self.pending_digest.update(new)
            self.persisted = self.filled
        return {"shards": [dict(s) for s in self.shards], "pending_tokens": int(self.filled)}

    def persist_checked(self) -> dict[str, Any]:
        """`persist`'s state with the pending tokens' sha256, which `restore` checks: a byte flipped in the
        pending file would otherwise pass into a shard (the manifest then hashes the damaged shard as written,
        and `data verify` could not tell)."""
        return {**self.persist(), "pending_sha256": self.pending_digest.hexdigest()}

    def take_obsolete(self) -> list[str]:
        files, self.obsolete = self.obsolete, []
        return files

    def restore(self, state: dict[str, Any]) -> None:
        """Back to a state `persist` returned (the shard files themselves are checked by the caller)."""
        self.shards = [dict(s) for s in state["shards"]]
        self.total_tokens = sum(int(s["tokens"]) for s in self.shards)
        count = int(state["pending_tokens"])
        path = os.path.join(self.folder, pending_name(self.split, len(self.shards)))
        self.filled = self.persisted = 0
        self.pending_digest = hashlib.sha256()
        if count == 0:
            if os.path.exists(path):
                os.remove(path)
            return
        itemsize = np.dtype(self.dtype).itemsize
        if not os.path.isfile(path) or os.path.getsize(path) < count * itemsize:
            raise DataError(f"{path}: holds fewer than the {count} pending tokens the progress file records")
        with open(path, "r+b") as handle:
            handle.truncate(count * itemsize)
        self.buffer[:count] = np.fromfile(path, dtype=self.dtype, count=count)
        digest = hashlib.sha256(self.buffer[:count].tobytes())
        recorded = state.get("pending_sha256")  # absent in a progress file written before it was kept
        if recorded is not None and digest.hexdigest() != recorded:
            raise DataError(
                f"{path}: its {count} pending tokens are not the ones the progress file recorded "
                "(sha256 differs): the interrupted prepare's tail is damaged; remove the .partial "
                "folder to prepare again"
            )
        self.pending_digest = digest
        self.filled = self.persisted = count


@dataclass(frozen=True)
class ShardHeader:
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    data_offset: int
    file_bytes: int

    @property
    def expected_bytes(self) -> int:
        count = int(np.prod(self.shape)) if self.shape else 1
        return self.data_offset + count * self.dtype.itemsize


def read_shard_header(path: str) -> ShardHeader:
    """Parse a .npy header without loading the data; DataError names the file on anything unexpected."""
    odd = not_regular(path)
    if odd is not None:
        raise DataError(f"shard {path} is {odd}")
    try:
        file_bytes = os.path.getsize(path)
        with open(path, "rb") as handle:
            version = np.lib.format.read_magic(handle)
            if version == (1, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(handle)
            elif version == (2, 0):
                shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(handle)
            else:
                raise ValueError(f"unsupported .npy version {version}")
            data_offset = handle.tell()
    except FileNotFoundError:
        raise DataError(f"shard {path} is missing") from None
    except (ValueError, OSError, SyntaxError) as exc:
        raise DataError(f"shard {path} is not a readable .npy file ({exc})") from None
    return ShardHeader(np.dtype(dtype), tuple(shape), bool(fortran_order), data_offset, file_bytes)


def check_shard(path: str, expected_dtype: str, expected_tokens: int) -> ShardHeader:
    """The startup check of one shard: header dtype and shape against the manifest, and the file's size."""
    header = read_shard_header(path)
    if header.dtype != np.dtype(expected_dtype):
        raise DataError(f"shard {path} has dtype {header.dtype}, the manifest says {expected_dtype}")
    if header.shape != (expected_tokens,):
        raise DataError(f"shard {path} has shape {header.shape}, the manifest says ({expected_tokens},)")
    if header.file_bytes != header.expected_bytes:
        state = "truncated" if header.file_bytes < header.expected_bytes else "longer than its header says"
        raise DataError(
            f"shard {path} is {state}: {header.file_bytes} bytes, expected {header.expected_bytes}"
        )
    return header


def load_manifest(data_dir: str) -> dict[str, Any]:
    if not os.path.isdir(data_dir):
        raise DataError(f"data folder {data_dir} does not exist (make one with `pilotrun prepare`)")
    path = os.path.join(data_dir, METADATA_FILE)
    if not os.path.lexists(path):
        raise DataError(f"{path} is missing: {data_dir} is not a finished `pilotrun prepare` folder")
    # The bounded reader: a manifest nested 200,000 deep, not UTF-8 or huge is one line, never a traceback.
    manifest = read_json_file(path, path, DataError)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a pilotrun data manifest (expected format '{FORMAT}')")
    check_manifest_fields(manifest, path)
    return manifest


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def check_manifest_fields(manifest: dict[str, Any], path: str) -> None:
    """Every field a reader relies on, with its type, so that a damaged or hand-edited manifest is one
    DataError naming the field instead of a KeyError or TypeError deep inside a reader."""
    for key in ("splits", "tokenizer", "dtype"):
        if key not in manifest:
            raise DataError(f"{path}: the manifest lacks '{key}'")
    if manifest["dtype"] not in SHARD_DTYPES:
        raise DataError(
            f"{path}: unsupported token dtype {manifest['dtype']!r} (expected one of {SHARD_DTYPES})"
        )
    tokenizer = manifest["tokenizer"]
    if not isinstance(tokenizer, dict):
        raise DataError(f"{path}: 'tokenizer' must be an object, got {type(tokenizer).__name__}")
    for key in ("vocab_size", "eos_id"):
        if not _is_count(tokenizer.get(key)):
            raise DataError(
                f"{path}: tokenizer.{key} must be a whole number >= 0, got {tokenizer.get(key)!r}"
            )
    if not 0 <= tokenizer["eos_id"] < tokenizer["vocab_size"]:
        raise DataError(f"{path}: tokenizer.eos_id {tokenizer['eos_id']} is outside the vocabulary of "
                        f"{tokenizer['vocab_size']}")
    splits = manifest["splits"]
    if not isinstance(splits, dict):
        raise DataError(f"{path}: 'splits' must be an object, got {type(splits).__name__}")
    for name, record in splits.items():
        where = f"{path}: splits.{name}"
        if not isinstance(record, dict):
            raise DataError(f"{where} must be an object, got {type(record).__name__}")
        for key in ("tokens", "documents"):
            if not _is_count(record.get(key)):
                raise DataError(f"{where}.{key} must be a whole number >= 0, got {record.get(key)!r}")
        if not isinstance(record.get("shards"), list):
            raise DataError(f"{where}.shards must be a list")
        for index, shard in enumerate(record["shards"]):
            if not (isinstance(shard, dict) and isinstance(shard.get("file"), str)
                    and isinstance(shard.get("sha256"), str) and _is_count(shard.get("tokens"))):
                raise DataError(f"{where}.shards[{index}] needs a file name, a sha256 and a token count")
            if "max_token_id" in shard and not _is_count(shard["max_token_id"]):
                raise DataError(f"{where}.shards[{index}].max_token_id must be a whole number >= 0")
