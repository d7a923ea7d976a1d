"""Which documents global batches read: what a spike's rollback steps over and what the record names of it.

A spike's cause is the documents its batches read, and a long bad document goes on for many batches after the
spiking one: the rollback steps over the spiking batches' documents to their end (`spiking_documents` finds
the batch that holds their last token), and the record names them by document and token position
(`read_documents` for everything the stepped-over batches read), so that a reader of run.json can say which
documents the model never saw. Documents are counted per source's train split in stream order from 0: every
document is followed by its EOS (data/prepare.py), so the document holding token p is the number of EOS ids
before p.

Token ranges follow the loaders' layouts (reader.py, mixed_reader.py). A folder's global batch k of an epoch
reads tokens [k * span, (k + 1) * span + 1) of its split (span = G * seq_len; the last is the next batch's
first input too); a mixture's source reads its windows in row order, consecutive rows of one pass consecutive
windows. A range of batches that crosses an epoch (a source's pass) is one segment per pass: the next pass
reads the split from its start again. In repeat_batch mode every batch is batch 0.
"""

from __future__ import annotations

from typing import Any

from pilotrun.data.mixed_reader import MixedLoader
from pilotrun.data.reader import BatchLoader, TokenSplit

# (source index, pass, first token, end token): tokens [first, end) of one source's split read in one pass.
Segment = tuple[int, int, int, int]


def _splits(loader: BatchLoader | MixedLoader) -> list[TokenSplit]:
    return loader.splits if isinstance(loader, MixedLoader) else [loader.split]


def _source(loader: BatchLoader | MixedLoader, index: int) -> dict[str, Any]:
    """A mixture names the source; a folder has one and names none."""
    return {"source": loader.names[index]} if isinstance(loader, MixedLoader) else {}


def segments(loader: BatchLoader | MixedLoader, first_batch: int, last_batch: int) -> list[Segment]:
    """The token ranges global batches first_batch .. last_batch read, per source and pass, in order."""
    seq = loader.seq_len
    if isinstance(loader, MixedLoader):
        before = (
            loader.rows_served(first_batch) if loader.mode == "successive" else loader.schedule.rows_before(0)
        )
        after = (
            loader.rows_served(last_batch + 1)
            if loader.mode == "successive"
            else loader.schedule.rows_before(1)
        )
        out = []
        for source, (row, end) in enumerate(zip(before, after, strict=True)):
            windows = loader.windows[source]
            while row < end:
                passed = row // windows
                stop = min(end, (passed + 1) * windows)
                out.append(
                    (source, passed, (row - passed * windows) * seq, (stop - passed * windows) * seq + 1)
                )
                row = stop
        return out
    span = loader.global_batch_windows * seq
    if loader.mode == "repeat_batch":
        return [(0, 0, 0, span + 1)]
    per_epoch, out, batch = loader.batches_per_epoch, [], first_batch
    while batch <= last_batch:
        epoch, k = divmod(batch, per_epoch)
        k_last = min(last_batch - epoch * per_epoch, per_epoch - 1)
        out.append((0, epoch, k * span, (k_last + 1) * span + 1))
        batch = epoch * per_epoch + k_last + 1
    return out


def document_index(split: TokenSplit, eos_id: int, position: int) -> int:
    """The index of the document that holds token `position` (the EOS ids before it)."""
    return split.count(eos_id, 0, position)


def _pass_tokens(loader: BatchLoader | MixedLoader, source: int) -> int:
    """Tokens one pass (epoch) of a source reads: its windows' extent; a document open at its end ends
    there."""
    if isinstance(loader, MixedLoader):
        return loader.windows[source] * loader.seq_len + 1
    return loader.batches_per_epoch * loader.global_batch_windows * loader.seq_len + 1


def _batch_holding(loader: BatchLoader | MixedLoader, batch: int, source: int, passed: int, end: int) -> int:
    """The global batch (at or after `batch`) whose targets hold token end - 1 of a source's pass."""
    seq = loader.seq_len
    if isinstance(loader, MixedLoader):
        window = min(max(0, (end - 2) // seq), loader.windows[source] - 1)
        row = passed * loader.windows[source] + window
        if loader.mode != "successive" or loader.rows_served(batch + 1)[source] > row:
            return batch
        low, high = batch, batch + 1  # rows_served(low + 1) <= row < rows_served(high + 1)
        while loader.rows_served(high + 1)[source] <= row:
            low, high = high, high + 2 * (high - batch)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if loader.rows_served(middle + 1)[source] <= row else (low, middle)
        return high
    span = loader.global_batch_windows * seq
    k = min(max(batch % loader.batches_per_epoch, (end - 2) // span), loader.batches_per_epoch - 1)
    return passed * loader.batches_per_epoch + k


def spiking_documents(loader: BatchLoader | MixedLoader, batches: list[int], eos_id: int
                      ) -> tuple[int, list[dict[str, Any]]]:
    """(the last global batch that reads a token of the documents `batches` read, those documents). The
    documents a batch reads of a source end at the first EOS at or after its last target token there, or at
    the end of the pass (its dropped tail: the next pass starts the split again). Each entry: source (a
    mixture's), pass, the first and last document index, and `tokens`, the positions they span: [first one's
    start, last one's end)."""
    through, found = max(batches), []
    for batch in batches:
        for source, passed, start, stop in segments(loader, batch, batch):
            split = _splits(loader)[source]
            if loader.mode == "repeat_batch":
                end = stop
            else:
                eos = split.find(eos_id, stop - 1, _pass_tokens(loader, source))
                end = eos + 1 if eos is not None else _pass_tokens(loader, source)
                through = max(through, _batch_holding(loader, batch, source, passed, end))
            before = split.rfind(eos_id, 0, start)
            found.append(
                {
                    **_source(loader, source),
                    "pass": passed,
                    "first": document_index(split, eos_id, start),
                    "last": document_index(split, eos_id, end - 1),
                    "tokens": [0 if before is None else before + 1, end],
                }
            )
    return through, merged(found)


def merged(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per source and pass: the documents of several batches joined (they are consecutive)."""
    out: dict[tuple[Any, int], dict[str, Any]] = {}
    for entry in entries:
        key = (entry.get("source"), entry["pass"])
        if key not in out:
            out[key] = dict(entry, tokens=list(entry["tokens"]))
            continue
        kept = out[key]
        kept["first"], kept["last"] = min(kept["first"], entry["first"]), max(kept["last"], entry["last"])
        kept["tokens"] = [
            min(kept["tokens"][0], entry["tokens"][0]),
            max(kept["tokens"][1], entry["tokens"][1]),
        ]
    return list(out.values())


def read_documents(loader: BatchLoader | MixedLoader, eos_id: int, first_batch: int, batches: int
                   ) -> list[dict[str, Any]]:
    """What global batches first_batch .. first_batch + batches - 1 read, per source (a mixture's) and pass:
    `tokens` [start, end) and `documents` [first, last], the indices of the documents those tokens belong to
    (the first and the last may go on outside the range; every one between lies wholly inside it)."""
    out = []
    for source, passed, start, stop in segments(loader, first_batch, first_batch + batches - 1):
        split = _splits(loader)[source]
        out.append(
            {
                **_source(loader, source),
                "pass": passed,
                "tokens": [start, stop],
                "documents": [document_index(split, eos_id, start), document_index(split, eos_id, stop - 1)],
            }
        )
    return out
