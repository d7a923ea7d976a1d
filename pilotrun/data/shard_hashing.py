"""Checking a shard's sha256 when training first reads it, on a background thread (torch-free).

`open_dataset` checks shapes and sizes but does not rehash shards: on large data that would keep a run from
starting for minutes. A byte flipped after `prepare` (a bad disk, a partial copy) that keeps its ids inside
the vocabulary is then invisible to the reader's id guard, and the run would train on it. `ShardHasher`
closes that gap without stalling the loop: the reader tells it which shard a read touched first
(`TokenSplit.watch_first_reads`), and one daemon thread hashes those shards, one at a time in the order they
were first read, in chunks. Both the chunked read (`readinto`) and hashlib's `update` on buffers above 2 KiB
run without the GIL, so the training thread keeps the interpreter while a shard is hashed.

Each shard is hashed at most once per hasher (a hasher lives for one training session: a resumed session
hashes again the shards it reads, which costs one read of each, in the background). Results are `ShardHash`
records, taken by the trainer at update boundaries (`take_finished`); the first whose hash differs from the
manifest's, or whose file could not be read, is `mismatch`. `wait` lets a session that is about to end
complete only with every shard it read verified; `close` stops the thread between two chunks, leaving
what was still queued unverified.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# A MiB per read: large enough that the thread takes the GIL once per MiB only, small enough that `close`
# stops it within a millisecond or so.
CHUNK_BYTES = 1 << 20


class WatchedSplit(Protocol):
    """What the hasher needs of a split (reader.TokenSplit): its name, folder, shard files and their
    hashes."""

    name: str
    data_dir: str
    files: list[str]
    sha256s: list[str | None]

    def watch_first_reads(self, on_first_read: Callable[[Any, int], None] | None) -> None: ...


@dataclass(frozen=True)
class ShardHash:
    """One shard's check: what the manifest says, what the file holds, and what it cost the hashing thread."""

    split: str
    file: str
    path: str
    expected: str
    found: str | None  # None when the file could not be read (`error`)
    bytes: int
    seconds: float  # wall seconds the thread spent on it
    cpu_seconds: float  # the thread's own CPU time for it
    hashed_at: float  # unix time the hash was done
    error: str | None = None

    @property
    def matched(self) -> bool:
        return self.error is None and self.found == self.expected

    def describe(self) -> str:
        """The one line that names a damaged shard: expected and found hash prefixes, or why it was
        unreadable."""
        if self.error is not None:
            return f"shard {self.path} could not be read to check its sha256: {self.error}"
        return (f"shard {self.path} is damaged: sha256 {self.found[:16]}... found, the manifest says "
                f"{self.expected[:16]}... (run `pilotrun data verify`)")

    def event_fields(self) -> dict[str, Any]:
        """The fields of its `shard_check` event (docs/RUN_RECORD.md)."""
        return {
            "split": self.split,
            "file": self.file,
            "matched": self.matched,
            "expected": self.expected,
            "found": self.found,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "hashed_at": self.hashed_at,
            "error": self.error,
        }


def hash_file(
    path: str, stop: threading.Event | None = None, chunk_bytes: int = CHUNK_BYTES
) -> tuple[str | None, int]:
    """(sha256 hex digest, bytes read) of a file, read in chunks into one reused buffer; (None, bytes so far)
    when `stop` is set between two chunks."""
    digest = hashlib.sha256()
    buffer = bytearray(chunk_bytes)
    view = memoryview(buffer)
    total = 0
    with open(path, "rb", buffering=0) as file:
        while True:
            if stop is not None and stop.is_set():
                return None, total
            count = file.readinto(buffer)
            if not count:
                return digest.hexdigest(), total
            digest.update(view[:count])
            total += count


class ShardHasher:
    """The background check of first-read shards (module docstring). One per session and rank."""

    def __init__(
        self,
        chunk_bytes: int = CHUNK_BYTES,
        hash_function: Callable[[str, threading.Event, int], tuple[str | None, int]] = hash_file,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self._hash = hash_function
        self._queue: queue.Queue[tuple[str, str, str, str] | None] = queue.Queue()
        self._submitted: set[str] = set()
        self._finished: list[ShardHash] = []
        self._taken = 0
        self._done = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watched: list[WatchedSplit] = []
        self.mismatch: ShardHash | None = None  # the first damaged shard found, if any

    # ------------------------------------------------------------------ what to hash
    def watch(self, split: WatchedSplit) -> None:
        """Hash each of `split`'s shards when it is first read."""
        split.watch_first_reads(self._first_read)
        self._watched.append(split)

    def _first_read(self, split: WatchedSplit, index: int) -> None:
        expected = split.sha256s[index]
        if isinstance(expected, str):
            self.submit(
                split.name, split.files[index], os.path.join(split.data_dir, split.files[index]), expected
            )

    def submit(self, split: str, file: str, path: str, expected: str) -> bool:
        """Queue one shard (once: a second submit of the same path is ignored); False when not queued."""
        if path in self._submitted or self._stop.is_set():
            return False
        self._submitted.add(path)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="pilotrun-shard-hashing", daemon=True)
            self._thread.start()
        self._queue.put((split, file, path, expected))
        return True

    # ------------------------------------------------------------------ the thread
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or self._stop.is_set():
                return
            result = self._check(*item)
            with self._done:
                if result is not None:
                    self._finished.append(result)
                    if not result.matched and self.mismatch is None:
                        self.mismatch = result
                self._done.notify_all()
            if result is None:  # stopped mid-shard
                return

    def _check(self, split: str, file: str, path: str, expected: str) -> ShardHash | None:
        started, cpu_started = time.perf_counter(), time.thread_time()
        found, error, size = None, None, 0
        try:
            found, size = self._hash(path, self._stop, self.chunk_bytes)
            if found is None:
                return None
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc.strerror or exc}"
        return ShardHash(split, file, path, expected, found, size, time.perf_counter() - started,
                         time.thread_time() - cpu_started, time.time(), error)

    # ------------------------------------------------------------------ results
    @property
    def submitted(self) -> int:
        return len(self._submitted)

    @property
    def pending(self) -> int:
        """Shards queued or being hashed."""
        with self._done:
            return len(self._submitted) - len(self._finished)

    def has_new(self) -> bool:
        return len(self._finished) > self._taken  # one int compare: asked after every update

    def take_finished(self) -> list[ShardHash]:
        """The results finished since the previous call, in the order they finished."""
        with self._done:
            new, self._taken = self._finished[self._taken:], len(self._finished)
        return new

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted shard is hashed (True), or `timeout` seconds pass / the hasher is
        closed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._done:
            while len(self._finished) < len(self._submitted):
                if self._stop.is_set() or self._thread is None or not self._thread.is_alive():
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._done.wait(remaining if remaining is not None else 0.5)
        return True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop watching and stop the thread (between two chunks; queued shards stay unverified)."""
        for split in self._watched:
            split.watch_first_reads(None)
        self._watched = []
        self._stop.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
