"""Reading a mixture back: one checked dataset per source, and a loader that composes their cursors.

`open_data` takes what `--data` names: a prepared folder opens as today (a `TokenDataset`, read by a
`BatchLoader`: every existing run, record and test unchanged), a mixture file (data/mixture.py) as a
`MixedDataset` read by a `MixedLoader`. The sources must share one tokenizer (the same tokenizer.json sha256,
vocabulary and EOS id): a mixture of two vocabularies would train one embedding on two meanings of each id.

Layout of a mixed global batch b: the schedule gives each source its rows and a seeded permutation places
them among the batch's G = batch_size * world_size rows (MixtureSchedule.row_sources); source i's rows, in
the order of their global position, are its windows A_i(b), A_i(b) + 1, ... where A_i(b) is the rows it had
before b. Window m of a source is window m mod W_i of its train split (W_i = (tokens - 1) // seq_len, its
windows, the same overlapping-by-one layout as reader.py), in pass m div W_i: each source walks its own split
and restarts alone when it runs out. Rank r takes global rows r * batch_size .. (r + 1) * batch_size - 1, so
the stream depends on the global batch, never on the world size. The cursor state is the global batch index
and where the schedule last started (a weight change), so a resume continues bit for bit.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pilotrun.common.errors import DataError
from pilotrun.data.mixture import (
    MixtureSchedule,
    MixtureSpec,
    is_mixture_file,
    mixture_identity,
    parse_mixture,
)
from pilotrun.data.reader import MODES, TokenDataset, TokenSplit, check_data_fits_recipe, open_dataset
from pilotrun.data.shards import load_manifest, metadata_sha256
from pilotrun.data.stream import SPLITS
from pilotrun.data.windows import batches_per_pass


class MixedDataset:
    """The sources of a mixture, opened and checked, with the mixture's identity."""

    def __init__(self, spec: MixtureSpec, datasets: list[TokenDataset]) -> None:
        self.spec, self.datasets = spec, datasets
        self.names = [source.name for source in spec.sources]
        self.data_dir = spec.file
        first = datasets[0]
        for source, dataset in zip(spec.sources[1:], datasets[1:], strict=True):
            for what, ours, theirs in (
                (
                    "tokenizer sha256",
                    first.metadata["tokenizer"].get("sha256"),
                    dataset.metadata["tokenizer"].get("sha256"),
                ),
                ("vocab_size", first.vocab_size, dataset.vocab_size),
                ("eos_id", first.eos_id, dataset.eos_id),
            ):
                if ours != theirs:
                    raise DataError(
                        f"{spec.file}: sources {spec.sources[0].name} ({spec.sources[0].path}) and "
                        f"{source.name} ({source.path}) differ in {what} ({ours} vs {theirs}): a mixture "
                        "needs one tokenizer; prepare every source with the same --tokenizer"
                    )
        shas = [d.metadata_sha256 for d in datasets]
        for index, sha in enumerate(shas):
            if sha in shas[:index]:
                other = spec.sources[shas.index(sha)]
                raise DataError(
                    f"{spec.file}: sources {other.name} ({other.path}) and {spec.sources[index].name} "
                    f"({spec.sources[index].path}) are the same data (metadata_sha256 {sha[:12]}): the "
                    "same folder twice"
                )
        self.metadata_sha256 = mixture_identity(shas)
        self.vocab_size, self.eos_id = first.vocab_size, first.eos_id
        # tokenizer and options of the first source (the same tokenizer in all)
        self.metadata = first.metadata
        self.tokenizer_path = first.tokenizer_path

    def load_tokenizer(self):
        return self.datasets[0].load_tokenizer()

    def splits(self, name: str) -> list[TokenSplit]:
        return [dataset.split(name) for dataset in self.datasets]

    def mixture_section(self) -> dict[str, Any]:
        """What run.json, the checkpoints and the lock record of the mixture (compared on resume)."""
        return {"weights": list(self.spec.weights), "seed": self.spec.seed}

    def sources_section(self) -> list[dict[str, Any]]:
        rows = []
        for source, dataset in zip(self.spec.sources, self.datasets, strict=True):
            row: dict[str, Any] = {
                "name": source.name,
                "dir": os.path.realpath(source.path),
                "weight": source.weight,
                "metadata_sha256": dataset.metadata_sha256,
                "source": dataset.metadata.get("source"),
            }
            for split in SPLITS:
                row[split] = {"tokens": int(dataset.split(split).num_tokens),
                              "documents": int(dataset.split(split).documents)}
            rows.append(row)
        return rows


def open_data(path: str | os.PathLike) -> TokenDataset | MixedDataset:
    """A prepared folder (TokenDataset) or a mixture file (MixedDataset), as `--data` names it."""
    if not is_mixture_file(path):
        return open_dataset(path)
    spec = parse_mixture(path)
    # the mixture of one folder is that folder: the same record, cursor and identity
    if len(spec.sources) == 1:
        return open_dataset(spec.sources[0].path)
    return MixedDataset(spec, [open_dataset(source.path) for source in spec.sources])


def data_identity(path: str | os.PathLike) -> tuple[str, dict[str, Any] | None]:
    """(metadata_sha256, the mixture's weights and seed or None) of what `--data` names, from the manifests
    alone (what a frozen run is compared with its lock on before anything is opened)."""
    if not is_mixture_file(path):
        return metadata_sha256(load_manifest(path)), None
    spec = parse_mixture(path)
    shas = [metadata_sha256(load_manifest(source.path)) for source in spec.sources]
    if len(spec.sources) == 1:
        return shas[0], None
    return mixture_identity(shas), {"weights": list(spec.weights), "seed": spec.seed}


def all_splits(dataset: TokenDataset | MixedDataset, name: str) -> list[TokenSplit]:
    """Every source's split `name` (one for a folder)."""
    return dataset.splits(name) if isinstance(dataset, MixedDataset) else [dataset.split(name)]


def check_mixture_fits_recipe(dataset: MixedDataset, *, batch_size: int, seq_len: int, world_size: int,
                              evaluates: bool, vocab_size: int) -> None:
    """A source's train split needs one window (a small one restarts alone, as often as its weight asks); its
    val split one evaluation batch when the recipe evaluates (each source is evaluated on its own); its ids
    below the vocabulary (reader.check_data_fits_recipe)."""
    for source, member in zip(dataset.spec.sources, dataset.datasets, strict=True):
        if member.split("train").num_tokens < seq_len + 1:
            raise DataError(
                f"source {source.name} ({source.path}): the train split has "
                f"{member.split('train').num_tokens} tokens, fewer than one window of seq_len + 1 = "
                f"{seq_len + 1}"
            )
        check_data_fits_recipe(member, batch_size=batch_size, seq_len=seq_len, world_size=world_size,
                               evaluates=evaluates, vocab_size=vocab_size, train_needed=seq_len + 1)


def check_fits_recipe(dataset: TokenDataset | MixedDataset, config: Any, world_size: int) -> None:
    """The recipe's batch, window, evaluation and vocabulary fit its data: one folder's or every source's."""
    fits = check_mixture_fits_recipe if isinstance(dataset, MixedDataset) else check_data_fits_recipe
    fits(dataset, batch_size=config.train.batch_size, seq_len=config.train.seq_len, world_size=world_size,
         evaluates=config.train.eval.every > 0, vocab_size=config.model.vocab_size)


class MixedLoader:
    """The global cursor over a mixture (module docstring); the interface of reader.BatchLoader."""

    def __init__(
        self,
        dataset: MixedDataset,
        batch_size: int,
        seq_len: int,
        mode: str = "successive",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if mode not in MODES:
            raise DataError(f"data mode must be one of {MODES}, got '{mode}'")
        if batch_size < 1 or seq_len < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise DataError(
                f"batch_size {batch_size}, seq_len {seq_len}, rank {rank} of world size {world_size}: "
                "not a batch geometry"
            )
        self.dataset, self.names = dataset, dataset.names
        self.splits = dataset.splits("train")
        self.batch_size, self.seq_len, self.mode, self.rank, self.world_size = (
            batch_size,
            seq_len,
            mode,
            rank,
            world_size,
        )
        self.global_batch_windows = batch_size * world_size
        self.windows = [batches_per_pass(split.num_tokens, seq_len, 1) for split in self.splits]
        self.schedule = MixtureSchedule(dataset.spec.weights, dataset.spec.seed, self.global_batch_windows)
        self.batch_index = 0
        self.last_batch_restarted = 0  # source restarts during the last served batch (all ranks)
        self.last_batch_rows: list[int] = [0] * len(self.names)  # rows per source of the last served batch

    def _effective_batch(self, batch_index: int) -> int:
        return 0 if self.mode == "repeat_batch" else batch_index

    def passes(self, rows: list[int]) -> list[int]:
        """Completed restarts of each source after it has served `rows` rows."""
        return [max(0, (r - 1) // w) for r, w in zip(rows, self.windows, strict=True)]

    def rows_served(self, batch_index: int | None = None) -> list[int]:
        """Rows each source served before `batch_index` (default: the cursor) in successive mode."""
        return self.schedule.rows_before(
            self._effective_batch(self.batch_index if batch_index is None else batch_index)
        )

    @property
    def epoch(self) -> int:
        """The largest pass any source is in after the last served batch."""
        if self.batch_index == 0:
            return 0
        return max(self.passes(self.schedule.rows_before(self._effective_batch(self.batch_index - 1) + 1)))

    @property
    def restarts(self) -> int:
        return self.epoch

    def rows_of(self, batch_index: int) -> list[tuple[int, int, int]]:
        """(source, source row, global row) for every row of global batch `batch_index`, in global row
        order."""
        batch = self._effective_batch(batch_index)
        before = self.schedule.rows_before(batch)
        taken = [0] * len(self.names)
        rows = []
        for position, source in enumerate(self.schedule.row_sources(batch).tolist()):
            rows.append((source, before[source] + taken[source], position))
            taken[source] += 1
        return rows

    def _start(self, source: int, source_row: int) -> tuple[int, int]:
        """(pass, token start) of a source's row."""
        epoch, window = divmod(source_row, self.windows[source])
        return epoch, window * self.seq_len

    def next_batch(self):
        """(inputs, targets): int64 CPU tensors [batch_size, seq_len] of this rank's rows of the next global
        batch."""
        import torch

        batch_index = self.batch_index
        window = self.seq_len + 1
        rows = self.rows_of(batch_index)
        mine = rows[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        out = np.empty((self.batch_size, window), dtype=np.int64)
        for row, (source, source_row, _) in enumerate(mine):
            _, start = self._start(source, source_row)
            out[row] = self.splits[source].read(start, window)
            self.splits[source].check_ids(out[row], start)
        batch = self._effective_batch(batch_index)
        before, after = self.schedule.rows_before(batch), self.schedule.rows_before(batch + 1)
        self.last_batch_rows = [a - b for a, b in zip(after, before, strict=True)]
        restarted = sum(a - b for a, b in zip(self.passes(after), self.passes(before), strict=True))
        self.last_batch_restarted = restarted if self.mode == "successive" or batch_index == 0 else 0
        self.batch_index = batch_index + 1
        return torch.from_numpy(np.ascontiguousarray(out[:, :-1])), torch.from_numpy(
            np.ascontiguousarray(out[:, 1:])
        )

    def check_upcoming_batches(self, count: int) -> None:
        """Check the ids of the next `count` global batches, every rank's rows, without moving the cursor."""
        for batch_index in range(self.batch_index, self.batch_index + count):
            for source, source_row, _ in self.rows_of(batch_index):
                _, start = self._start(source, source_row)
                self.splits[source].check_ids(self.splits[source].read(start, self.seq_len + 1), start)

    def describe_batch(self, batch_index: int) -> list[dict[str, Any]]:
        """Every row of global batch `batch_index`, all ranks: its source, its row in that source and where
        the tokens came from (pure)."""
        if batch_index < 0:
            raise ValueError(f"batch_index must be >= 0, got {batch_index}")
        described = []
        for source, source_row, position in self.rows_of(batch_index):
            epoch, start = self._start(source, source_row)
            rank, row = divmod(position, self.batch_size)
            described.append({
                "rank": rank, "row": row, "source": self.names[source], "source_index": source,
                "source_row": source_row, "epoch": epoch, "window": start // self.seq_len, "start": start,
                "length": self.seq_len + 1, "pieces": self.splits[source].locate(start, self.seq_len + 1)})
        return described

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        rows = self.rows_served() if self.mode == "successive" else None
        return {
            # Each source's own cursor: the rows it has served and its restarts (derived; checked on load).
            "sources": None
            if rows is None
            else [{"rows": r, "restarts": p} for r, p in zip(rows, self.passes(rows), strict=True)],
            "batch_index": int(self.batch_index),
            "epoch": int(self.epoch),
            "restarts": int(self.restarts),
            "last_batch_restarted": int(self.last_batch_restarted),
            "last_batch_rows": list(self.last_batch_rows),
            "seq_len": int(self.seq_len),
            "global_batch_windows": int(self.global_batch_windows),
            "split_tokens": [int(split.num_tokens) for split in self.splits],
            "repeat_batch": int(self.mode == "repeat_batch"),
            "schedule": self.schedule.state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor. Where the saved weights differ from this loader's (a change allowed on resume),
        the schedule starts again at the restored batch from the rows each source had served: the change takes
        effect from the next batch."""
        expected = self.state_dict()
        for key in ("seq_len", "global_batch_windows", "split_tokens", "repeat_batch"):
            if state.get(key) != expected[key]:
                raise DataError(f"mixture cursor was saved with {key}={state.get(key)}, this loader has "
                                f"{expected[key]}: not the same data or batch geometry")
        batch_index = int(state["batch_index"])
        if batch_index < 0:
            raise DataError(f"mixture cursor has a negative batch_index {batch_index}")
        saved = state["schedule"]
        schedule = MixtureSchedule(saved["weights"], int(saved["seed"]), self.global_batch_windows,
                                   int(saved["start_batch"]), list(saved["start_rows"]))
        recorded = state.get("sources")
        if isinstance(recorded, list) and self.mode == "successive" and \
                [int(source["rows"]) for source in recorded] != schedule.rows_before(batch_index):
            raise DataError(
                f"mixture cursor at batch {batch_index}: the sources' recorded rows "
                f"{[source['rows'] for source in recorded]} are not what its schedule gives (another "
                "schedule or other sources): refused"
            )
        if [float(w) for w in saved["weights"]] != self.schedule.weights or int(
            saved["seed"]
        ) != self.schedule.seed:
            at = self._effective_batch(batch_index)
            schedule = MixtureSchedule(
                self.schedule.weights,
                self.schedule.seed,
                self.global_batch_windows,
                at,
                schedule.rows_before(at),
            )
        self.schedule = schedule
        self.batch_index = batch_index
        self.last_batch_restarted = int(state.get("last_batch_restarted", 0))
        self.last_batch_rows = [int(r) for r in state.get("last_batch_rows", [0] * len(self.names))]
