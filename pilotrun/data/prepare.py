"""`pilotrun prepare`: a source becomes token shards and a manifest, identically on every rerun.

Pipeline (one pass, streaming; a trained BPE adds one earlier pass over the same stream):

    source documents (local units in a seeded order) -> seeded shuffle buffer bounded in documents and bytes
    -> split by text hash -> chunks -> tokenize (threads in this process, or `--workers N` >= 2 worker
    processes: tokenize_pool.py; results consumed in chunk order) -> per-split shard writers -> committed in
    DIR.partial/progress.json -> metadata.json -> renamed to DIR

Determinism: the chunking, the order of results and every decision (split, the `--train-tokens` stop) depend
only on the stream, never on the number of workers or on timing, so output is byte-identical for any
`--workers`, and for a prepare interrupted any number of times and rerun (prepare_state.py). Memory is bounded
by the options, not the input: the shuffle buffer, a few chunks in flight per worker, one shard buffer per
split and one parquet batch. The folder is built as the visible `DIR.partial` and renamed into place only when
complete, so an interrupted prepare never leaves a folder that looks finished. What depends on the machine
(peak resident memory, seconds, workers) goes to build_info.json beside the manifest, never into it.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from pilotrun.common.errors import DataError
from pilotrun.common.stop_signals import signal_name
from pilotrun.data.hub import HubClient
from pilotrun.data.identity import request_options
from pilotrun.data.prepare_state import PartialFolder, PrepareInterrupted, StopRequests, peak_resident_mb
from pilotrun.data.progress_bar import open_bar, progress_mode
from pilotrun.data.shards import (
    FORMAT,
    METADATA_FILE,
    TOKENIZER_FILE,
    ShardWriter,
    check_shard,
    manifest_text,
)
from pilotrun.data.sources import OpenedSource, open_source
from pilotrun.data.stream import SPLITS, TRAIN, VAL, OrderCorrelation, ShuffleBuffer, split_of
from pilotrun.data.tokenize_pool import children_peak_mb
from pilotrun.data.tokenizer import (
    ResolvedTokenizer,
    encode_documents,
    plain,
    resolve_tokenizer,
)

# Documents are handed to worker threads in chunks of about this many characters: large enough that the
# per-call overhead stays small next to encoding, small enough that a small corpus still spreads over workers.
CHUNK_CHARACTERS = 1 << 16
CHUNK_MAX_DOCUMENTS = 4096
READ_AHEAD_CHUNKS_PER_WORKER = 8
MAX_SHARD_TOKENS = 2**30  # 2 GiB (uint16) or 4 GiB (uint32) per in-memory shard buffer
SPLIT_RULE = "val when int(sha256(utf-8 text)[:8], big-endian) / 2**64 < val_fraction, else train"
BUILD_INFO_FILE = "build_info.json"  # machine-dependent figures: outside the manifest and its sha256
DEFAULT_SHUFFLE_BUFFER_BYTES = 64 << 20
LAYOUT = (
    "each split is its documents in stream order, each followed by eos_id, cut into shards of shard_tokens"
)


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _check_options(train_tokens: Any, val_fraction: float, shard_tokens: Any, shuffle_buffer: int,
                   shuffle_buffer_bytes: int, workers: int) -> None:
    for flag, value in (("--shard-tokens", shard_tokens), ("--train-tokens", train_tokens)):
        # int() of inf/nan raises a bare Overflow/ValueError
        if isinstance(value, float) and not math.isfinite(value):
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
    if int(shuffle_buffer_bytes) != shuffle_buffer_bytes or int(shuffle_buffer_bytes) < 0:
        raise DataError(f"--shuffle-buffer-bytes must be a whole number >= 0, got {shuffle_buffer_bytes}")
    if int(workers) < 0:
        raise DataError(f"--workers must be >= 0 (0: threads on all cores, 1: one thread, N: N processes), "
                        f"got {workers}")


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
    progress: bool | str = True,
    hub: HubClient | None = None,
    shuffle_buffer_bytes: int = DEFAULT_SHUFFLE_BUFFER_BYTES,
    val_warnings: Callable[[int], list[str]] | None = None,  # the val split against the recipe it is for
) -> dict[str, Any]:
    """Prepare `source` into the data folder `out`; returns the manifest (what metadata.json holds).

    An interrupted prepare of the same `out` (its `out.partial` folder) is continued when the inputs match,
    and refused (DataError naming the differences) when they do not. A stop signal (SIGINT / SIGTERM / SIGHUP)
    commits the state at the next chunk and raises PrepareInterrupted (exit code 130 / 143 / 129). `hub`
    replaces the network seam (tests pass a client serving local rows); None uses the real hub. `progress`:
    "auto" (or True), "bar", "plain", "none" (or False) for the console (progress_bar.py).
    """
    _check_options(train_tokens, val_fraction, shard_tokens, shuffle_buffer, shuffle_buffer_bytes, workers)
    bar_mode = progress_mode(progress)  # decided once: stderr's terminal-ness does not change mid-prepare
    progress = bar_mode != "none"
    out = os.path.normpath(os.fspath(out))
    _refuse_or_recover_out(out, force)
    started = time.perf_counter()
    train_tokens = None if train_tokens is None else int(train_tokens)
    shard_tokens, shuffle_buffer, shuffle_buffer_bytes = (
        int(shard_tokens),
        int(shuffle_buffer),
        int(shuffle_buffer_bytes),
    )
    val_fraction = float(val_fraction)
    workers, processes = _tokenizing_workers(workers)

    opened = open_source(source, text_field, hub)
    buffer = ShuffleBuffer(shuffle_buffer, shuffle_buffer_bytes, seed)
    order_seed = int(seed) if buffer.active else None  # --shuffle-buffer 0 keeps the source order entirely
    software = _software()
    options = request_options(
        train_tokens=train_tokens,
        val_fraction=val_fraction,
        shard_tokens=shard_tokens,
        seed=seed,
        shuffle_buffer=shuffle_buffer,
        shuffle_buffer_bytes=shuffle_buffer_bytes,
        text_field=text_field,
        eos=eos,
    )
    request = {"source": opened.identity, "tokenizer": str(tokenizer).strip(), "options": options,
               "software": software}

    def stream() -> Iterator[tuple[tuple[int, str], int]]:
        """((source position, text), documents the buffer held when it was emitted), in the prepared order."""
        return buffer.shuffle(((position, text), text) for position, text in opened.positioned(order_seed))

    def training_texts() -> Iterator[str]:
        return (text for (_, text), _ in stream() if split_of(text, val_fraction) == TRAIN)

    partial, recorded = _open_partial(out)
    try:
        if recorded is not None:
            partial.refuse_changes(recorded["request"], request)
            partial.refuse_changed_shards(recorded.get("state"), SPLITS)
        resolved = _tokenizer_of(tokenizer, eos, training_texts, hub, progress, partial, recorded)
        state = recorded["state"] if recorded is not None else None
        if recorded is None:
            _write_text(os.path.join(partial.path, TOKENIZER_FILE), resolved.json_text)
            partial.commit({"request": request, "tokenizer": resolved.identity, "state": None})
        elif progress and state is not None:
            _say_continuing(partial, state)
        if state is None or not state["complete"]:
            run = _PreparePass(partial, {"request": request, "tokenizer": resolved.identity}, resolved,
                               shard_tokens, train_tokens, (workers, processes), bar_mode, opened)
            with StopRequests().installed() as stops:
                state = run.tokenize_and_write(stream(), state, stops)
        manifest = _manifest(state, opened, order_seed, resolved, options, software, source, val_fraction,
                             train_tokens, val_warnings or small_val_warnings)
        _finish_folder(partial, manifest, resolved, recorded, (started, workers, processes), force, progress)
    except (PrepareInterrupted, KeyboardInterrupt):
        raise  # the committed state stays in the partial folder, to be continued
    except BaseException:
        _leave_after_failure(partial)
        raise
    finally:
        partial.close()
    return manifest


def _refuse_or_recover_out(out: str, force: bool) -> None:
    """Refuse an existing `out` without --force; put back or clean what an interrupted --force left."""
    if os.path.lexists(out) and not force:  # refused before any recovery: a refused prepare changes nothing
        raise DataError(f"{out} already exists: choose another --out or pass --force to replace it")
    for line in PartialFolder.recover_replaced(out, force):
        print(f"pilotrun prepare: {line}", file=sys.stderr)
    if os.path.lexists(out):
        if not force:
            raise DataError(f"{out} already exists: choose another --out or pass --force to replace it")
        _check_replaceable(out)


def _tokenizing_workers(workers: int) -> tuple[int, bool]:
    """(how many tokenize, whether they are processes) for --workers."""
    # 0: tokenizing threads on all cores in this process (no start-up, no pickling: best on a few cores);
    # 1: no thread at all (the reference path); N >= 2: N worker processes, past the GIL-bound main thread.
    processes = int(workers) >= 2
    return int(workers) or default_workers(), processes


def _leave_after_failure(partial: PartialFolder) -> None:
    """A refused or failed prepare that committed no shard leaves nothing behind; committed shards stay."""
    if partial.created and not _any_shard_committed(partial):
        partial.close()
        partial.discard()
    partial.put_back_untouched()  # a rerun refused before its first commit: the folder as it found it


def _software() -> dict[str, str]:
    """The versions the tokens depend on, part of the request a continued prepare must match."""
    import tokenizers

    return {"python": platform.python_version(), "tokenizers": tokenizers.__version__}


def _open_partial(out: str) -> tuple[PartialFolder, dict[str, Any] | None]:
    """`out`'s partial folder, opened (created, or found from an interrupted prepare: its record)."""
    parent = os.path.dirname(os.path.abspath(out))
    partial = PartialFolder(out)
    try:  # the folder first: an unwritable --out is refused before minutes of tokenizer training
        os.makedirs(parent, exist_ok=True)
        _remove_abandoned_partials(parent, os.path.basename(out))
        recorded = partial.open()
    except OSError as exc:
        raise DataError(f"--out {out}: cannot create the output folder ({exc.strerror or exc}: "
                        f"{exc.filename or parent})") from None
    return partial, recorded


def _say_continuing(partial: PartialFolder, state: dict[str, Any]) -> None:
    print(
        f"pilotrun prepare: continuing {partial.path} from document {state['documents_done']:,} "
        f"({sum(len(state['splits'][s]['shards']) for s in SPLITS)} shards committed)",
        file=sys.stderr,
    )


def _finish_folder(partial: PartialFolder, manifest: dict[str, Any], resolved: ResolvedTokenizer,
                   recorded: dict[str, Any] | None, run: tuple[float, int, bool], force: bool,
                   progress: bool) -> None:
    """Write the tokenizer, the manifest and build_info.json, keep only the data's files and rename the
    partial folder into place; `run`: (when the prepare started, its workers, whether they were processes)."""
    started, workers, processes = run
    _write_text(os.path.join(partial.path, TOKENIZER_FILE), resolved.json_text)
    _write_text(os.path.join(partial.path, METADATA_FILE), manifest_text(manifest))
    peak_mb = peak_resident_mb()
    _write_text(
        os.path.join(partial.path, BUILD_INFO_FILE),
        json.dumps(
            {
                "peak_rss_mb": round(peak_mb, 1),
                "seconds": round(time.perf_counter() - started, 3),
                "workers": workers,
                "tokenize": "processes" if processes else "threads",
                "worker_peak_rss_mb": round(children_peak_mb(), 1) if processes else None,
                "continued_from_document": None
                if recorded is None
                else recorded["state"] and recorded["state"]["documents_done"],
                "note": "measured on this machine: not part of the data's identity (metadata_sha256)",
            },
            indent=2,
        )
        + "\n",
    )
    partial.keep_only({TOKENIZER_FILE, METADATA_FILE, BUILD_INFO_FILE,
                       *(s["file"] for split in SPLITS for s in manifest["splits"][split]["shards"])})
    partial.finish(force)
    if progress:
        workers_mb = f"; each tokenizing process up to {children_peak_mb():,.0f} MiB" if processes else ""
        print(f"pilotrun prepare: peak resident memory {peak_mb:,.0f} MiB (this process{workers_mb})",
              file=sys.stderr)


def _any_shard_committed(partial: PartialFolder) -> bool:
    try:
        record = partial.read_progress()
    except DataError:
        return False
    state = record and record.get("state")
    return bool(state) and any(state["splits"][s]["shards"] for s in SPLITS)


def _tokenizer_of(spec: str, eos: str | None, training_texts, hub: HubClient | None, progress: bool,
                  partial: PartialFolder, recorded: dict[str, Any] | None) -> ResolvedTokenizer:
    """The tokenizer; on a continued prepare a trained BPE is the one stored in the partial folder (training
    it again would repeat a pass), and any other is resolved again and must match the recorded identity."""
    if recorded is not None and str(spec).strip().startswith("bpe:"):
        from tokenizers import Tokenizer

        path = os.path.join(partial.path, TOKENIZER_FILE)
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            raise DataError(f"{path} cannot be read ({exc.strerror or exc}): remove {partial.path} to start "
                            "over") from None
        if hashlib.sha256(text.encode("utf-8")).hexdigest() != recorded["tokenizer"]["sha256"]:
            raise DataError(f"{path} is not the tokenizer {partial.path}/progress.json records: remove "
                            f"{partial.path} to start over")
        return ResolvedTokenizer(Tokenizer.from_str(text), text, dict(recorded["tokenizer"]))
    resolved = resolve_tokenizer(spec, eos, training_texts, hub, progress)
    if recorded is not None:
        partial.refuse_changes({"tokenizer": recorded["tokenizer"]}, {"tokenizer": resolved.identity})
    return resolved


def _manifest(
    state: dict[str, Any],
    opened: OpenedSource,
    order_seed: int | None,
    resolved: ResolvedTokenizer,
    options: dict[str, Any],
    software: dict[str, str],
    source: str,
    val_fraction: float,
    train_tokens: int | None,
    val_warnings: Callable[[int], list[str]],
) -> dict[str, Any]:
    splits, stopped = state["result"], state["stopped"]
    if splits[TRAIN]["tokens"] == 0:
        raise DataError(f"source '{source}' gave no training documents (val_fraction={val_fraction})")
    if train_tokens is not None and not stopped:
        print(
            f"pilotrun prepare: warning: the source ended at {splits[TRAIN]['tokens']} training tokens, "
            "fewer "
            f"than --train-tokens {train_tokens} (the manifest records the real count)",
            file=sys.stderr,
        )
    for warning in val_warnings(splits[VAL]["tokens"]):
        print(f"pilotrun prepare: warning: {warning}", file=sys.stderr)
    return {
        "format": FORMAT,
        "source": opened.identity,
        "tokenizer": resolved.identity,
        "dtype": resolved.dtype,
        "options": options,
        "split_rule": SPLIT_RULE,
        "layout": LAYOUT,
        "stream": {
            "stopped_at_train_tokens": stopped,
            # Only a complete pass has a count that does not depend on how far ahead the reader got.
            "empty_documents_skipped": None if stopped else state["empty_documents_skipped"],
            "read_order": opened.order_record(order_seed),
            # Of the documents written: how much of the source order survived the unit order and the buffer.
            "order_correlation": OrderCorrelation(state["correlation"]).value(),
            "shuffle_buffer_peak_documents": state["peak_held"],
        },
        "software": software,
        "splits": splits,
    }


def prepared_line(out: str, manifest: dict[str, Any]) -> str:
    """What `pilotrun prepare` prints when done: the totals and the data's identity."""
    from pilotrun.data.shards import metadata_sha256

    splits = manifest["splits"]
    return (
        f"prepared {out}: train {splits['train']['tokens']} tokens in {splits['train']['documents']} "
        "documents, "
        f"val {splits['val']['tokens']} tokens in {splits['val']['documents']} documents, "
        f"vocab {manifest['tokenizer']['vocab_size']} ({manifest['dtype']}), order correlation with the "
        "source "
        f"{manifest['stream']['order_correlation']}, metadata_sha256 {metadata_sha256(manifest)}"
    )


def small_val_warnings(val_tokens: int, recipe: str = "stability") -> list[str]:
    """A warning when the val split is smaller than one evaluation of a packaged recipe (by default the CPU
    stability recipe `pilotrun pilot` runs): the evaluation would re-read the same few documents."""
    from pilotrun.config import load_run_config
    from pilotrun.data.reader import val_split_warnings

    t = load_run_config(recipe).train
    return val_split_warnings(val_tokens, t.batch_size, t.seq_len, t.eval.batches,
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
    """--force replaces a data folder (or an empty folder), never an arbitrary folder or file named by
    mistake."""
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


def _chunks(stream: Iterable[tuple[str, Any]]) -> Iterator[tuple[list[str], list[Any]]]:
    """(texts, what goes with each text) in chunks of about CHUNK_CHARACTERS."""
    texts: list[str] = []
    extras: list[Any] = []
    characters = 0
    for text, extra in stream:
        texts.append(text)
        extras.append(extra)
        characters += len(text)
        if characters >= CHUNK_CHARACTERS or len(texts) >= CHUNK_MAX_DOCUMENTS:
            yield texts, extras
            texts, extras, characters = [], [], 0
    if texts:
        yield texts, extras


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


def _encoded_in_order(
    chunks: Iterator[tuple[list[str], list[Any]]],
    resolved: ResolvedTokenizer,
    workers: int,
    processes: bool = False,
) -> Iterator[tuple[list[Any], np.ndarray, np.ndarray]]:
    """(extras, tokens, lengths) per chunk, in the order the chunks were read, whatever the worker count.

    By default workers are threads: `tokenizers` releases the GIL for the whole batch encode (the Rust side
    does all the work), so `workers` threads keep that many cores busy, with no process start-up, no re-import
    of the caller's main module (spawn) and no pickling of text. What holds the GIL (reading, JSON, the split
    hash, the id-list to array conversion) caps them on many cores; `processes` moves the encoding and the
    conversion into worker processes (tokenize_pool.py), leaving the main process only the GIL-bound
    reading."""
    if processes:
        from pilotrun.data.tokenize_pool import encoded_in_order

        yield from encoded_in_order(chunks, resolved.json_text, resolved.eos_id, resolved.dtype, workers)
        return
    from concurrent.futures import ThreadPoolExecutor

    # One encoder shared by the threads: its encode borrows it read-only (and without the GIL), so sharing is
    # safe. It is the very object whose serialization is stored as tokenizer.json (reloading that JSON would
    # cost a parse of the whole vocabulary and give the same tokenizer).
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


def _progress_bar(train_tokens: int | None, opened: OpenedSource | None, progress: bool | str):
    """The bar and how to read its position. With a --train-tokens cap it counts training tokens; without one,
    documents against the count a local file or the built-in corpus knows up front (so it has an ETA); a
    streamed source without a cap only counts. The position is clamped to the total: the last document may
    carry the training tokens past the cap, and the bar must not run past 100%."""
    expected = opened.expected_documents if opened is not None else None
    if train_tokens is None and expected:
        bar = open_bar(expected, "doc", "prepare (documents)", progress)
        return bar, lambda train, docs: min(docs + opened.skipped_empty, expected)
    bar = open_bar(train_tokens, "tok", "prepare (train tokens)", progress)
    if train_tokens is None:
        return bar, lambda train, docs: train
    return bar, lambda train, docs: min(train, train_tokens)


class _PreparePass:
    """The tokenizing pass: writes shards into the partial folder and commits its state after every chunk that
    completed a shard (and at a stop request), so that a rerun continues from there."""

    def __init__(self, partial: PartialFolder, header: dict[str, Any], resolved: ResolvedTokenizer,
                 shard_tokens: int, train_tokens: int | None, workers: tuple[int, bool], progress: str,
                 opened: OpenedSource) -> None:
        self.partial, self.header, self.resolved = partial, header, resolved
        self.train_tokens, self.workers, self.progress, self.opened = train_tokens, workers, progress, opened
        self.writers = {
            split: ShardWriter(partial.path, split, shard_tokens, resolved.dtype) for split in SPLITS
        }
        self.documents = dict.fromkeys(SPLITS, 0)
        self.tokens = dict.fromkeys(SPLITS, 0)
        self.correlation = OrderCorrelation()
        self.peak_held = 0
        self.stopped = False

    def restore(self, state: dict[str, Any]) -> int:
        """Back to a committed state (its shards checked on disk); returns the documents already written."""
        for split in SPLITS:
            for shard in state["splits"][split]["shards"]:
                check_shard(
                    os.path.join(self.partial.path, shard["file"]), self.resolved.dtype, shard["tokens"]
                )
            self.writers[split].restore(state["splits"][split])
        self.documents, self.tokens = dict(state["documents"]), dict(state["tokens"])
        self.correlation = OrderCorrelation(state["correlation"])
        self.peak_held = int(state["peak_held"])
        return int(state["documents_done"])

    def commit(self, complete: bool = False) -> dict[str, Any]:
        state = {
            "complete": complete,
            "documents_done": self.documents[TRAIN] + self.documents[VAL],
            "documents": dict(self.documents), "tokens": dict(self.tokens),
            "correlation": self.correlation.state(), "peak_held": self.peak_held,
            "splits": {split: writer.persist_checked() for split, writer in self.writers.items()},
            "stopped": self.stopped,
        }
        if complete:
            state["result"] = {split: {"documents": self.documents[split], "tokens": self.tokens[split],
                                       "shards": state["splits"][split]["shards"]} for split in SPLITS}
            state["empty_documents_skipped"] = None if self.stopped else self.opened.skipped_empty
        self.partial.commit({**self.header, "state": state},
                            [path for writer in self.writers.values() for path in writer.take_obsolete()])
        return state

    def tokenize_and_write(self, stream: Iterator[tuple[tuple[int, str], int]], state: dict[str, Any] | None,
                           stops: StopRequests) -> dict[str, Any]:
        done = self.restore(state) if state is not None else 0
        val_fraction = self.header["request"]["options"]["val_fraction"]
        train_tokens, tokens, documents = self.train_tokens, self.tokens, self.documents

        def remaining() -> Iterator[tuple[str, tuple[str, int, int]]]:
            # The documents already written are replayed through the same seeded buffer but never split or
            # tokenized: the buffer's state at the committed document is rebuilt exactly.
            for (position, text), held in itertools.islice(stream, done, None):
                yield text, (split_of(text, val_fraction), position, held)

        started = time.perf_counter()
        bar, bar_position = _progress_bar(train_tokens, self.opened, self.progress)
        encoded = _encoded_in_order(_chunks(remaining()), self.resolved, *self.workers)
        try:
            for extras, chunk_tokens, lengths in encoded:
                is_val = np.fromiter((split == VAL for split, _, _ in extras), dtype=bool, count=len(extras))
                if train_tokens is not None:
                    # The first training document that brings the total to train_tokens is the last one taken.
                    train_cumulative = tokens[TRAIN] + np.cumsum(np.where(is_val, 0, lengths))
                    reached = np.flatnonzero(~is_val & (train_cumulative >= train_tokens))
                    if len(reached):
                        keep = int(reached[0]) + 1
                        chunk_tokens = chunk_tokens[: int(lengths[:keep].sum())]
                        is_val, lengths, extras = is_val[:keep], lengths[:keep], extras[:keep]
                        self.stopped = True
                shards_before = sum(len(w.shards) for w in self.writers.values())
                token_is_val = np.repeat(is_val, lengths)
                for split, mask in ((TRAIN, ~token_is_val), (VAL, token_is_val)):
                    part = chunk_tokens[mask]
                    self.writers[split].add(part)
                    tokens[split] += len(part)
                documents[VAL] += int(is_val.sum())
                documents[TRAIN] += int((~is_val).sum())
                self.correlation.add(position for _, position, _ in extras)
                self.peak_held = max(self.peak_held, max(held for _, _, held in extras))
                written = documents[TRAIN] + documents[VAL]
                bar.update(bar_position(tokens[TRAIN], written) - bar.n)
                elapsed = max(time.perf_counter() - started, 1e-9)
                bar.set_postfix(
                    docs=written,
                    docs_per_s=f"{(written - done) / elapsed:.0f}",
                    val_tok=tokens[VAL],
                    refresh=False,
                )
                if self.stopped:
                    break
                if stops.signum is not None:
                    self.commit()
                    raise PrepareInterrupted(self._stop_line(stops), stops.signum)
                if sum(len(w.shards) for w in self.writers.values()) > shards_before:
                    self.commit()
        finally:
            encoded.close()  # stops the worker pool when we stop early
            bar.close()
        for split in SPLITS:
            shards = self.writers[split].close()
            if sum(s["tokens"] for s in shards) != tokens[split]:
                raise AssertionError(
                    f"internal: {split} shards hold a different token count than was written"
                )
        return self.commit(complete=True)

    def _stop_line(self, stops: StopRequests) -> str:
        shards = sum(len(w.shards) for w in self.writers.values())
        return (f"stopped by {signal_name(stops.signum)} after "
                f"{self.documents[TRAIN] + self.documents[VAL]:,} documents ({shards} shards committed in "
                f"{self.partial.path}): run the same command again to continue")
