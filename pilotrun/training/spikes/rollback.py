"""What a spike does after its update: the `spike` event, and under `train.spike.policy=rollback` the
rollback.

The decision itself is made inside the update (detector.SpikeGate, every rank alike); this callback records it
and acts on it, right after the rare events and before the window's turn:
- record: the update was applied; the `spike` event names it with its figures and cause;
- skip: the update was not applied (reason "spike", counted as skipped: step and schedule stay); the `spike`
  event, with `skipped` true, is that skip's event in the record, as an `overflow` event is for fp16;
- rollback (PaLM's answer, done by hand there: back about 100 updates, 200-500 batches skipped): the spiking
  update is skipped, its window closed (a `train` event, so the work about to be rolled back is on the record
  as it happened), then the last committed checkpoint is restored into the running session exactly as a resume
  restores it (weights, optimizer, scaler, counters, cursor, update hooks' state, every RNG), and the data the
  spike came from is stepped over: the spiking update's batches, through the end of every document they read
  (however many updates it spans) and at least `margin` updates' worth after them. The skip is a record in the
  trainer state (detector.SpikeDetector.skip_data, beside the rollback count): the global batch range the
  loader steps over, the documents the spiking batches read (per source of a mixture: first and last document
  index, the token positions they span) and what the skipped batches read (data/skipped_documents.py);
  run.json's `skip_data` is rewritten with it. The updates between the checkpoint and the spike are redone on
  the same data, bit for bit; at the skipped range the cursor jumps. A `rollback` event carries the restored
  counters (the kept history goes on from there: summarize treats the work after the checkpoint as rolled
  back, as for a resume from an earlier step), the skipped range by cursor position, token count (never
  counted as seen) and documents, the updates to redo, and every range in force: a fresh run given them
  (`--set train.skip_data=...`, the event's `reproduce`) trains the same updates. Last, the restored step is
  committed again, with the new record and count in its trainer state: a session killed after that resumes
  past the spike's data, as the run that was not killed goes on (killed before it, the resumed session
  attempts the spiking update again from the older copy and rolls back the same way). The cap: the spike that
  would need rollback number `max_rollbacks + 1` stops the run ("stopped") instead.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pilotrun.data.skipped_documents import read_documents, spiking_documents
from pilotrun.training.callbacks.base import PRIORITY_SPIKE, Callback, LoopState
from pilotrun.training.checkpoint.retention import PROTECT_ROLLBACK
from pilotrun.training.checkpoint.rng_state import restore_rng_state
from pilotrun.training.precision import restore_grad_scaler
from pilotrun.training.session import group_settings, read_checkpoint, restore_group_settings, run_skip_data
from pilotrun.training.spikes.detector import SpikeVerdict
from pilotrun.training.spikes.restore_point import RestorePoint
from pilotrun.training.window import Window


class SpikeCallback(Callback):
    """Logs each spike and carries out a rollback. `close_window` and `reopen_window` are the window
    callback's (window_log.py), `commit` the checkpoint callback's synchronous save of the current step
    (checkpointing.py)."""

    priority = PRIORITY_SPIKE
    phase = "other"

    def __init__(self, close_window: Any, settle_checkpoint: Any = None, commit: Any = None,
                 reopen_window: Any = None) -> None:
        self.close_window, self.reopen_window = close_window, reopen_window
        # The checkpoint callback's: a background save in flight is committed first, so that the rollback
        # restores the newest state saved before the spike (and that save's meta predates the new skip range).
        self.settle_checkpoint = settle_checkpoint
        self.commit = commit

    def due(self, loop: LoopState) -> bool:
        return loop.update is not None and loop.update.spike is not None

    def after_update(self, loop: LoopState) -> None:
        verdict = loop.update.spike
        loop.log("spike", policy=loop.session.config.train.spike.policy,
                 **verdict.fields(loop.session.tokens_per_microbatch))
        loop.say(spike_line(verdict))
        if verdict.action == "rollback":
            if self.settle_checkpoint is not None:
                self.settle_checkpoint(loop)
            roll_back(loop, verdict, self.close_window, self.reopen_window, verdict.restore_point)
            if self.commit is not None:
                self.commit(loop)  # after the event: a checkpoint never holds a skip the record does not tell


def spike_line(verdict: SpikeVerdict) -> str:
    """The log's line for a spike as it happens: what exceeded which bound, the batches (the loader's cursor
    positions, as train.skip_data and the rollback line count them) and what the policy did."""
    figures = []
    for signal, value in (("loss", verdict.loss), ("grad_norm", verdict.grad_norm)):
        bound = verdict.bounds.get(signal, {}).get("bound")
        above = signal in verdict.signals
        limit = "" if bound is None else f" > bound {bound:.4g}" if above else f" (bound {bound:.4g})"
        figures.append(f"{signal.replace('_', ' ')} {value:.4g}{limit}")
    cause = (verdict.replay or {}).get("cause")
    said = {"recorded": "recorded, applied", "skipped": "skipped", "rollback": "rolling back",
            "stopped": "stopping the run"}[verdict.action]
    return (
        f"spike at update {verdict.step} (batches {', '.join(map(str, verdict.batches))}): "
        f"{'; '.join(figures)}"
        f" -> {said}" + (f"; cause {cause}" if cause else "") + (f"; {verdict.note}" if verdict.note else "")
    )


def skipped_range(loop: LoopState, verdict: SpikeVerdict, point: RestorePoint | None = None
                  ) -> dict[str, Any]:
    """The data a rollback steps over: the spiking update's batches and every document they read, to its end
    (the reader finds the EOS that ends them), and at least `margin` updates' worth after the spiking update's
    own. A long bad document spans many updates: skipping only the spiking batches and a fixed margin would
    meet the rest of it at once, spike again and use up the rollbacks; skipped to its end, one rollback clears
    it. On a `model_state` cause (`point`, restore_point.py) the range starts at the first batch of the
    suspect documents read since the newest checkpoint and runs through their end."""
    session = loop.session
    t = session.config.train
    loader, eos_id = session.state.loader, session.dataset.eos_id
    if point is None:
        first = verdict.batches[0]
        through, documents = spiking_documents(loader, verdict.batches, eos_id)
    else:
        first, through, documents = point.first_batch, point.through, point.documents
    batches = max(verdict.batches[-1] - first + 1 + t.spike.margin * t.gradient_accumulation_steps,
                  through - first + 1)
    return {"first_batch": first, "batches": batches, "tokens": batches * session.tokens_per_microbatch,
            "first_window": first * loader.global_batch_windows,
            "windows": batches * loader.global_batch_windows, "documents_through_batch": through,
            "documents": documents, "read": read_documents(loader, eos_id, first, batches)}


def roll_back(loop: LoopState, verdict: SpikeVerdict, close_window: Any, reopen_window: Any = None,
              point: RestorePoint | None = None) -> None:
    """Restore the last committed checkpoint, or on a `model_state` cause the one `point` names, and step over
    the spike's data (module docstring). Every rank."""
    session, state = loop.session, loop.session.state
    started = time.perf_counter()
    target = loop.last_checkpoint_step if point is None else point.step
    # what the kept timeline goes on from: never pruned
    session.checkpointer.protect(target, PROTECT_ROLLBACK)
    detector = loop.hook("spike")
    rollbacks, skip_data = detector.rollbacks + 1, list(detector.skip_data)
    before = state.counters()
    close_window(loop)  # the work about to be rolled back, on the record as it happened
    loop.window = Window(session.device)
    skipped = skipped_range(loop, verdict, point)

    settings = group_settings(session.optimizer)  # the effective recipe's (allowed changes included)
    restored = read_checkpoint(session, target)
    restore_group_settings(session.optimizer, settings)
    restore_grad_scaler(session.scaler, restored["scaler"])
    state.load_state_dict(restored["trainer"])
    restore_rng_state(restored["rng"])
    if reopen_window is not None:
        reopen_window(loop)  # the next window counts from the restored counters
    # The count and the skips survive the restore: they are the run's, not the checkpoint's.
    detector.rollbacks = rollbacks
    detector.skip_data = [
        *skip_data,
        {
            "origin": "rollback",
            "spike_step": verdict.step,
            **{k: skipped[k] for k in ("first_batch", "batches", "documents", "read")},
        },
    ]
    t = session.config.train
    ranges = detector.skip_ranges(t.skip_data)
    after = state.counters()
    loop.log("rollback", restored_step=target, spike_step=verdict.step, skipped=skipped,
             redo_updates=verdict.step - 1 - target,
             rolled_back={"updates": before.step - after.step, "attempted": before.updates_attempted
                          - after.updates_attempted, "tokens": before.tokens_seen - after.tokens_seen},
             rollbacks=rollbacks, max_rollbacks=t.spike.max_rollbacks, skip_data=ranges,
             reproduce="--set train.skip_data=" + json.dumps(ranges, separators=(",", ":")),
             **restore_fields(point), seconds=time.perf_counter() - started)
    if session.record is not None:
        session.record.data["skip_data"] = run_skip_data(session)
        session.record.save()
    named = "; ".join(
        f"{d.get('source', 'documents')} {d['first']}..{d['last']}" for d in skipped["documents"]
    )
    loop.say(f"spike at update {verdict.step}: rolled back to step {target}, skipping batches "
             f"{skipped['first_batch']}..{skipped['first_batch'] + skipped['batches'] - 1} "
             f"({skipped['tokens']:,} tokens; {whose(point)}: {named}); "
             f"rollback {rollbacks} of at most {t.spike.max_rollbacks}")


def restore_fields(point: RestorePoint | None) -> dict[str, Any]:
    """The rollback event's `restore` on a `model_state` cause: why it restored an older checkpoint than the
    newest (none on a `batch` cause, which restores the newest)."""
    if point is None:
        return {}
    return {"restore": {"cause": "model_state", "newest_checkpoint": point.newest_step,
                        "suspect_first_batch": point.first_batch}}


def whose(point: RestorePoint | None) -> str:
    """Which documents the rollback line says it steps over."""
    if point is None:
        return "the spiking batches' documents to their end"
    return f"cause model_state: the documents read since checkpoint step {point.newest_step} to their end"
