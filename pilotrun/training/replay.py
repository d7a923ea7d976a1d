"""The cause of a spike, by replay: the spiking update computed again from the very state it started from.

The replay runs inside the skip decision (detector.SpikeGate), before the optimizer steps, so the weights,
optimizer state and expert biases are still those the update started from: no copy of the model is needed and
no checkpoint has to be walked forward (the in-memory state is the cheaper path the project's exact replay
allows). It computes the update's forward and backward again on the same batches (the loader's cursor is a
pure function of the batch index) and brings (norm, loss) of every rank to the host as the update did:
- the spike recurs bit for bit: deterministic. The update is then computed once more on the next batches the
  run would read: below the bound there, the batch is the cause ("batch", named by cursor position, and
  `pilotrun inspect-batch` shows its text); above it too, the model state is ("model_state");
- the spike does not recur: "not_reproducible", the hardware or a kernel with undefined behaviour is suspect,
  and the ranks whose figures changed between the two computations are named.
Afterwards everything the replay touched is put back: the gradients (the update then steps, or not, on the
ones it computed first), the cursor and every random generator. The per-update statistics buffers it adds to
have already been read for this update and are reset by the loop after the round. The seconds are the "other"
phase and the `spike` event records them, so the time ledger shows them as replay, not as training.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm

from pilotrun.training import distributed as dist_utils
from pilotrun.training.checkpoint.rng_state import capture_rng_state, restore_rng_state
from pilotrun.training.precision import autocast_context
from pilotrun.training.spikes.detector import (
    SpikeDetector,
    SpikeVerdict,
    agreed,
    gathered_values,
    per_rank_pairs,
)


def compute_update(session: Any, batches: list[int]) -> list[list[float]]:
    """Forward and backward of `batches` as train_one_update does them, unscaled as apply_update does; returns
    [grad_norm, loss] per rank. Leaves new gradients behind (the caller puts the old ones back)."""
    t, model, scaler, loader = session.config.train, session.model, session.scaler, session.state.loader
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        p.grad.zero_()  # in place: a DDP gradient may be a view of its bucket; 0 + g == g
    loss_sum = torch.zeros((), dtype=torch.float64, device=session.device)
    for micro, batch_index in enumerate(batches):
        loader.batch_index = batch_index
        inputs, targets = loader.next_batch()
        inputs, targets = inputs.to(session.device), targets.to(session.device)
        with dist_utils.gradient_sync(model, micro == len(batches) - 1):
            with autocast_context(t.precision, session.device.type):
                output = model(inputs, targets)
            scaler.scale(output.loss / len(batches)).backward()
        loss_sum += output.ce_loss.detach()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if scaler.is_enabled():
        inv_scale = scaler._scale.double().reciprocal().float()  # as GradScaler.unscale_ computes it
        for grad in grads:
            grad.mul_(inv_scale)
    norm = get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return per_rank_pairs(gathered_values(norm, loss_sum, len(batches), session.context).tolist()[1:])


def replay_spike(loop: Any, verdict: SpikeVerdict, detector: SpikeDetector, next_batches: list[int]
                 ) -> dict[str, Any]:
    """The `replay` part of a spike event (module docstring); every rank calls it (the verdict is agreed)."""
    session = loop.session
    loader = session.state.loader
    started = time.perf_counter()
    saved = [(p, p.grad.clone()) for p in session.model.parameters() if p.grad is not None]
    cursor, restarted, rng = loader.batch_index, loader.last_batch_restarted, capture_rng_state()
    try:
        with loop.account.phase("other"):
            same = compute_update(session, verdict.batches)
            bitwise = same == verdict.per_rank
            recurs = bool(detector.judge(*_loss_norm(same))[0])
            following = None
            if recurs:
                following = compute_update(session, next_batches)
                cause = "model_state" if detector.judge(*_loss_norm(following))[0] else "batch"
            else:
                cause = "not_reproducible"
    finally:
        for p, grad in saved:
            p.grad.copy_(grad)
        loader.batch_index, loader.last_batch_restarted = cursor, restarted
        restore_rng_state(rng)
    ranks = [r for r, (a, b) in enumerate(zip(verdict.per_rank, same, strict=True)) if a != b]
    said = {
        "batch": f"deterministic: recurs{' bit for bit' if bitwise else ''} on batches {verdict.batches} and "
        f"not on the next ones {next_batches}: the data is the cause",
        "model_state": "deterministic: recurs on its batches and on the next ones too: the model state is "
                       "the cause",
        "not_reproducible": f"not reproduced by the replay (rank(s) {ranks} computed other figures): the "
        "hardware or a kernel with undefined behaviour is suspect",
    }[cause]
    return {
        "cause": cause,
        "bitwise": bitwise,
        "same_batch": same,
        "next_batches": next_batches if recurs else None,
        "next_batch": following,
        "ranks_differing": ranks,
        "explanation": said,
        "seconds": time.perf_counter() - started,
    }


def _loss_norm(pairs: list[list[float]]) -> tuple[float, float]:
    norm, loss = agreed(pairs)
    return loss, norm
