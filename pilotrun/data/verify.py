"""`pilotrun data verify`: everything the reader's startup check does, and a rehash of every byte.

Beyond the startup check (existence, dtype, shape, size, totals) it
- rehashes every shard and tokenizer.json against the manifest's sha256;
- reads every token once (in the same pass as the hash) and checks the manifest's claims about them: each
  split holds exactly `documents` EOS ids and ends with one (every document is followed by EOS, and document
  text never encodes to EOS), and no id reaches the vocabulary size;
- names any .npy file in the folder that the manifest does not list.
Every problem is reported (not just the first), each naming its file.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from pilotrun.common.errors import DataError
from pilotrun.common.files import sha256_of_file
from pilotrun.data.shards import METADATA_FILE, TOKENIZER_FILE, load_manifest, read_shard_header
from pilotrun.data.stream import SPLITS

READ_BLOCK_TOKENS = 1 << 22


def _scan_shard(path: str, dtype: np.dtype, eos_id: int) -> tuple[str, int, int, int | None]:
    """(sha256 of the file, EOS count, largest id, last id) in one sequential read."""
    header = read_shard_header(path)
    digest = hashlib.sha256()
    eos_count, largest, last = 0, -1, None
    with open(path, "rb") as handle:
        digest.update(handle.read(header.data_offset))
        leftover = b""
        for block in iter(lambda: handle.read(READ_BLOCK_TOKENS * dtype.itemsize), b""):
            digest.update(block)
            block = leftover + block
            usable = len(block) - len(block) % dtype.itemsize  # a truncated file may end mid-token
            leftover = block[usable:]
            tokens = np.frombuffer(block[:usable], dtype=dtype)
            if len(tokens):
                eos_count += int(np.count_nonzero(tokens == eos_id))
                largest = max(largest, int(tokens.max()))
                last = int(tokens[-1])
    return digest.hexdigest(), eos_count, largest, last


def verify_data(data_dir: str | os.PathLike) -> list[str]:
    """Problems found in a prepared data folder; an empty list means intact."""
    data_dir = os.fspath(data_dir)
    if not os.path.isdir(data_dir):
        raise DataError(f"data folder {data_dir} does not exist")
    try:
        manifest = load_manifest(data_dir)
    except DataError as exc:
        return [str(exc)]
    problems: list[str] = []
    tokenizer: dict[str, Any] = manifest["tokenizer"]
    dtype = np.dtype(manifest["dtype"])
    eos_id, vocab_size = int(tokenizer["eos_id"]), int(tokenizer["vocab_size"])

    tokenizer_path = os.path.join(data_dir, TOKENIZER_FILE)
    if not os.path.isfile(tokenizer_path):
        problems.append(f"{tokenizer_path}: missing")
    elif sha256_of_file(tokenizer_path) != tokenizer.get("sha256"):
        problems.append(f"{tokenizer_path}: sha256 differs from the manifest")

    listed = {METADATA_FILE, TOKENIZER_FILE}
    for split in SPLITS:
        record = manifest["splits"].get(split)
        if record is None:
            problems.append(f"{os.path.join(data_dir, METADATA_FILE)}: no '{split}' split")
            continue
        split_tokens, split_eos, split_last, split_ok = 0, 0, None, True
        for shard in record.get("shards", []):
            name = str(shard.get("file"))
            listed.add(name)
            path = os.path.join(data_dir, name)
            expected_tokens = int(shard.get("tokens", -1))
            split_tokens += expected_tokens
            if os.path.basename(name) != name:
                problems.append(f"{path}: not a plain file name inside the folder")
                split_ok = False
                continue
            if not os.path.isfile(path):
                problems.append(f"{path}: missing")
                split_ok = False
                continue
            try:
                header = read_shard_header(path)
            except DataError as exc:
                problems.append(str(exc))
                split_ok = False
                continue
            if header.dtype != dtype:
                problems.append(f"{path}: dtype {header.dtype}, the manifest says {dtype}")
                split_ok = False
            if header.shape != (expected_tokens,):
                problems.append(f"{path}: shape {header.shape}, the manifest says ({expected_tokens},)")
                split_ok = False
            if header.file_bytes != header.expected_bytes:
                problems.append(
                    f"{path}: {header.file_bytes} bytes, its header implies {header.expected_bytes} "
                    "(truncated or extended)"
                )
                split_ok = False
            sha, eos_count, largest, last = _scan_shard(path, header.dtype, eos_id)
            if sha != shard.get("sha256"):
                problems.append(f"{path}: sha256 differs from the manifest (content changed)")
                split_ok = False
            recorded = shard.get("max_token_id")
            if recorded is not None and sha == shard.get("sha256") and recorded != largest:
                problems.append(f"{path}: largest id {largest}, the manifest records max_token_id {recorded}")
            if largest >= vocab_size:
                problems.append(f"{path}: holds token id {largest}, outside the vocabulary of {vocab_size}")
            split_eos += eos_count
            split_last = last if last is not None else split_last
        if split_tokens != int(record.get("tokens", -1)):
            problems.append(
                f"{os.path.join(data_dir, METADATA_FILE)}: {split} shards list {split_tokens} tokens, "
                f"the split total says {record.get('tokens')}"
            )
        # content claims are only meaningful when every shard of the split is readable and intact
        if split_ok:
            documents = int(record.get("documents", -1))
            if split_eos != documents:
                problems.append(f"{data_dir}: the {split} split holds {split_eos} EOS ids ({eos_id}) but "
                                f"{documents} documents")
            if split_tokens > 0 and split_last != eos_id:
                problems.append(f"{data_dir}: the {split} split does not end with EOS")

    for name in sorted(os.listdir(data_dir)):
        if name.endswith(".npy") and name not in listed:
            problems.append(f"{os.path.join(data_dir, name)}: a shard the manifest does not list")
    return problems


def report_verification(data_dir: str) -> int:
    """`pilotrun data verify`: each problem on its own line and exit 1, or one line saying intact and exit
    0."""
    from pilotrun.data.shards import metadata_sha256

    problems = verify_data(data_dir)
    for problem in problems:
        print(f"damaged: {problem}")
    if problems:
        print(f"{data_dir}: {len(problems)} problem(s)")
        return 1
    manifest = load_manifest(data_dir)
    shards = sum(len(manifest["splits"][s]["shards"]) for s in manifest["splits"])
    print(f"intact: {data_dir} ({shards} shards rehashed, metadata_sha256 {metadata_sha256(manifest)})")
    return 0
