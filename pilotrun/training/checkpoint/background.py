"""Background checkpoints: the loop waits only while the state is copied to host memory; the write, its hashes
and its durability happen beside training, inside torch.distributed.checkpoint's own asynchronous save.

A background save goes, on every rank:

    1. (loop thread) rank 0 prepares the temp folder as for any save (checkpointer.begin_save) and names it
       to the other ranks; every rank hands its state to `dcp.async_save`, whose stager copies every tensor
       (and deep-copies every other value) to host memory: this copy is all the loop waits for. The stager
       is kept for the session and copies into the same host buffers each time, one memcpy per tensor,
       never split over the loop's intra-op threads (host_staging.py; `_stager`; closed at the session's
       end). The tensors whose storages the caller names `stable` (the parameters and the optimizer's state:
       `stable_storages`) are copied by a staging thread beside the next update's forward and backward, and
       the caller holds the next optimizer step until `PendingSave.wait_staged` returns; everything else is
       copied before the call returns, and the training may change it the moment it does;
    2. (DCP's thread, and the writer threads it starts, all at a lower priority than the training's:
       common/thread_priority.py) every rank writes its files (dcp_file_writer.py: DCP's records, each
       tensor's without the zip CRC32 and in three writes), hashing each as it writes it
       (_HashingFileSystem: no file is read back), and fsyncs them; the coordinator (rank 0) then writes
       .metadata (fsynced, hashed the same way) in `finish`, which DCP calls only once every rank's files are
       written, and there collects every file's hash (another rank's files it reads and hashes there): the
       hashes the marker needs, off the loop;
    3. (loop thread, at the next safe point: an agreed round of the checkpoint callback once rank 0's future
       is done, the next save, a rollback, or the session's end) every rank takes its future's result and
       rank 0 commits exactly as a synchronous save does: rename, COMMITTED.json last; the prune of older
       checkpoints then runs in a thread of its own (Checkpointer.prune_in_background), joined before the
       next save, load or listing.

A crash at any moment before 3 (the staging included) leaves a temp folder without a marker (never loaded,
removed by the next save); the marker is written only after every rank's files are durable and hashed,
because DCP runs `finish` after gathering every rank's write results. At most one save is in flight: a save
due while one is writing first waits for it (`finish_background_save`), and the caller records the wait.

Under several ranks the write's collectives run on a process group of their own (gloo, created at the first
background save, alike on every rank), so that they never interleave with the training's collectives on the
default group from the other thread.

The checkpoint is in DCP's format (storage `torch_dcp`) at any world size, read by DCP's own reader (the zip
CRC32 fields of its tensor records are zero, as torch.save leaves them with its CRC32 off: the marker's sha256
guards the files), so a background checkpoint of one process loads like one of several
(distributed_checkpointer.DistributedCheckpointer reads with the storage its marker names); the state is the
same `session.checkpoint_state(sharded=True)`, so a resume is bit-exact whatever the setting.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import threading
import time
import warnings
from collections.abc import Collection, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from pilotrun.common.errors import CheckpointError
from pilotrun.common.files import fsync_directory, sha256_of_file
from pilotrun.common.thread_priority import yield_to_training
from pilotrun.training.checkpoint.dcp_file_writer import split_items, write_files
from pilotrun.training.checkpoint.dcp_storage import DCPStorage
from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer
from pilotrun.training.checkpoint.host_staging import HostCopyStager, stages
from pilotrun.training.distributed import broadcast_object

OUT_OF_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Files per rank written (dcp_file_writer.py) and hashed as they are written, in parallel: sha256 and the
# writes release the GIL.
WRITER_THREADS = max(1, min(4, os.cpu_count() or 1))
# One process writes with no_dist: DCP warns that it assumes a single process, from its own thread (where a
# catch_warnings around the call does not reach). That is the intent here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


class _HashingStream:
    """A file DCP writes into, hashed as it is written: the marker's sha256 without reading the file again.
    A write that fails is kept in `failures`: torch.save's zip writer swallows an exception its stream raises
    mid-file and fails later with a position mismatch of its own ("unexpected pos"), which would hide a full
    disk."""

    def __init__(self, raw: Any, failures: list[OSError]) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()
        self.size = 0
        self.failures = failures

    def write(self, data: Any) -> int:
        self.digest.update(data)  # hashlib releases the GIL for large buffers, as the write does
        try:
            written = self.raw.write(data)
        except OSError as exc:
            self.failures.append(exc)
            raise
        self.size += written
        return written

    def __getattr__(self, name: str) -> Any:  # tell, fileno, flush, close: the file's own
        return getattr(self.raw, name)


class _HashingFileSystem(dcp_filesystem.FileSystem):
    """DCP's local file system, whose written files are hashed while they are written, and whose renames (the
    .metadata written as a temp file, then renamed) carry the hash to the new name. `hashed` holds
    {file name: (sha256, bytes)} of the files this process wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.hashed: dict[str, tuple[str, int]] = {}
        self.failures: list[OSError] = []  # what a stream's writes raised (a full disk), in order
        self._lock = threading.Lock()  # DCP writes several files at once, one per thread

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            hashing = _HashingStream(stream, self.failures)
            yield hashing
        with self._lock:
            self.hashed[Path(path).name] = (hashing.digest.hexdigest(), hashing.size)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.hashed:
                self.hashed[Path(new_path).name] = self.hashed.pop(Path(path).name)


class _HashingFileSystemWriter(dcp.FileSystemWriter):
    """DCP's file writer, whose rank's files are written by dcp_file_writer.py (the same records, without
    the zip CRC32 and with few writes per tensor) and hashed as they are written (_HashingFileSystem), and
    whose coordinator lists every file's hash right after writing .metadata."""

    files: dict[str, tuple[str, int]] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = _HashingFileSystem()

    def write_data(self, plan: Any, planner: Any) -> Any:
        # DCP's thread for this save (a fresh one each save): it, the file writers it starts and the hashing
        # after them yield the CPU to the training threads (common/thread_priority.py).
        yield_to_training()
        buckets = split_items(plan.items, self.thread_count)
        files = [(f"{plan.storage_data.prefix}{index}{dcp_filesystem.DEFAULT_SUFFIX}", bucket)
                 for index, bucket in enumerate(buckets)]
        folder = Path(str(self.path))  # made by prepare_local_plan
        try:
            results = write_files(self.fs.create_stream, folder, files, planner, self.sync_files)
        except Exception as exc:  # the stream's own failure, where the archive writer replaced it
            if self.fs.failures:
                raise self.fs.failures[0] from exc
            raise
        if self.fs.failures:  # a failed write the archive writer swallowed without failing itself
            raise self.fs.failures[0]
        future: torch.futures.Future = torch.futures.Future()  # what DCP waits on
        future.set_result(results)
        return future

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)  # every rank's files are written and fsynced before DCP calls this
        folder = Path(str(self.path))
        hashed = dict(self.fs.hashed)
        # Another rank's files (several processes) were hashed by that process; read those here, off the loop.
        others = sorted(path.name for path in folder.iterdir() if path.is_file() and path.name not in hashed)
        workers = max(1, min(8, os.cpu_count() or 1, len(others)))
        with ThreadPoolExecutor(max_workers=workers) as pool:  # hashlib releases the GIL: files in parallel
            digests = list(pool.map(lambda name: sha256_of_file(folder / name), others))
        for name, digest in zip(others, digests):
            hashed[name] = (digest, (folder / name).stat().st_size)
        names = {path.name for path in folder.iterdir() if path.is_file()}
        self.files = {name: hashed[name] for name in sorted(names)}
        fsync_directory(folder)


@dataclass
class PendingSave:
    """A background save handed to DCP and not yet committed (every rank holds one)."""

    step: int
    future: Future
    writer: _HashingFileSystemWriter
    temp: Path | None  # rank 0's temp folder (None on the other ranks)
    meta_json: dict[str, Any] | None
    started: float  # perf_counter at the start of the save
    staged_seconds: float  # what the loop waited for in the call: the copy to host memory of all but `stable`
    extra: dict[str, Any] = field(default_factory=dict)  # the caller's (counters, waits) for its record
    staging: Future | None = None  # the staging thread's copy of the stable tensors (None: none left)
    held_seconds: float = 0.0  # what the loop waited for afterwards: that copy, before it changed them

    def done(self) -> bool:
        return self.future.done()

    def staged_and_waited(self) -> bool:
        """`wait_staged` has returned (or there was nothing to wait for)."""
        return self.staging is None

    def wait_staged(self) -> float:
        """Wait (if need be) until every tensor is copied; returns the seconds waited, also added to
        `held_seconds`. A failed copy is not raised here: the write fails with it, and the commit says so."""
        if self.staging is None:
            return 0.0
        started = time.perf_counter()
        with contextlib.suppress(Exception):  # the copy's failure: the write's, raised by the commit
            self.staging.result()
        waited = time.perf_counter() - started
        self.held_seconds += waited
        self.staging = None
        return waited


def stable_storages(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> frozenset[int]:
    """The storages nothing changes until the optimizer's next step (the parameters and the optimizer's state
    tensors): what a background save may copy beside the next forward and backward. Buffers are not among
    them (the forward adds to the step's statistics buffers)."""
    tensors = [*model.parameters()]
    tensors += [value for per_parameter in optimizer.state.values() for value in per_parameter.values()
                if isinstance(value, torch.Tensor)]
    # Plain tensors only: a state of DTensor shards is staged by DCP's stager, all of it at once.
    return frozenset(tensor.untyped_storage().data_ptr() for tensor in tensors
                     if type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.numel())


class _DeferringStager:
    """What dcp.async_save calls `stage` on for one save: the session's HostCopyStager, told which storages
    it may copy in its staging thread."""

    should_synchronize_after_execute = False

    def __init__(self, stager: HostCopyStager, stable: Collection[int]) -> None:
        self.stager, self.stable = stager, stable

    def stage(self, state_dict: dict[str, Any]) -> Any:
        return self.stager.stage_deferring(state_dict, self.stable)

    def synchronize_staging(self) -> None:
        """Nothing: DCP's write thread waits on the Future `stage` returned."""

    def close(self) -> None:
        """Nothing: the session's stager outlives this save (close_background)."""


def _async_group(checkpointer: DistributedCheckpointer) -> Any:
    """The gloo group the background writes' collectives use (None for one process). Created once, at the
    first background save, which every rank reaches at the same step."""
    if not checkpointer.context.is_distributed:
        return None
    group = getattr(checkpointer, "_background_group", None)
    if group is None:
        import torch.distributed as dist

        group = dist.new_group(backend="gloo")
        checkpointer._background_group = group  # type: ignore[attr-defined]
    return group


def _stager(checkpointer: DistributedCheckpointer, flat: dict[str, Any]) -> Any:
    """The checkpointer's one stager: it keeps a host copy of every tensor it staged and copies into it again
    at the next save, so only the first save allocates (and, on CUDA, pins) host memory: one copy of the
    state, for the session. Plain tensors are copied by host_staging.HostCopyStager (one memcpy each, off the
    loop's intra-op threads); a state of tensor subclasses (DTensor shards) by DCP's own stager. Reusing it
    is safe because at most one save is in flight: the previous write is finished before the next save
    stages."""
    kind = "host" if stages(flat) else "dcp"
    stager = getattr(checkpointer, "_background_stager", None)
    if stager is not None and getattr(checkpointer, "_background_stager_kind", None) != kind:
        close_background(checkpointer)
        stager = None
    if stager is None:
        stager = HostCopyStager() if kind == "host" else DefaultStager(
            StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        checkpointer._background_stager = stager  # type: ignore[attr-defined]
        checkpointer._background_stager_kind = kind  # type: ignore[attr-defined]
    return stager


def close_background(checkpointer: DistributedCheckpointer) -> None:
    """Release the host copy the stager keeps (the session's saves are done), once the last prune is done."""
    checkpointer.wait_for_prune()
    stager = getattr(checkpointer, "_background_stager", None)
    if stager is not None:
        stager.close()
        checkpointer._background_stager = None  # type: ignore[attr-defined]


def start_background_save(checkpointer: DistributedCheckpointer, step: int, state: dict[str, Any],
                          meta: dict[str, Any], stable: Collection[int] = ()) -> PendingSave:
    """Steps 1 of the module docstring, on every rank: returns once the state is staged in host memory, but
    for the tensors whose storages are in `stable`, which a staging thread copies (the caller must not
    change them before `wait_staged` returns: `PendingSave.staged_and_waited`)."""
    context = checkpointer.context
    started = time.perf_counter()
    temp = meta_json = None
    message: tuple[str, str | None] = ("folder", None)
    if context.is_main_process:
        try:
            temp, meta_json = checkpointer.begin_save(step, meta)
            message = ("folder", str(temp))
        except Exception as exc:
            message = ("error", f"{type(exc).__name__}: {exc}")
            if not context.is_distributed:
                raise
    if context.is_distributed:
        message = broadcast_object(context, message)
    if message[0] != "folder":
        raise CheckpointError(f"checkpoint save at step {step} failed on rank 0: {message[1]}")
    writer = _HashingFileSystemWriter(str(message[1]), single_file_per_rank=True, sync_files=True,
                                      thread_count=WRITER_THREADS)
    flat = checkpointer.dcp_storage.flat_state(state)
    stager = _stager(checkpointer, flat)
    if stable and isinstance(stager, HostCopyStager):
        stager = _DeferringStager(stager, stable)
    saving = dcp.async_save(flat, storage_writer=writer, process_group=_async_group(checkpointer),
                            async_stager=stager, no_dist=not context.is_distributed)
    # A stager that left copies to its thread gets both completions back; one that copied all, the write's.
    future, staging = (saving.upload_completion, saving.staging_completion) \
        if hasattr(saving, "upload_completion") else (saving, None)
    return PendingSave(step, future, writer, temp, meta_json, started, time.perf_counter() - started,
                       staging=staging)


def finish_background_save(checkpointer: DistributedCheckpointer, pending: PendingSave) -> Path:
    """Step 3, on every rank: wait for the write (if it still runs), then rank 0 commits it. A failed write
    leaves no folder (rank 0 removes its temp folder) and raises on every rank; its cause is kept as
    `__cause__` (out_of_space tells a full disk)."""
    context = checkpointer.context
    failure: BaseException | None = None
    try:
        pending.future.result()
    except BaseException as exc:  # DCP raises the write's failure on every rank
        failure = exc
    outcome: tuple[str, str] = ("ok", "")
    if context.is_main_process:
        try:
            if failure is not None:
                raise failure
            if pending.writer.files is None or pending.temp is None or pending.meta_json is None:
                raise CheckpointError(
                    f"checkpoint step {pending.step}: the background write finished without hashing its files"
                )
            path = checkpointer.commit_written(
                pending.step, pending.temp, pending.writer.files, pending.meta_json, DCPStorage.name,
                prune=False,
            )
            checkpointer.prune_in_background(pending.step)
            outcome = ("ok", str(path))
        except BaseException as exc:
            if pending.temp is not None:
                shutil.rmtree(pending.temp, ignore_errors=True)
            failure = failure or exc
            outcome = ("error", f"{type(exc).__name__}: {exc}")
    if context.is_distributed:
        outcome = broadcast_object(context, outcome)
    if outcome[0] != "ok":
        raise CheckpointError(
            f"background checkpoint save at step {pending.step} failed: {outcome[1]}"
        ) from failure
    return Path(outcome[1])


def space_error_line(exc: BaseException) -> str:
    """The full disk's own words, found as `out_of_space` finds it (`[Errno 28] No space left on device:
    PATH`), for a one-line message: DCP's exceptions carry every rank's traceback in their text."""
    found = _first_out_of_space(exc)
    if isinstance(found, OSError) and found.strerror:
        return f"{found.strerror}" + (f": {found.filename}" if found.filename else "")
    return "No space left on device"


def out_of_space(exc: BaseException | None) -> bool:
    return _first_out_of_space(exc) is not None


def _first_out_of_space(exc: BaseException | None) -> BaseException | None:
    """A save's failure that is a full disk (or quota), looked for through the causes and DCP's per-rank
    failures (CheckpointException.failures wraps each rank's exception): the OSError itself where there is
    one, else an exception whose text says so."""
    seen: list[BaseException] = []
    todo: list[Any] = [exc]
    while todo:
        item = todo.pop()
        if item is None or any(item is known for known in seen):
            continue
        seen.append(item)
        todo += [getattr(item, "__cause__", None), getattr(item, "__context__", None),
                 getattr(item, "exception", None)]
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            todo += list(failures.values())
    errors = [item for item in seen if isinstance(item, OSError) and item.errno in OUT_OF_SPACE_ERRNOS]
    return next(iter(errors), None) or next(
        (item for item in seen if "No space left on device" in str(item)), None
    )
