"""What a spike does after its update: the `spike` event, and under `train.spike.policy=rollback` the rollback.

The decision itself is made inside the update (spikes.SpikeGate, every rank alike); this callback records it
and acts on it, right after the rare events and before the window's turn:
- record: the update was applied; the `spike` event names it with its figures and cause;
- skip: the update was not applied (reason "spike", counted as skipped: step and schedule stay); the `spike`
  event, with `skipped` true, is that skip's event in the record, as an `overflow` event is for fp16;
- rollback (PaLM's answer, done by hand there: back about 100 updates, 200-500 batches skipped): the spiking
  update is skipped, its window closed (a `train` event, so the work about to be rolled back is on the record
  as it happened), then the last committed checkpoint is restored into the running session exactly as a resume
  restores it (weights, optimizer, scaler, counters, cursor, update hooks' state, every RNG), the spiking
  update's batches, through the end of every document they read (however many updates it spans) and at least
  `margin` updates' worth after them, join `train.skip_data`, and training continues. The
  updates between the checkpoint and the spike are redone on the same data, bit for bit; at the skipped range
  the cursor jumps. A `rollback` event carries the restored counters (the kept history goes on from there:
  summarize treats the work after the checkpoint as rolled back, as for a resume from an earlier step), the
  skipped range by cursor position and token count (never counted as seen), the updates to redo, and the whole
  `skip_data` list: a fresh run given that list (`--set train.skip_data=...`) trains the same updates.
The cap: the spike that would need rollback number `max_rollbacks + 1` stops the run ("stopped") instead.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from pilotrun.training.callbacks.base import PRIORITY_SPIKE, Callback, LoopState
from pilotrun.training.checkpoint.retention import PROTECT_ROLLBACK
from pilotrun.training.checkpoint.rng_state import restore_rng_state
from pilotrun.training.session import group_settings, read_checkpoint, restore_group_settings
from pilotrun.training.spikes import SpikeVerdict
from pilotrun.training.window import Window


class SpikeCallback(Callback):
    """Logs each spike and carries out a rollback. `close_window` is the window callback's (window_log.py)."""

    priority = PRIORITY_SPIKE
    phase = "other"

    def __init__(self, close_window: Any, settle_checkpoint: Any = None) -> None:
        self.close_window = close_window
        # The checkpoint callback's: a background save in flight is committed first, so that the rollback
        # restores the newest state saved before the spike (and that save's meta predates the new skip range).
        self.settle_checkpoint = settle_checkpoint

    def due(self, loop: LoopState) -> bool:
        return loop.update is not None and loop.update.spike is not None

    def after_update(self, loop: LoopState) -> None:
        verdict = loop.update.spike
        loop.log("spike", policy=loop.session.config.train.spike.policy,
                 **verdict.fields(loop.session.tokens_per_microbatch))
        if verdict.action == "rollback":
            if self.settle_checkpoint is not None:
                self.settle_checkpoint(loop)
            roll_back(loop, verdict, self.close_window)


def skipped_range(loop: LoopState, verdict: SpikeVerdict) -> dict[str, Any]:
    """The data a rollback steps over: the spiking update's batches and every document they read, to its end (the
    reader finds the EOS that ends them), and at least `margin` updates' worth after the spiking update's own.
    A long bad document spans many updates: skipping only the spiking batches and a fixed margin would meet the
    rest of it at once, spike again and use up the rollbacks; skipped to its end, one rollback clears it."""
    session = loop.session
    t = session.config.train
    loader = session.state.loader
    first = verdict.batches[0]
    through, end_token = max(loader.documents_end(b, session.dataset.eos_id) for b in verdict.batches)
    batches = max(verdict.batches[-1] - first + 1 + t.spike.margin * t.gradient_accumulation_steps,
                  through - first + 1)
    return {"first_batch": first, "batches": batches, "tokens": batches * session.tokens_per_microbatch,
            "first_window": first * loader.global_batch_windows,
            "windows": batches * loader.global_batch_windows,
            "documents_through_batch": through, "documents_end_token": end_token}


def roll_back(loop: LoopState, verdict: SpikeVerdict, close_window: Any) -> None:
    """Restore the last committed checkpoint and step over the spike's data (module docstring). Every rank."""
    session, state = loop.session, loop.session.state
    started = time.perf_counter()
    target = loop.last_checkpoint_step
    session.checkpointer.protect(target, PROTECT_ROLLBACK)  # what the kept timeline goes on from: never pruned
    detector = loop.hook("spike")
    rollbacks = detector.rollbacks + 1
    before = state.counters()
    close_window(loop)  # the work about to be rolled back, on the record as it happened
    loop.window = Window(session.device)
    skipped = skipped_range(loop, verdict)

    settings = group_settings(session.optimizer)  # the effective recipe's (allowed changes included)
    restored = read_checkpoint(session, target)
    restore_group_settings(session.optimizer, settings)
    session.scaler.load_state_dict(restored["scaler"])
    state.load_state_dict(restored["trainer"])
    restore_rng_state(restored["rng"])
    detector.rollbacks = rollbacks  # the count survives the restore: it is the run's, not the checkpoint's
    t = session.config.train
    train = dataclasses.replace(t, skip_data=[*t.skip_data, [skipped["first_batch"], skipped["batches"]]])
    session.config = dataclasses.replace(session.config, train=train)  # later checkpoints record it too
    after = state.counters()
    loop.log("rollback", restored_step=target, spike_step=verdict.step, skipped=skipped,
             redo_updates=verdict.step - 1 - target,
             rolled_back={"updates": before.step - after.step, "attempted": before.updates_attempted
                          - after.updates_attempted, "tokens": before.tokens_seen - after.tokens_seen},
             rollbacks=rollbacks, max_rollbacks=t.spike.max_rollbacks, skip_data=train.skip_data,
             reproduce="--set train.skip_data=" + json.dumps(train.skip_data, separators=(",", ":")),
             seconds=time.perf_counter() - started)
    loop.say(f"spike at update {verdict.step}: rolled back to step {target}, skipping batches "
             f"{skipped['first_batch']}..{skipped['first_batch'] + skipped['batches'] - 1} "
             f"({skipped['tokens']:,} tokens); rollback {rollbacks} of at most {t.spike.max_rollbacks}")
