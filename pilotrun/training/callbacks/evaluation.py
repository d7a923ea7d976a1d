"""Evaluation: the mean cross-entropy of the first `train.eval.batches` batches of the val split (of each
source's for a mixture), every `train.eval.every` applied updates, logged as a `val` event; the "eval" phase.
The callback is built from its section, `train.eval`; the batch geometry and precision are the session's.

The same batches every time, so the values are comparable across a run and across its sessions. The model is
put in eval mode (no per-step statistic or tracker moves), no gradient is kept, the training precision is
used, and nothing draws from a random generator or moves the training loader: an evaluation leaves the
training exactly as it was (tests/training/test_trainer_guards.py checks each of these).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from pilotrun.config import EvalConfig
from pilotrun.data.mixed_reader import MixedDataset, all_splits
from pilotrun.data.reader import BatchLoader, TokenSplit
from pilotrun.training import distributed as dist_utils
from pilotrun.training.callbacks.base import PRIORITY_EVAL, Callback, LoopState, due_on_cadence
from pilotrun.training.precision import autocast_context
from pilotrun.training.session import Session


def _loss_sum(session: Session, batches: int, split: TokenSplit) -> float:
    """This rank's summed cross-entropy over the first `batches` batches of one val split."""
    context, device, raw_model = session.context, session.device, session.raw_model
    train = session.config.train
    loader = BatchLoader(split, train.batch_size, train.seq_len, mode="successive", rank=context.rank,
                         world_size=context.world_size)
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for _ in range(batches):
            inputs, targets = loader.next_batch()
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with autocast_context(train.precision, device.type):
                output = raw_model(inputs, targets)
            total += output.ce_loss.detach().double()
    return float(total.item())


def evaluate(session: Session, section: EvalConfig) -> dict[str, Any]:
    """The `val` event's fields: loss (mean over ranks), batches, tokens, seconds. A mixture evaluates each
    source on its own val split (`loss_by_source`); its `loss` is their mean under the mixture's weights."""
    started = time.perf_counter()
    dataset = session.dataset
    splits = all_splits(dataset, "val")
    session.raw_model.eval()
    try:
        sums = {str(index): _loss_sum(session, section.batches, split) / section.batches
                for index, split in enumerate(splits)}
    finally:
        session.raw_model.train()
    means = dist_utils.mean_across_ranks(session.context, sums)
    batches = section.batches * len(splits)
    fields: dict[str, Any] = {"loss": means["0"], "batches": batches,
                              "tokens": batches * session.tokens_per_microbatch}
    if isinstance(dataset, MixedDataset):
        weights = dataset.spec.weights
        by_source = {name: means[str(index)] for index, name in enumerate(dataset.names)}
        fields["loss"] = weighted_mean(weights, list(by_source.values()))
        fields["loss_by_source"] = by_source
    return {**fields, "seconds": time.perf_counter() - started}


def weighted_mean(weights: list[float], losses: list[float]) -> float:
    """The mixture's loss: each source's under its weight. Weights near a float's limit (1e308 beside 1, which
    a mixture file may hold) overflow the weighted sum to inf, where the mean is finite: then each weight is
    first taken as its share of the total. Finite sums keep the plain formula, so their figures are those of
    before."""
    mean = sum(w * loss for w, loss in zip(weights, losses, strict=True)) / sum(weights)
    if math.isfinite(mean) or not all(math.isfinite(loss) for loss in losses):
        return mean
    total = sum(weights)
    return sum((w / total) * loss for w, loss in zip(weights, losses, strict=True))


class EvalCallback(Callback):
    """Evaluates after every `every`-th applied update (0: never) and keeps the last loss for session_end."""

    priority = PRIORITY_EVAL
    phase = "eval"

    def __init__(self, section: EvalConfig) -> None:
        self.section = section

    def due(self, loop: LoopState) -> bool:
        return due_on_cadence(loop, self.section.every)

    def after_update(self, loop: LoopState) -> None:
        result = evaluate(loop.session, self.section)
        loop.last_val_loss = result["loss"]
        loop.log("val", **result)
