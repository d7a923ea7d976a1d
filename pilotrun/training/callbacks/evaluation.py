"""Evaluation: the mean cross-entropy of the first `train.eval_batches` batches of the val split, every
`train.eval_every` applied updates, logged as a `val` event; the "eval" phase.

The same batches every time, so the values are comparable across a run and across its sessions. The model is
put in eval mode (no per-step statistic or tracker moves), no gradient is kept, the training precision is
used, and nothing draws from a random generator or moves the training loader: an evaluation leaves the
training exactly as it was (tests/training/test_trainer_guards.py checks each of these).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pilotrun.config import TrainConfig
from pilotrun.data.reader import BatchLoader
from pilotrun.training import distributed as dist_utils
from pilotrun.training.callbacks.base import PRIORITY_EVAL, Callback, LoopState, due_on_cadence
from pilotrun.training.precision import autocast_context
from pilotrun.training.session import Session


def evaluate(session: Session, train: TrainConfig) -> dict[str, Any]:
    """The `val` event's fields: loss (mean over ranks), batches, tokens, seconds."""
    context, device, raw_model = session.context, session.device, session.raw_model
    loader = BatchLoader(session.dataset.split("val"), train.batch_size, train.seq_len, mode="successive",
                         rank=context.rank, world_size=context.world_size)
    started = time.perf_counter()
    raw_model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    try:
        with torch.no_grad():
            for _ in range(train.eval_batches):
                inputs, targets = loader.next_batch()
                inputs = inputs.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                with autocast_context(train.precision, device.type):
                    output = raw_model(inputs, targets)
                total += output.ce_loss.detach().double()
    finally:
        raw_model.train()
    loss = dist_utils.mean_across_ranks(context, {"loss": float(total.item()) / train.eval_batches})["loss"]
    return {"loss": loss, "batches": train.eval_batches, "tokens": train.eval_batches * session.tokens_per_microbatch,
            "seconds": time.perf_counter() - started}


class EvalCallback(Callback):
    """Evaluates after every `eval_every`-th applied update (0: never) and keeps the last loss for session_end."""

    priority = PRIORITY_EVAL
    phase = "eval"

    def __init__(self, train: TrainConfig) -> None:
        self.train = train

    def due(self, loop: LoopState) -> bool:
        return due_on_cadence(loop, self.train.eval_every)

    def after_update(self, loop: LoopState) -> None:
        result = evaluate(loop.session, self.train)
        loop.last_val_loss = result["loss"]
        loop.log("val", **result)
