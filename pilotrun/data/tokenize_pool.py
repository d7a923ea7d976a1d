"""Tokenizing in worker processes: prepare's `--workers N` (N >= 2), for machines where the main process's
GIL-bound share (reading, JSON, the split hash) would cap tokenizing threads.

The main process keeps everything that decides the output: reading, the seeded shuffle, the split, the
chunking, the `--train-tokens` stop and the shard writers. Workers only turn a chunk of texts into (ids with
EOS after each document, lengths), exactly as `encode_documents` does in the main process, from the same
tokenizer JSON text that the data folder stores; chunk `i` goes to worker `i mod N` and results are taken back
in chunk order, so the output is byte-identical whatever N (and to the in-process paths).

Why not `multiprocessing.Pool`: its `imap` pulls the whole input iterator ahead on a feeder thread (read-ahead
and so memory would follow the corpus, and the source would be read on a thread other than the one that
commits), and its workers outlive a SIGKILLed parent. Here each worker has its own task queue (whose `put`
never blocks: a feeder thread writes the pipe, so the main process cannot deadlock against a worker busy
returning a result), at most `depth` chunks are in flight per worker, and a worker dies with its parent:
Linux's PR_SET_PDEATHSIG (SIGKILL) where available, and everywhere a check of its parent pid while it waits
for work. Workers ignore every stop signal (pilotrun/common/stop_signals.py: a terminal sends Ctrl-C's SIGINT
and a hangup's SIGHUP to the whole process group), so a stop reaches only the main process, which finishes its
chunk, commits and then ends the workers itself.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import os
import queue
import signal
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from pilotrun.common import stop_signals
from pilotrun.common.errors import DataError

# 'spawn': a fresh interpreter per worker, never a fork of a parent that may already run threads (tokenizers'
# own pool, tqdm's monitor), which can deadlock in the child.
START_METHOD = "spawn"
CHUNKS_IN_FLIGHT_PER_WORKER = 4
PARENT_CHECK_SECONDS = 1.0
PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies; then make sure it has not died already."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the parent-pid check in the wait loop still ends the worker
    if os.getppid() != parent_pid:
        os._exit(1)


def _worker_main(tasks: Any, results: Any, json_text: str, eos_id: int, dtype: str, parent_pid: int) -> None:
    """One worker: load the tokenizer once, then encode chunks until told to stop or the parent is gone."""
    _die_with_parent(parent_pid)
    stop_signals.ignored()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: N workers, N cores
    from pilotrun.data.tokenizer import encode_documents, plain_encoder

    encoder = plain_encoder(json_text)
    # Exiting never waits for the parent to read results it no longer wants (an early stop, a kill).
    results.cancel_join_thread()
    while True:
        try:
            texts = tasks.get(timeout=PARENT_CHECK_SECONDS)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return
            continue
        if texts is None:
            return
        try:
            results.put(("ok", *encode_documents(encoder, texts, eos_id, dtype)))
        except Exception as exc:  # the parent raises it as one line; the worker itself stays usable
            results.put(("error", f"{type(exc).__name__}: {exc}"))


class TokenizePool:
    """`workers` processes encoding chunks; `encoded_in_order` is the only way in."""

    def __init__(self, json_text: str, eos_id: int, dtype: str, workers: int) -> None:
        import multiprocessing

        context = multiprocessing.get_context(START_METHOD)
        self.workers: list[tuple[Any, Any, Any]] = []
        self.in_flight = 0
        try:
            for index in range(workers):
                tasks, results = context.Queue(), context.Queue()
                process = context.Process(target=_worker_main, name=f"pilotrun-tokenize-{index}", daemon=True,
                                          args=(tasks, results, json_text, int(eos_id), dtype, os.getpid()))
                process.start()
                self.workers.append((process, tasks, results))
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [process.pid for process, _, _ in self.workers]

    def _result(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        process, _, results = self.workers[index]
        while True:
            try:
                outcome = results.get(timeout=PARENT_CHECK_SECONDS)
                break
            except queue.Empty:
                if not process.is_alive():
                    raise DataError(
                        f"tokenizing worker {process.name} (pid {process.pid}) exited with code "
                        f"{process.exitcode} (killed, or out of memory?): run the same command again "
                        "to continue from the last commit"
                    ) from None
        self.in_flight -= 1
        if outcome[0] == "error":
            raise DataError(f"tokenizing worker {process.name}: {outcome[1]}")
        return outcome[1], outcome[2]

    def encoded_in_order(self, chunks: Iterator[tuple[list[str], list[Any]]]
                         ) -> Iterator[tuple[list[Any], np.ndarray, np.ndarray]]:
        """(extras, tokens, lengths) per chunk in the order read; at most `depth` chunks in flight per
        worker."""
        n = len(self.workers)
        pending: collections.deque = collections.deque()  # (worker index, extras), in chunk order
        for sent, (texts, extras) in enumerate(chunks):
            self.workers[sent % n][1].put(texts)
            self.in_flight += 1
            pending.append((sent % n, extras))
            if len(pending) >= CHUNKS_IN_FLIGHT_PER_WORKER * n:
                index, extras_done = pending.popleft()
                yield (extras_done, *self._result(index))
        while pending:
            index, extras_done = pending.popleft()
            yield (extras_done, *self._result(index))

    def close(self) -> None:
        """Stop every worker: none outlives the pass. After a complete pass each gets a stop message; a pass
        that ended early (the --train-tokens stop, a stop request, an error) kills them, since the chunks
        still in flight are not wanted."""
        for process, tasks, _ in self.workers:
            if self.in_flight:
                process.kill()
            elif process.is_alive():
                try:
                    tasks.put(None)
                except (OSError, ValueError):
                    pass
        for process, tasks, results in self.workers:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
            for channel in (tasks, results):
                channel.cancel_join_thread()  # unread chunks must not keep this process waiting at exit
                channel.close()
        self.workers = []


def children_peak_mb() -> float:
    """The largest peak resident memory of a finished child process of this one (the workers, once closed)."""
    import resource

    kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return kib / 1024 if sys.platform.startswith("linux") else kib / 2**20  # macOS reports bytes


def encoded_in_order(chunks: Iterator[tuple[list[str], list[Any]]], json_text: str, eos_id: int, dtype: str,
                     workers: int) -> Iterator[tuple[list[Any], np.ndarray, np.ndarray]]:
    """Prepare's process path: a pool for this pass only, stopped when the generator is closed or
    exhausted."""
    pool = TokenizePool(json_text, eos_id, dtype, workers)
    try:
        yield from pool.encoded_in_order(chunks)
    finally:
        pool.close()
