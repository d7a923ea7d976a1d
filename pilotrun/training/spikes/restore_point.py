"""Where a rollback goes back to when the spike's cause is the model's state, not its batch.

The replay (training/replay.py) calls the cause `model_state` when the spike recurs on the next batches too:
the weights were damaged by what the run read before the spiking update, not by the spiking batch. A small
model at a high learning rate fits a noise document while reading it, update by update, without a spike, and
the spike comes on the ordinary text after it. Restoring the newest checkpoint is then no answer when that
checkpoint was taken inside the bad document: the redone updates read the rest of it, the damage is done
again and the spike comes back, rollback after rollback, until the cap stops the run.

So on `model_state` the suspect documents are those read since the newest committed checkpoint, from the
document its cursor lies in (which may have begun before it) through the spiking batches' documents. The
rollback restores the newest committed checkpoint whose cursor lies at or before the first batch that reads
a suspect document, and steps over the suspect documents to their end. Each checkpoint's cursor is in its
meta (`batch_index`, session.checkpoint_meta), read without loading tensors; a checkpoint written before the
meta held it cannot be placed and is not chosen. With no checkpoint early enough the run stops, saying so in
one line, as the max_rollbacks cap stops it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pilotrun.data.mixed_reader import MixedLoader
from pilotrun.data.skipped_documents import segments, spiking_documents


@dataclass
class RestorePoint:
    """The checkpoint a `model_state` rollback restores and the data it steps over."""

    step: int  # the committed checkpoint restored
    newest_step: int  # the newest committed checkpoint, the one a `batch` cause restores
    first_batch: int  # the first global batch that reads a suspect document
    through: int  # the last global batch that reads a token of one of them
    documents: list[dict[str, Any]]  # the suspect documents, as spiking_documents names them


def checkpoint_cursors(checkpointer: Any, newest: int) -> dict[int, int | None]:
    """The loader cursor (the next global batch) each committed checkpoint up to `newest` recorded; None for
    one whose meta does not hold it."""
    cursors = {}
    for step in checkpointer.committed_steps():
        if step <= newest:
            cursor = checkpointer.meta(step).get("batch_index")
            cursors[step] = None if cursor is None else int(cursor)
    return cursors


def first_suspect_batch(loader: Any, cursor: int, documents: list[dict[str, Any]]) -> int:
    """The first global batch that reads a token of the suspect documents: walking back from `cursor` while
    the batch before reads inputs at or after a suspect document's first token in the same source and pass
    (as many batches as the document the cursor lies in has before it)."""
    starts = {(d.get("source"), d["pass"]): d["tokens"][0] for d in documents}
    names = loader.names if isinstance(loader, MixedLoader) else None

    def reads_suspect(batch: int) -> bool:
        for source, passed, _start, stop in segments(loader, batch, batch):
            key = (names[source] if names is not None else None, passed)
            if key in starts and stop - 1 > starts[key]:
                return True
        return False

    batch = cursor
    while batch > 0 and reads_suspect(batch - 1):
        batch -= 1
    return batch


def model_state_restore_point(session: Any, newest: int, spiking_batches: list[int]) -> RestorePoint | str:
    """The restore point of a `model_state` spike (module docstring), or the one line saying why there is
    none."""
    cursors = checkpoint_cursors(session.checkpointer, newest)
    cursor = cursors.get(newest)
    if cursor is None:
        return (f"the newest committed checkpoint (step {newest}) does not record its data cursor: the "
                "documents read since it cannot be placed, so no rollback can step over them")
    loader = session.state.loader
    through, documents = spiking_documents(loader, [cursor, *spiking_batches], session.dataset.eos_id)
    known = [c for c in cursors.values() if c is not None]
    first = first_suspect_batch(loader, cursor, documents)
    early = [step for step, c in cursors.items() if c is not None and c <= first]
    if not early:
        return (f"cause model_state: the documents read since checkpoint step {newest} began at batch "
                f"{first}, and no committed checkpoint lies before it (the oldest kept reads from batch "
                f"{min(known)}): no rollback can step over them")
    return RestorePoint(max(early), newest, first, through, documents)
