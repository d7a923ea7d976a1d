"""The single-file storage: a state dict written with torch.save, one file per part (model, optimizer, ...),
large parts split into shards written in parallel, each file hashed as it is written.

It is one storage behind the checkpointer's interface (checkpointer.CheckpointStorage): write returns every
file's sha256 and size for the marker, read loads them back with `weights_only=True`. The policy (which steps
exist, the commit marker, pruning) is checkpointer.py's; this file never decides anything about a checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from pilotrun.common.errors import CheckpointError
from pilotrun.common.files import fsync_directory, open_for_write


class _HashingWriter:
    """A file wrapper that hashes bytes as they are written, so the sha256 costs no second read.

    Each chunk is hashed in a helper thread while this thread writes the same chunk to the file (hashlib and
    file writes both release the GIL, so on a machine where sha256 is about as slow as the disk the two
    overlap instead of adding up), and `write` returns only when both are done: torch.save may hand out a
    memoryview of a temporary buffer (a CUDA tensor's CPU copy) that is freed once `write` returns.
    torch.save's zip writer writes strictly sequentially (the tests compare the hash with a reread).
    """

    OVERLAP_ABOVE_BYTES = 1 << 20  # below this, handing a chunk to the thread costs more than hashing it here

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.bytes_written = 0
        self._digest = hashlib.sha256()
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._hash_loop, daemon=True)
        self._thread.start()

    def _hash_loop(self) -> None:
        while (chunk := self._todo.get()) is not None:
            try:
                self._digest.update(chunk)
            finally:
                self._done.put(None)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes < self.OVERLAP_ABOVE_BYTES:
            self._digest.update(view)
            self.handle.write(view)
        else:
            self._todo.put(view)
            try:
                self.handle.write(view)
            finally:
                self._done.get()  # the hash has consumed the chunk before the caller may free it
        self.bytes_written += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self.handle.flush()

    def hexdigest(self) -> str:
        self._todo.put(None)
        self._thread.join()
        return self._digest.hexdigest()


@contextlib.contextmanager
def _zip_crc32_disabled():
    """torch.save's per-record CRC32 costs about as much as the disk write itself (measured in
    benchmarks/bench_checkpoint.py) and is redundant here: every file's sha256 is in the marker and is
    checked before loading."""
    try:
        from torch.utils.serialization import config as serialization_config
    except ImportError:  # older torch: keep its default
        yield
        return
    previous = serialization_config.save.compute_crc32
    serialization_config.save.compute_crc32 = False
    try:
        yield
    finally:
        serialization_config.save.compute_crc32 = previous


TENSOR_PLACEHOLDER = "__pilotrun_tensor__"


def _split_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with every tensor replaced by {TENSOR_PLACEHOLDER: index into `tensors`} (appended in
    order)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {TENSOR_PLACEHOLDER: len(tensors) - 1}
    if isinstance(value, dict):
        return {k: _split_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_split_tensors(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_split_tensors(v, tensors) for v in value)
    return value


def _join_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if len(value) == 1 and TENSOR_PLACEHOLDER in value:
            return tensors[value[TENSOR_PLACEHOLDER]]
        return {k: _join_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_join_tensors(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_join_tensors(v, tensors) for v in value)
    return value


class TorchSaveStorage:
    """Single process, torch.save files. Each top-level key K (model, optimizer, ...) becomes `K.pt`, so that
    a damaged file is named by what it holds. A part holding more than `shard_bytes` of tensors is split:
    `K.pt` keeps the structure (tensors replaced by placeholders) and `K.000.pt`, `K.001.pt`, ... hold its
    tensors in order, about `shard_bytes` each. Every file is written, hashed and fsynced concurrently,
    because sha256 runs at roughly disk speed on one core: one big file would be bound by a single hashing
    core. Loaded with weights_only=True: a checkpoint is tensors, numbers, strings, lists and dicts, nothing
    that runs code when read. (Storage shared between tensors is not preserved across shards; state dicts of
    untied models and optimizers hold none.)"""

    name = "torch_save"

    def __init__(self, shard_bytes: int = 64 << 20, workers: int | None = None) -> None:
        self.shard_bytes = shard_bytes
        self.workers = workers or max(2, min(8, os.cpu_count() or 2))

    def _files_for(self, key: str, value: Any) -> dict[str, Any]:
        tensors: list[torch.Tensor] = []
        structure = _split_tensors(value, tensors)
        total = sum(t.numel() * t.element_size() for t in tensors)
        if total <= self.shard_bytes:
            return {f"{key}.pt": value}
        shards: list[list[torch.Tensor]] = [[]]
        filled = 0
        for tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            if filled and filled + size > self.shard_bytes:
                shards.append([])
                filled = 0
            shards[-1].append(tensor)
            filled += size
        files: dict[str, Any] = {f"{key}.pt": {"structure": structure, "shards": len(shards)}}
        for index, shard in enumerate(shards):
            files[f"{key}.{index:03d}.pt"] = shard
        return files

    def write(self, state: dict[str, Any], folder: Path) -> dict[str, tuple[str, int]]:
        files: dict[str, Any] = {}
        for key, value in state.items():
            if not re.fullmatch(r"[A-Za-z0-9_]+", key):
                raise ValueError(f"checkpoint state key '{key}' must be a plain identifier (it names a file)")
            files.update(self._files_for(key, value))
        # Largest first, so that the long files start early and the small ones fill the gaps.
        order = sorted(files, key=lambda name: -_payload_bytes(files[name]))
        with _zip_crc32_disabled(), ThreadPoolExecutor(max_workers=self.workers) as pool:
            futures = {name: pool.submit(self._write_one, files[name], folder / name) for name in order}
            written = {name: future.result() for name, future in futures.items()}
        fsync_directory(folder)
        return written

    @staticmethod
    def _write_one(value: Any, path: Path) -> tuple[str, int]:
        with open_for_write(path, "wb", exclusive=True) as handle:  # a new file in the fresh temp folder
            writer = _HashingWriter(handle)
            try:
                torch.save(value, writer)
            finally:
                digest = writer.hexdigest()  # always stop the hashing thread
            handle.flush()
            os.fsync(handle.fileno())
        return digest, writer.bytes_written

    @staticmethod
    def _load(path: Path) -> Any:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a file that passed its hash but cannot be unpickled: say which
            raise CheckpointError(f"checkpoint file {path} cannot be read: {exc}") from None

    def read(self, folder: Path, files: list[str], template: dict[str, Any] | None = None) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for file_name in files:
            match = re.fullmatch(r"([A-Za-z0-9_]+)\.pt", file_name)
            if not match:
                continue  # a shard: read with its part below
            key = match.group(1)
            value = self._load(folder / file_name)
            shard_names = sorted(f for f in files if re.fullmatch(re.escape(key) + r"\.\d{3,}\.pt", f))
            if shard_names:
                if not (isinstance(value, dict) and value.get("shards") == len(shard_names)):
                    raise CheckpointError(f"checkpoint part {folder / file_name} does not match its "
                                          f"{len(shard_names)} shard file(s)")
                tensors = [t for name in shard_names for t in self._load(folder / name)]
                value = _join_tensors(value["structure"], tensors)
            state[key] = value
        return state


def _payload_bytes(value: Any) -> int:
    tensors: list[torch.Tensor] = []
    _split_tensors(value, tensors)
    return sum(t.numel() * t.element_size() for t in tensors)
