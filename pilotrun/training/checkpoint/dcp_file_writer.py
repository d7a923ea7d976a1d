"""A rank's share of a background checkpoint, written into DCP's files: the same files, records and metadata
as DCP's FileSystemWriter writes, with less CPU work per record.

DCP's writer stores each tensor as its own torch.save archive inside the rank's file, and reads it back
with torch.load from the offset and length its `.metadata` lists (`_StorageInfo`). The archives here are the
same, byte for byte, as `torch.save` writes with its CRC32 turned off (`serialize_tensor`; the tests compare
the bytes), so DCP's own reader, and `safe_dcp_load`, load them unchanged. Two things cost the CPU that DCP's
writer spends:

- the zip CRC32 of every record: about a quarter of a CPU second per GB on the machine of BENCHMARKS.md
  ("Background checkpoints"), and redundant, because every file's sha256, taken while it is written, is in
  the checkpoint's marker and checked before any load (the synchronous storage, single_file.py, leaves it
  out for the same reason). torch.save reads that switch from a process-wide setting, which a thread beside
  the training must not flip; the archive writer takes it as an argument instead, so it is passed there;
- the forty-odd small writes of each archive's headers, each a call into Python through the hashing stream
  (about 14,500 for the 374 tensors of the benchmark's state): `_CoalescingSink` gathers them and hands the
  stream three writes per tensor, the tensor's bytes in one piece (sha256 and the file write release the GIL
  for it).

Each file is flushed before its fsync, so that the last buffered bytes (an archive's central directory) are
durable before the coordinator writes `.metadata` and the checkpoint is committed.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

# A piece of an archive at least this large is a tensor's bytes: handed to the stream at once, not copied.
DIRECT_WRITE_BYTES = 64 << 10


class _CoalescingSink:
    """What the archive writer writes into: small pieces are copied into one buffer (the writer may reuse
    the memory they point at), large ones go straight to `write` after what was gathered before them."""

    def __init__(self, write: Callable[[Any], int]) -> None:
        self.write_through = write
        self.pending = bytearray()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes < DIRECT_WRITE_BYTES:
            self.pending += view
        else:
            self.flush()
            self.write_through(view)
        return view.nbytes

    def flush(self) -> None:
        if self.pending:
            self.write_through(self.pending)
            self.pending = bytearray()


def serialize_tensor(tensor: torch.Tensor, write: Callable[[Any], int]) -> None:
    """`tensor` as torch.save writes it with its CRC32 turned off, handed to `write` in a few pieces."""
    sink = _CoalescingSink(write)
    archive = torch._C.PyTorchFileWriter(sink, False, torch.serialization._get_storage_alignment())
    torch.serialization._save(tensor, archive, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    archive.write_end_of_file()
    sink.flush()


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor on the CPU with a storage of its own size: torch.save writes a view's whole storage."""
    tensor = tensor.detach().cpu()
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


def _item_bytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    return item.tensor_data.size.numel() * torch._utils._element_size(item.tensor_data.properties.dtype)


def split_items(items: list[WriteItem], files: int) -> list[list[WriteItem]]:
    """The items spread over at most `files` files of about equal bytes: the largest tensor first into the
    emptiest file; the (small) serialized values dealt out in turn. Empty files are left out."""
    buckets: list[list[WriteItem]] = [[] for _ in range(max(1, files))]
    sizes = [0] * len(buckets)
    values = [item for item in items if item.type == WriteItemType.BYTE_IO]
    for index, item in enumerate(values):
        buckets[index % len(buckets)].append(item)
    for item in sorted((item for item in items if item.type != WriteItemType.BYTE_IO), key=_item_bytes,
                       reverse=True):
        emptiest = sizes.index(min(sizes))
        buckets[emptiest].append(item)
        sizes[emptiest] += _item_bytes(item)
    return [bucket for bucket in buckets if bucket]


def write_file(create_stream: Callable, folder: Path, name: str, items: list[WriteItem],
               planner: SavePlanner, sync: bool) -> list[WriteResult]:
    """One file of the rank's share: every item's record at its offset, then flushed and fsynced. Returns
    DCP's write results (where each record lies), from which the coordinator writes `.metadata`."""
    results = []
    with create_stream(folder / name, "wb") as stream:
        for item in items:
            offset = stream.tell()
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                stream.write(data.getbuffer())
            else:
                serialize_tensor(_own_storage(data), stream.write)
            length = stream.tell() - offset
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=dcp_filesystem._StorageInfo(name, offset, length)))
        stream.flush()
        if sync:
            os.fsync(stream.fileno())
    return results


def write_files(create_stream: Callable, folder: Path, files: list[tuple[str, list[WriteItem]]],
                planner: SavePlanner, sync: bool) -> list[WriteResult]:
    """Every file at once, one thread each (this thread writes the first; the others start with this
    thread's nice value); the first failure, once every thread has stopped, is raised."""
    results: list[list[WriteResult]] = [[] for _ in files]
    failures: list[BaseException] = []

    def write(index: int) -> None:
        name, items = files[index]
        try:
            results[index] = write_file(create_stream, folder, name, items, planner, sync)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=write, args=(index,), name=f"pilotrun-checkpoint-writer-{index}")
               for index in range(1, len(files))]
    for thread in threads:
        thread.start()
    if files:
        write(0)
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return [result for per_file in results for result in per_file]
