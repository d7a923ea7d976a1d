"""`pilotrun prepare`: a source becomes token shards and a manifest, identically on every rerun.

Pipeline (one pass, streaming; a trained BPE adds one earlier pass over the same stream):

    source documents -> seeded bounded shuffle -> split by text hash -> chunks -> tokenize on `workers`
    threads (results consumed in submission order) -> per-split shard writers -> metadata.json

Determinism: the chunking, the order of results and every decision (split, the `--train-tokens` stop) depend
only on the stream, never on the number of workers or on timing, so output is byte-identical for any
`--workers`. Memory is bounded by the shuffle buffer, at most `8 * workers` chunks in flight and one shard
buffer per split. The folder is built under a hidden temporary name beside `out` and renamed into place only
when complete, so an interrupted prepare never leaves a folder that looks finished.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from pilotrun.data.hub import HubClient
from pilotrun.data.shards import FORMAT, METADATA_FILE, TOKENIZER_FILE, ShardWriter, manifest_text
from pilotrun.data.sources import OpenedSource, open_source
from pilotrun.data.stream import SPLITS, TRAIN, VAL, shuffled, with_splits
from pilotrun.data.tokenizer import (
    ResolvedTokenizer,
    encode_documents,
    plain,
    resolve_tokenizer,
)
from pilotrun.errors import DataError

# Documents are handed to worker threads in chunks of about this many characters: large enough that the
# per-call overhead stays small next to encoding, small enough that a small corpus still spreads over workers.
CHUNK_CHARACTERS = 1 << 16
CHUNK_MAX_DOCUMENTS = 4096
READ_AHEAD_CHUNKS_PER_WORKER = 8
MAX_SHARD_TOKENS = 2**30  # 2 GiB (uint16) or 4 GiB (uint32) per in-memory shard buffer
SPLIT_RULE = "val when int(sha256(utf-8 text)[:8], big-endian) / 2**64 < val_fraction, else train"
LAYOUT = "each split is its documents in stream order, each followed by eos_id, cut into shards of shard_tokens"


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _check_options(train_tokens: Any, val_fraction: float, shard_tokens: Any, shuffle_buffer: int,
                   workers: int) -> None:
    for flag, value in (("--shard-tokens", shard_tokens), ("--train-tokens", train_tokens)):
        if isinstance(value, float) and not math.isfinite(value):  # int() of inf/nan raises a bare Overflow/ValueError
            raise DataError(f"{flag} must be a positive integer, got {value}")
    if not 0.0 <= float(val_fraction) < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if int(shard_tokens) != shard_tokens or not 1 <= int(shard_tokens) <= MAX_SHARD_TOKENS:
        # A shard is assembled in memory (one per split), so its size is what bounds prepare's memory.
        raise DataError(f"--shard-tokens must be an integer from 1 to {MAX_SHARD_TOKENS}, got {shard_tokens}")
    if train_tokens is not None and (int(train_tokens) != train_tokens or int(train_tokens) < 1):
        raise DataError(f"--train-tokens must be a positive integer, got {train_tokens}")
    if int(shuffle_buffer) < 0:
        raise DataError(f"--shuffle-buffer must be >= 0, got {shuffle_buffer}")
    if int(workers) < 0:
        raise DataError(f"--workers must be >= 0 (0: all cores), got {workers}")


def prepare_corpus(
    out: str | os.PathLike,
    source: str = "builtin",
    tokenizer: str = "bpe:4096",
    eos: str | None = None,
    text_field: str = "text",
    train_tokens: int | None = None,
    val_fraction: float = 0.01,
    shard_tokens: int = 2**24,
    seed: int = 0,
    shuffle_buffer: int = 10000,
    workers: int = 0,
    force: bool = False,
    progress: bool = True,
    hub: HubClient | None = None,
) -> dict[str, Any]:
    """Prepare `source` into the data folder `out`; returns the manifest (what metadata.json holds).

    `hub` replaces the network seam (tests pass a client serving local rows); None uses the real hub.
    """
    _check_options(train_tokens, val_fraction, shard_tokens, shuffle_buffer, workers)
    out = os.path.normpath(os.fspath(out))
    if os.path.lexists(out):
        if not force:
            raise DataError(f"{out} already exists: choose another --out or pass --force to replace it")
        _check_replaceable(out)
    train_tokens = None if train_tokens is None else int(train_tokens)
    shard_tokens, shuffle_buffer = int(shard_tokens), int(shuffle_buffer)
    val_fraction = float(val_fraction)
    workers = int(workers) or default_workers()

    opened = open_source(source, text_field, hub)

    def stream() -> Iterator[tuple[str, str]]:
        return with_splits(shuffled(opened.documents(), shuffle_buffer, seed), val_fraction)

    # The temporary folder first: an unwritable --out is refused before minutes of tokenizer training.
    parent = os.path.dirname(os.path.abspath(out))
    temporary = os.path.join(parent, f".{os.path.basename(out)}.partial-{os.getpid()}")
    try:
        os.makedirs(parent, exist_ok=True)
        _remove_abandoned_partials(parent, os.path.basename(out))
        shutil.rmtree(temporary, ignore_errors=True)
        os.makedirs(temporary)
    except OSError as exc:
        raise DataError(f"--out {out}: cannot create the output folder ({exc.strerror or exc}: "
                        f"{exc.filename or parent})") from None
    try:
        resolved = resolve_tokenizer(tokenizer, eos, lambda: (t for t, s in stream() if s == TRAIN), hub, progress)
        splits, stopped = _tokenize_and_write(stream(), resolved, temporary, shard_tokens, train_tokens, workers,
                                              progress, opened)
        if splits[TRAIN]["tokens"] == 0:
            raise DataError(f"source '{source}' gave no training documents (val_fraction={val_fraction})")
        if train_tokens is not None and not stopped:
            print(f"pilotrun prepare: warning: the source ended at {splits[TRAIN]['tokens']} training tokens, fewer "
                  f"than --train-tokens {train_tokens} (the manifest records the real count)", file=sys.stderr)
        for warning in small_val_warnings(splits[VAL]["tokens"]):
            print(f"pilotrun prepare: warning: {warning}", file=sys.stderr)
        import tokenizers

        manifest = {
            "format": FORMAT,
            "source": opened.identity,
            "tokenizer": resolved.identity,
            "dtype": resolved.dtype,
            "options": {
                "train_tokens": train_tokens,
                "val_fraction": val_fraction,
                "shard_tokens": shard_tokens,
                "seed": int(seed),
                "shuffle_buffer": shuffle_buffer,
                "text_field": text_field,
                "eos": eos,
            },
            "split_rule": SPLIT_RULE,
            "layout": LAYOUT,
            "stream": {
                "stopped_at_train_tokens": stopped,
                # Only a complete pass has a count that does not depend on how far ahead the reader got.
                "empty_documents_skipped": None if stopped else opened.skipped_empty,
            },
            "software": {"python": platform.python_version(), "tokenizers": tokenizers.__version__},
            "splits": splits,
        }
        _write_text(os.path.join(temporary, TOKENIZER_FILE), resolved.json_text)
        _write_text(os.path.join(temporary, METADATA_FILE), manifest_text(manifest))
        _commit(temporary, out, force)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return manifest


def small_val_warnings(val_tokens: int, recipe: str = "stability") -> list[str]:
    """A warning when the val split is smaller than one evaluation of a packaged recipe (by default the CPU
    stability recipe `pilotrun pilot` runs): the evaluation would re-read the same few documents."""
    from pilotrun.config import load_run_config
    from pilotrun.data.reader import val_split_warnings

    t = load_run_config(recipe).train
    return val_split_warnings(val_tokens, t.batch_size, t.seq_len, t.eval_batches,
                              what=f"the packaged {recipe} recipe")


def _remove_abandoned_partials(parent: str, name: str) -> None:
    """Delete temporary folders that a killed prepare of the same `out` left behind (their process is gone).

    They never look finished (hidden name, no rename), but they can hold gigabytes. A folder whose process is
    still alive belongs to a concurrent prepare and is left alone."""
    prefix = f".{name}.partial-"
    for entry in os.listdir(parent):
        if not entry.startswith(prefix) or not entry[len(prefix):].isdigit():
            continue
        pid = int(entry[len(prefix):])
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal): leave it
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
        except PermissionError:
            continue


def _check_replaceable(out: str) -> None:
    """--force replaces a data folder (or an empty folder), never an arbitrary folder or file named by mistake."""
    if os.path.isdir(out) and not os.path.islink(out):
        if not os.listdir(out) or os.path.isfile(os.path.join(out, METADATA_FILE)):
            return
    raise DataError(f"--force: {out} is not a pilotrun data folder (no {METADATA_FILE}) nor an empty folder; "
                    "not replacing it: remove it yourself or choose another --out")


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _commit(temporary: str, out: str, force: bool) -> None:
    """Rename the finished folder into place; an old folder (with --force) is removed only afterwards."""
    replaced = None
    if os.path.lexists(out):
        if not force:
            raise DataError(f"{out} appeared while preparing: not replacing it without --force")
        _check_replaceable(out)
        replaced = f"{temporary}.replaced"
        os.rename(out, replaced)
    os.rename(temporary, out)
    directory = os.open(os.path.dirname(os.path.abspath(out)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    if replaced is not None:
        if os.path.isdir(replaced) and not os.path.islink(replaced):
            shutil.rmtree(replaced)
        else:
            os.remove(replaced)


def _chunks(stream: Iterable[tuple[str, str]]) -> Iterator[tuple[list[str], list[str]]]:
    texts: list[str] = []
    splits: list[str] = []
    characters = 0
    for text, split in stream:
        texts.append(text)
        splits.append(split)
        characters += len(text)
        if characters >= CHUNK_CHARACTERS or len(texts) >= CHUNK_MAX_DOCUMENTS:
            yield texts, splits
            texts, splits, characters = [], [], 0
    if texts:
        yield texts, splits


@contextlib.contextmanager
def _tokenizers_single_threaded() -> Iterator[None]:
    """Each worker thread encodes on one core: switch off tokenizers' own thread pool while we encode.

    `tokenizers` reads TOKENIZERS_PARALLELISM at every batch call; the previous value is restored after."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def _encoded_in_order(chunks: Iterator[tuple[list[str], list[str]]], resolved: ResolvedTokenizer,
                      workers: int) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
    """(splits, tokens, lengths) per chunk, in the order the chunks were read, whatever the worker count.

    Workers are threads, not processes: `tokenizers` releases the GIL for the whole batch encode (the Rust
    side does all the work), so `workers` threads keep that many cores busy, with no process start-up, no
    re-import of the caller's main module (spawn) and no pickling of text. Only the cheap id-list to array
    conversion holds the GIL."""
    from concurrent.futures import ThreadPoolExecutor

    # One encoder shared by the threads: its encode borrows it read-only (and without the GIL), so sharing is
    # safe. It is the very object whose serialization is stored as tokenizer.json (reloading that JSON would
    # cost ~0.5 s for GPT-2's vocabulary and give the same tokenizer).
    encoder = plain(resolved.tokenizer)

    def encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return encode_documents(encoder, texts, resolved.eos_id, resolved.dtype)

    with _tokenizers_single_threaded():
        if workers == 1:  # no thread at all: the simplest path, and the reference the others must match
            for texts, splits in chunks:
                yield (splits, *encode(texts))
            return
        executor = ThreadPoolExecutor(workers, thread_name_prefix="pilotrun-tokenize")
        try:
            pending: collections.deque = collections.deque()
            for texts, splits in chunks:
                pending.append((splits, executor.submit(encode, texts)))
                # Bounded read-ahead (memory stays flat on any corpus size), deep enough that a thread the OS
                # delays does not leave the others idle behind the in-order consumer.
                if len(pending) >= READ_AHEAD_CHUNKS_PER_WORKER * workers:
                    splits_done, future = pending.popleft()
                    yield (splits_done, *future.result())
            while pending:
                splits_done, future = pending.popleft()
                yield (splits_done, *future.result())
        finally:
            executor.shutdown(wait=True, cancel_futures=True)


def _progress_bar(train_tokens: int | None, opened: OpenedSource | None, progress: bool):
    """The bar and how to read its position. With a --train-tokens cap it counts training tokens; without one,
    documents against the count a local file or the built-in corpus knows up front (so it has an ETA); a
    streamed source without a cap only counts. The position is clamped to the total: the last document may
    carry the training tokens past the cap, and the bar must not run past 100%."""
    from tqdm import tqdm

    expected = opened.expected_documents if opened is not None else None
    if train_tokens is None and expected:
        bar = tqdm(total=expected, unit="doc", unit_scale=True, desc="prepare (documents)", file=sys.stderr,
                   disable=not progress, dynamic_ncols=True)
        return bar, lambda train, docs: min(docs + opened.skipped_empty, expected)
    bar = tqdm(total=train_tokens, unit="tok", unit_scale=True, desc="prepare (train tokens)", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    if train_tokens is None:
        return bar, lambda train, docs: train
    return bar, lambda train, docs: min(train, train_tokens)


def _tokenize_and_write(stream: Iterator[tuple[str, str]], resolved: ResolvedTokenizer, folder: str,
                        shard_tokens: int, train_tokens: int | None, workers: int,
                        progress: bool, opened: OpenedSource | None = None) -> tuple[dict[str, Any], bool]:

    writers = {split: ShardWriter(folder, split, shard_tokens, resolved.dtype) for split in SPLITS}
    documents = dict.fromkeys(SPLITS, 0)
    tokens = dict.fromkeys(SPLITS, 0)
    stopped = False
    started = time.perf_counter()
    bar, bar_position = _progress_bar(train_tokens, opened, progress)
    encoded = _encoded_in_order(_chunks(stream), resolved, workers)
    try:
        for splits, chunk_tokens, lengths in encoded:
            is_val = np.fromiter((s == VAL for s in splits), dtype=bool, count=len(splits))
            if train_tokens is not None:
                # The first training document that brings the total to train_tokens is the last one taken.
                train_cumulative = tokens[TRAIN] + np.cumsum(np.where(is_val, 0, lengths))
                reached = np.flatnonzero(~is_val & (train_cumulative >= train_tokens))
                if len(reached):
                    keep = int(reached[0]) + 1
                    chunk_tokens = chunk_tokens[: int(lengths[:keep].sum())]
                    is_val, lengths = is_val[:keep], lengths[:keep]
                    stopped = True
            token_is_val = np.repeat(is_val, lengths)
            for split, mask in ((TRAIN, ~token_is_val), (VAL, token_is_val)):
                part = chunk_tokens[mask]
                writers[split].add(part)
                tokens[split] += len(part)
            documents[VAL] += int(is_val.sum())
            documents[TRAIN] += int((~is_val).sum())
            bar.update(bar_position(tokens[TRAIN], documents[TRAIN] + documents[VAL]) - bar.n)
            elapsed = max(time.perf_counter() - started, 1e-9)
            bar.set_postfix(docs=documents[TRAIN] + documents[VAL],
                            docs_per_s=f"{(documents[TRAIN] + documents[VAL]) / elapsed:.0f}",
                            val_tok=tokens[VAL], refresh=False)
            if stopped:
                break
    finally:
        encoded.close()  # stops the worker pool when we stop early
        bar.close()
    splits_record = {}
    for split in SPLITS:
        shards = writers[split].close()
        if sum(s["tokens"] for s in shards) != tokens[split]:
            raise AssertionError(f"internal: {split} shards hold a different token count than was written")
        splits_record[split] = {"documents": documents[split], "tokens": tokens[split], "shards": shards}
    return splits_record, stopped
