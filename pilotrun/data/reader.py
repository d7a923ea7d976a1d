"""Reading a prepared folder back: a checked dataset, token splits over memory-mapped shards, batch cursors.

`open_dataset` checks, before any training starts, that every shard named by the manifest exists with the
manifest's dtype, shape and file size, and that the shard totals add up to each split's total; the first
problem stops it with a `DataError` naming the file. (`pilotrun data verify` goes further and rehashes.) A
training session instead hashes each shard in the background when it first reads it:
`TokenSplit.watch_first_reads` is the hook, data/shard_hashing.py the hashing.

Window layout (fixed; `describe_batch` and inspect-batch rely on it): window `w` of a split is the `seq_len +
1` tokens starting at token `w * seq_len`. Consecutive windows overlap by one token, so every token after the
first is a target exactly once per epoch; windows run across document and shard boundaries. The split holds
`(num_tokens - 1) // seq_len` windows; `G = batch_size * world_size` windows make one global batch; the
incomplete tail (fewer than G windows) is dropped at each epoch's end.

Global batch `b` (counted from 0 over the whole run) is batch `k = b mod batches_per_epoch` of epoch `b div
batches_per_epoch` and consists of windows `k*G .. k*G + G - 1`; rank `r` takes windows `k*G + r*batch_size +
j` for `j < batch_size`. So a rank's rows are a pure function of (b, r, world_size), and the cursor state is
just `b` (plus the geometry it is valid for). In `repeat_batch` mode every call serves global batch 0 again,
while `b` still counts calls.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from pilotrun.common.errors import DataError
from pilotrun.common.files import sha256_of_file
from pilotrun.data.shards import TOKENIZER_FILE, check_shard, load_manifest, metadata_sha256
from pilotrun.data.stream import SPLITS
from pilotrun.data.windows import batches_per_pass

MODES = ("successive", "repeat_batch")


class TokenIdError(DataError):
    """A token id at or beyond the vocabulary in a shard: damaged data found while reading a batch."""


class TokenSplit:
    """One split's tokens as one logical 1-D array over its memory-mapped shards."""

    def __init__(self, name: str, data_dir: str, record: dict[str, Any], dtype: str,
                 vocab_size: int | None = None) -> None:
        self.name = name
        self.data_dir = data_dir
        self.dtype = np.dtype(dtype)
        self.vocab_size = vocab_size  # every id read must be below it (next_batch's guard); None: unchecked
        # per shard, as the manifest records it (None: not recorded)
        self.max_token_ids: list[int | None] = []
        # per shard, the manifest's hash of the file (what a reader checks)
        self.sha256s: list[str | None] = []
        self.files: list[str] = []
        # Shards not yet read since watch_first_reads: empty (one falsy test per read) when nobody watches.
        self._unread: set[int] = set()
        self._on_first_read: Callable[[TokenSplit, int], None] | None = None
        self._arrays: list[np.ndarray] = []
        # (shard, token): how often it occurs in the whole shard
        self._counts: dict[tuple[int, int], int] = {}
        starts = [0]
        for shard in record.get("shards", []):
            file = shard.get("file")
            if not isinstance(file, str) or os.path.basename(file) != file or not file.endswith(".npy"):
                raise DataError(f"{data_dir}: the manifest names an invalid shard file {file!r}")
            path = os.path.join(data_dir, file)
            header = check_shard(path, dtype, int(shard.get("tokens", -1)))
            self.files.append(file)
            self.max_token_ids.append(shard.get("max_token_id"))
            self.sha256s.append(shard.get("sha256"))
            if header.shape[0] > 0:
                self._arrays.append(np.memmap(path, dtype=dtype, mode="r", offset=header.data_offset,
                                              shape=header.shape))
            else:
                self._arrays.append(np.empty(0, dtype=dtype))
            starts.append(starts[-1] + header.shape[0])
        self._starts = np.asarray(starts, dtype=np.int64)
        self.num_tokens = int(starts[-1])
        if self.num_tokens != int(record.get("tokens", -1)):
            raise DataError(f"{data_dir}: the {name} shards hold {self.num_tokens} tokens, the manifest says "
                            f"{record.get('tokens')}")
        self.documents = int(record.get("documents", 0))

    def _pieces(self, start: int, length: int) -> list[tuple[int, int, int]]:
        """(shard index, offset, length) pieces holding tokens [start, start + length)."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"{self.name}: tokens [{start}, {start + length}) outside 0..{self.num_tokens}")
        pieces = []
        index = int(np.searchsorted(self._starts, start, side="right")) - 1
        position, remaining = start, length
        while remaining > 0:
            offset = position - int(self._starts[index])
            take = min(remaining, int(self._starts[index + 1]) - position)
            if take > 0:
                pieces.append((index, offset, take))
            position += take
            remaining -= take
            index += 1
        return pieces

    def watch_first_reads(self, on_first_read: Callable[[TokenSplit, int], None] | None) -> None:
        """From now on, call `on_first_read(split, shard_index)` the first time `read` takes tokens from each
        shard (None stops watching). The open does not rehash shards (too slow for large data); a watcher can
        check a shard's hash when training first reaches it, which costs the hot path one set lookup per
        read."""
        self._on_first_read = on_first_read
        self._unread = set(range(len(self.files))) if on_first_read is not None else set()

    def _first_reads(self, pieces: list[tuple[int, int, int]]) -> None:
        for index, _, _ in pieces:
            if index in self._unread:
                self._unread.discard(index)
                if self._on_first_read is not None:
                    self._on_first_read(self, index)

    def largest_token_id(self, index: int) -> int:
        """Shard `index`'s largest id: the manifest's record, or (an older manifest without one) one pass over
        it."""
        recorded = self.max_token_ids[index]
        if recorded is not None:
            return int(recorded)
        array = self._arrays[index]
        return int(array.max()) if len(array) else -1

    def check_ids(self, tokens: np.ndarray, start: int) -> None:
        """Refuse tokens [start, start + len(tokens)) if one is not a vocabulary id, naming shard and offset:
        a shard damaged after its manifest was written can still hold one, and the embedding would fail with a
        bare IndexError (or, on a GPU, a device-side assert) in the middle of a run."""
        if self.vocab_size is None or not len(tokens) or int(tokens.max()) < self.vocab_size:
            return
        position = start + int(np.argmax(tokens >= self.vocab_size))
        (file, offset, _), = self.locate(position, 1)
        raise TokenIdError(
            f"shard {os.path.join(self.data_dir, file)} holds token id {int(tokens[position - start])} "
            f"at offset {offset}, outside the vocabulary of {self.vocab_size}: the shard is "
            "damaged (run `pilotrun data verify`)"
        )

    def locate(self, start: int, length: int) -> list[tuple[str, int, int]]:
        """The (shard_file, offset, length) pieces that hold tokens [start, start + length)."""
        return [(self.files[index], offset, take) for index, offset, take in self._pieces(start, length)]

    def read(self, start: int, length: int) -> np.ndarray:
        """A copy of tokens [start, start + length), in the shards' dtype, across shard boundaries."""
        pieces = self._pieces(start, length)
        if self._unread and (len(pieces) != 1 or pieces[0][0] in self._unread):  # inline: once per row read
            self._first_reads(pieces)
        if len(pieces) == 1:  # the common case: one window inside one shard
            index, offset, take = pieces[0]
            return np.array(self._arrays[index][offset:offset + take])
        out = np.empty(length, dtype=self.dtype)
        filled = 0
        for index, offset, take in pieces:
            out[filled:filled + take] = self._arrays[index][offset:offset + take]
            filled += take
        return out

    def find(self, token: int, start: int, stop: int, chunk: int = 1 << 16) -> int | None:
        """The first position in [start, stop) that holds `token`, or None; scanned a chunk at a time straight
        from the shards (a look ahead, not a read of training data: no first-read watcher is told)."""
        position, stop = max(0, start), min(stop, self.num_tokens)
        while position < stop:
            for index, offset, take in self._pieces(position, min(chunk, stop - position)):
                hits = np.flatnonzero(self._arrays[index][offset:offset + take] == token)
                if len(hits):
                    return position + int(hits[0])
                position += take
        return None

    def rfind(self, token: int, start: int, stop: int, chunk: int = 1 << 16) -> int | None:
        """The last position in [start, stop) that holds `token`, or None (as `find`, scanning backwards)."""
        start, stop = max(0, start), min(stop, self.num_tokens)
        while stop > start:
            begin = max(start, stop - chunk)
            for index, offset, take in reversed(self._pieces(begin, stop - begin)):
                hits = np.flatnonzero(self._arrays[index][offset:offset + take] == token)
                if len(hits):
                    return int(self._starts[index]) + offset + int(hits[-1])
            stop = begin
        return None

    def count(self, token: int, start: int, stop: int, chunk: int = 1 << 22) -> int:
        """How many positions in [start, stop) hold `token` (as `find`: straight from the shards). A whole
        shard's count is kept, so that counting from the split's start again (a document's index: the EOS ids
        before it) reads only the shard the position is in."""
        start, stop = max(0, start), min(stop, self.num_tokens)
        total = 0
        for index, offset, take in self._pieces(start, max(0, stop - start)):
            array = self._arrays[index]
            whole = offset == 0 and take == len(array)
            if whole and (index, token) in self._counts:
                total += self._counts[(index, token)]
                continue
            found = sum(int(np.count_nonzero(array[o:min(o + chunk, offset + take)] == token))
                        for o in range(offset, offset + take, chunk))
            if whole:
                self._counts[(index, token)] = found
            total += found
        return total


class TokenDataset:
    def __init__(self, data_dir: str, manifest: dict[str, Any]) -> None:
        self.data_dir = data_dir
        self.metadata = manifest
        self.metadata_sha256 = metadata_sha256(manifest)
        tokenizer = manifest["tokenizer"]
        self.vocab_size = int(tokenizer["vocab_size"])
        self.eos_id = int(tokenizer["eos_id"])
        self.dtype = str(manifest["dtype"])
        if self.dtype not in ("uint16", "uint32"):
            raise DataError(f"{data_dir}: unsupported token dtype '{self.dtype}' in the manifest")
        self._splits = {}
        for name in SPLITS:
            if name not in manifest["splits"]:
                raise DataError(f"{data_dir}: the manifest has no '{name}' split")
            self._splits[name] = TokenSplit(
                name, data_dir, manifest["splits"][name], self.dtype, self.vocab_size
            )
        self.tokenizer_path = os.path.join(data_dir, TOKENIZER_FILE)
        if not os.path.isfile(self.tokenizer_path):
            raise DataError(f"{self.tokenizer_path} is missing")
        if sha256_of_file(self.tokenizer_path) != tokenizer.get("sha256"):
            raise DataError(f"{self.tokenizer_path} does not match the manifest's tokenizer sha256")

    def split(self, name: str) -> TokenSplit:
        if name not in self._splits:
            raise DataError(f"no split '{name}' (splits: {', '.join(SPLITS)})")
        return self._splits[name]

    def load_tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(self.tokenizer_path)


def windows_needed_tokens(batch_size: int, seq_len: int, world_size: int) -> int:
    """Tokens a split needs for one global batch in the window layout above: G windows of seq_len + 1 tokens
    that overlap by one, so G * seq_len + 1."""
    return batch_size * world_size * seq_len + 1


def tokens_per_evaluation(batch_size: int, seq_len: int, eval_batches: int, world_size: int = 1) -> int:
    """Distinct val tokens one evaluation reads: `eval_batches` global batches of windows `seq_len` apart,
    each window reading seq_len + 1 tokens (inputs and shifted targets); the reader restarts val when it runs
    out."""
    return eval_batches * batch_size * world_size * seq_len + 1


def val_split_warnings(val_tokens: int, batch_size: int, seq_len: int, eval_batches: int, world_size: int = 1,
                       what: str = "this recipe") -> list[str]:
    """A warning when one evaluation needs more val tokens than the split holds: the evaluation then re-reads
    the same documents, and its loss is measured on fewer distinct tokens than it appears to be."""
    needed = tokens_per_evaluation(batch_size, seq_len, eval_batches, world_size)
    if val_tokens >= needed:
        return []
    if val_tokens == 0:
        return [f"the val split is empty: no evaluation of {what} is possible (it needs {needed:,} tokens); "
                "prepare more data or a larger --val-fraction"]
    return [
        f"the val split holds {val_tokens:,} tokens, fewer than one evaluation of {what} reads "
        f"(eval_batches {eval_batches} x batch_size {batch_size} x world_size {world_size} x seq_len "
        f"{seq_len} "
        f"+ 1 = {needed:,}): each evaluation re-reads val {needed / max(val_tokens, 1):.1f}x; prepare more "
        "data or a larger --val-fraction, or lower train.eval.batches"
    ]


def check_data_fits_recipe(dataset: TokenDataset, *, batch_size: int, seq_len: int, world_size: int,
                           evaluates: bool, vocab_size: int, train_needed: int | None = None) -> None:
    """Refuse, before a run folder is written, data the recipe cannot use to the end: a train split without
    one global batch, a val split without one evaluation batch when the recipe evaluates (otherwise found only
    at the first evaluation, `train.eval.every` updates later), and shards whose largest id is not below the
    model's vocab_size. Largest ids come from the manifest; an older manifest without them costs one read of
    each shard here. `train_needed` replaces the train split's need of one global batch (a mixture's source
    needs one window: it restarts alone)."""
    needed = windows_needed_tokens(batch_size, seq_len, world_size)
    for name, required in (("train", train_needed is None), ("val", evaluates)):
        split = dataset.split(name)
        if required and split.num_tokens < needed:
            purpose = (
                "one training batch" if name == "train" else "one evaluation batch (train.eval.every > 0)"
            )
            raise DataError(
                f"{dataset.data_dir}: the {name} split has {split.num_tokens} tokens, fewer than the "
                f"{needed} of {purpose} of batch_size {batch_size} x world size {world_size} windows "
                f"of seq_len + 1 = {seq_len + 1} tokens; prepare more data or use smaller batches"
            )
    # The data's own vocabulary is never larger than the model's (the trainer refuses that): ids must be below
    # both, and below the data's is what the per-batch guard checks too.
    limit, limit_name = min((vocab_size, "model.vocab_size"), (dataset.vocab_size, "the data's vocab_size"))
    for name in SPLITS:
        split = dataset.split(name)
        for index, file in enumerate(split.files):
            largest = split.largest_token_id(index)
            if largest >= limit:
                raise DataError(
                    f"shard {os.path.join(dataset.data_dir, file)} holds token id {largest}, not below "
                    f"{limit_name} {limit}: the shard is damaged (run `pilotrun data verify`)"
                )


def open_dataset(data_dir: str | os.PathLike) -> TokenDataset:
    data_dir = os.fspath(data_dir)
    return TokenDataset(data_dir, load_manifest(data_dir))


class BatchLoader:
    """Sequential global cursor over one split; see the module docstring for the exact layout."""

    def __init__(
        self,
        split: TokenSplit,
        batch_size: int,
        seq_len: int,
        mode: str = "successive",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if mode not in MODES:
            raise DataError(f"data mode must be one of {MODES}, got '{mode}'")
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not within world size {world_size}")
        self.split, self.batch_size, self.seq_len, self.mode = split, batch_size, seq_len, mode
        self.rank, self.world_size = rank, world_size
        self.global_batch_windows = batch_size * world_size
        self.batches_per_epoch = batches_per_pass(split.num_tokens, seq_len, self.global_batch_windows)
        if self.batches_per_epoch == 0:
            raise DataError(
                f"the {split.name} split has {split.num_tokens} tokens: fewer than one global batch of "
                f"{self.global_batch_windows} windows of {seq_len + 1} tokens (batch_size * world_size "
                f"sequences); prepare more data or use smaller batches")
        self.batch_index = 0  # the next global batch to serve
        self.last_batch_restarted = False

    # ------------------------------------------------------------------ position
    def _effective_batch(self, batch_index: int) -> tuple[int, int]:
        """(epoch, batch within epoch) that global batch `batch_index` reads."""
        if self.mode == "repeat_batch":
            return 0, 0
        return divmod(batch_index, self.batches_per_epoch)

    @property
    def epoch(self) -> int:
        """Epoch of the most recently served batch (0 before any)."""
        return self._effective_batch(self.batch_index - 1)[0] if self.batch_index > 0 else 0

    @property
    def restarts(self) -> int:
        """Times the split was exhausted and the cursor went back to its beginning."""
        return self.epoch

    def _window_starts(self, batch_index: int, rank: int) -> list[int]:
        _, k = self._effective_batch(batch_index)
        first = k * self.global_batch_windows + rank * self.batch_size
        return [(first + j) * self.seq_len for j in range(self.batch_size)]

    # ------------------------------------------------------------------ reading
    def next_batch(self):
        """(inputs, targets): int64 CPU tensors [batch_size, seq_len] of this rank's rows of the next global
        batch."""
        import torch

        batch_index = self.batch_index
        epoch, k = self._effective_batch(batch_index)
        window = self.seq_len + 1
        rows = np.empty((self.batch_size, window), dtype=np.int64)
        for row, start in enumerate(self._window_starts(batch_index, self.rank)):
            rows[row] = self.split.read(start, window)
            self.split.check_ids(rows[row], start)  # before the cursor moves: a refused batch is not consumed
        self.batch_index = batch_index + 1
        self.last_batch_restarted = epoch > 0 and k == 0
        inputs = torch.from_numpy(np.ascontiguousarray(rows[:, :-1]))
        targets = torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))
        return inputs, targets

    def check_upcoming_batches(self, count: int) -> None:
        """Check the ids of the next `count` global batches, every rank's rows, without moving the cursor:
        TokenIdError names shard and offset. Called at an update boundary, it lets a trainer stop with the
        state of its last applied update intact (and every rank agreeing, since each checks all ranks' rows),
        where next_batch's own guard would fire in the middle of an update."""
        for batch_index in range(self.batch_index, self.batch_index + count):
            _, k = self._effective_batch(batch_index)
            first = k * self.global_batch_windows * self.seq_len
            length = self.global_batch_windows * self.seq_len + 1  # the batch's windows, overlaps included
            self.split.check_ids(self.split.read(first, length), first)

    def describe_batch(self, batch_index: int) -> list[dict[str, Any]]:
        """Every row of global batch `batch_index`, all ranks: which tokens it read and from where (pure)."""
        if batch_index < 0:
            raise ValueError(f"batch_index must be >= 0, got {batch_index}")
        epoch, k = self._effective_batch(batch_index)
        rows = []
        for rank in range(self.world_size):
            for row, start in enumerate(self._window_starts(batch_index, rank)):
                rows.append({
                    "rank": rank, "row": row, "epoch": epoch, "window": start // self.seq_len, "start": start,
                    "length": self.seq_len + 1, "pieces": self.split.locate(start, self.seq_len + 1),
                })
        return rows

    def _same_window_index(self, saved_index: int, saved_windows: int) -> int:
        """The global batch index that starts at the window where a cursor saved with another global batch
        (`saved_windows` windows; a resume that changed train.batch_size, allowed on resume) would read next,
        in the same epoch: the run goes on through the very tokens it would have read, in bigger or smaller
        batches. Refused where no batch of this size starts there."""
        if saved_windows < 1:
            raise DataError(f"{self.split.name} cursor was saved with global_batch_windows={saved_windows}")
        if self.mode == "repeat_batch":
            return saved_index
        windows = (self.split.num_tokens - 1) // self.seq_len
        epoch, batch = divmod(saved_index, windows // saved_windows)
        window = batch * saved_windows
        new_batch, offset = divmod(window, self.global_batch_windows)
        if offset or new_batch >= self.batches_per_epoch:
            raise DataError(
                f"{self.split.name} cursor was saved with global batches of {saved_windows} windows at "
                f"window {window} of epoch {epoch}: no global batch of {self.global_batch_windows} windows "
                "starts there, so the data cannot continue where it stopped with this batch geometry")
        return epoch * self.batches_per_epoch + new_batch

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, int]:
        return {
            "batch_index": int(self.batch_index),
            "epoch": int(self.epoch),
            "restarts": int(self.restarts),
            "last_batch_restarted": int(self.last_batch_restarted),
            "seq_len": int(self.seq_len),
            "global_batch_windows": int(self.global_batch_windows),
            "split_tokens": int(self.split.num_tokens),
            "repeat_batch": int(self.mode == "repeat_batch"),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = self.state_dict()
        for key in ("seq_len", "split_tokens", "repeat_batch"):
            if int(state.get(key, -1)) != expected[key]:
                raise DataError(
                    f"{self.split.name} cursor was saved with {key}={state.get(key)}, this loader has "
                    f"{expected[key]}: not the same data or batch geometry"
                )
        batch_index = int(state["batch_index"])
        if batch_index < 0:
            raise DataError(f"{self.split.name} cursor has a negative batch_index {batch_index}")
        saved_windows = int(state.get("global_batch_windows", -1))
        if saved_windows != self.global_batch_windows:
            batch_index = self._same_window_index(batch_index, saved_windows)
        self.batch_index = batch_index
        self.last_batch_restarted = bool(int(state.get("last_batch_restarted", 0)))
        if int(state.get("epoch", self.epoch)) != self.epoch:
            raise DataError(
                f"{self.split.name} cursor state is inconsistent: epoch {state.get('epoch')} at batch "
                f"{batch_index}, expected {self.epoch}"
            )
