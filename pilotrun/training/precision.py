"""Precision: fp32, bf16 autocast, fp16 autocast with a dynamic loss scale, and one honest update.

docs/MODEL.md, "Precision". Parameters and optimizer state stay fp32 in every mode; autocast only changes the
compute dtype of matmuls. fp16 needs loss scaling (its range tops out at 65504), done by
`torch.amp.GradScaler`, on CPU and CUDA alike; bf16 has fp32's exponent range and needs none.

`apply_update` is the one place that turns accumulated gradients into a weight update:
unscale (fp16) -> global gradient norm -> clip -> optimizer step -> scaler update. An update is skipped,
leaving parameters and optimizer state exactly as they were, when the gradients are not finite: in fp16 the
scaler's overflow check finds them and backs the scale off ("overflow"); in fp32/bf16 (or an fp16 norm that
overflows by itself) it is reported as "nonfinite_grad". The caller then advances `step`, the schedule,
QK-Clip and the expert-bias update only when `applied` is True, and counts consecutive skips against
`train.max_consecutive_skips` itself.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm

from pilotrun.common.errors import ConfigError
from pilotrun.config import PRECISIONS

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision must be one of {PRECISIONS}, got '{precision}'")


def autocast_context(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """The forward-pass context: nothing for fp32, `torch.autocast` in bf16 or fp16 otherwise."""
    _check_precision(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=AUTOCAST_DTYPES[precision])


def build_grad_scaler(precision: str, device_type: str, init_scale: float = 65536.0,
                      growth_interval: int = 2000) -> torch.amp.GradScaler:
    """A GradScaler that is enabled only for fp16 (a disabled one is a no-op with scale 1.0).

    Growth and backoff factors are torch's defaults (2.0, 0.5). Its `state_dict()` (scale, growth tracker)
    must travel in the checkpoint for resume to be exact.
    """
    _check_precision(precision)
    if init_scale <= 0:
        raise ConfigError(f"train.loss_scale_init must be positive, got {init_scale}")
    if growth_interval < 1:
        raise ConfigError(f"train.loss_scale_growth_interval must be >= 1, got {growth_interval}")
    return torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=growth_interval,
                                enabled=precision == "fp16")


def restore_grad_scaler(scaler: torch.amp.GradScaler, saved: dict) -> bool:
    """Load a checkpoint's scaler state; returns False where there was none to load. A checkpoint written
    without fp16 holds an empty state (a disabled scaler has none), and a resume that switches to fp16 (an
    allowed change) starts its scaler afresh at the recipe's `train.loss_scale_init` instead of failing.

    The scale and its growth tracker come from the checkpoint; the growth interval stays the one this scaler
    was built with (the recipe's `train.loss_scale_growth_interval`): torch's state dict carries the interval
    too, and loading it whole would quietly undo a change of it allowed on resume. The tracker (good updates
    counted toward the next growth) is held below the new interval: torch grows the scale only when the count
    reaches the interval exactly, so a tracker already past a shortened interval would never grow it again."""
    if not saved and scaler.is_enabled():
        return False
    if scaler.is_enabled() and "growth_interval" in saved:
        interval = scaler.get_growth_interval()
        saved = {**saved, "growth_interval": interval}
        if "_growth_tracker" in saved:
            saved["_growth_tracker"] = min(int(saved["_growth_tracker"]), interval - 1)
    scaler.load_state_dict(saved)
    return True


@dataclass
class UpdateOutcome:
    """What happened to one attempted update.

    applied: the optimizer stepped. reason: "ok", "overflow" (fp16 scaler found inf/NaN and backed off),
    "nonfinite_grad" (non-finite gradient norm without a backoff) or the gate's reason ("spike"). grad_norm:
    global L2 norm of the (unscaled) gradients before clipping; it is inf or NaN on a skipped update, which is
    not a real value and must not be logged as one. clipped: clipping scaled the gradients down (only when
    applied). loss_scale_before / loss_scale_after: the scaler's scale around this update (1.0 when disabled).
    """

    applied: bool
    reason: str
    grad_norm: float
    clipped: bool
    loss_scale_before: float
    loss_scale_after: float


def _current_scale(scaler: torch.amp.GradScaler) -> float:
    return float(scaler.get_scale()) if scaler.is_enabled() else 1.0


def apply_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 grad_clip: float, measure_update_rms: bool = False, *,
                 alongside: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 gate: Callable[[float, list[float]], str | None] | None = None) -> UpdateOutcome:
    """Unscale, measure the global norm, clip to `grad_clip` (0: measure only), step, update the scale.

    `measure_update_rms` asks the optimizer's step to measure each group's update RMS as well (an optimizer
    whose step takes that argument: MuonAdamW); the figures are then its `last_update_rms`.

    `alongside(norm) -> 1-D tensor` (this rank's norm first) is what comes to the host instead of the norm
    alone: values the caller judges ride along in the one transfer the skip decision makes
    (spikes/detector.py). `gate(norm, the rest of those values) -> reason | None` then decides before the
    step: a reason skips the update with it, parameters and optimizer state untouched. It is consulted only
    for a finite norm.

    Gradients must have been accumulated with `scaler.scale(loss).backward()` (a plain backward when the
    scaler is disabled). Does not zero the gradients.
    """
    scale_before = _current_scale(scaler)
    if scaler.is_enabled():
        scaler.unscale_(optimizer)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        total_norm = get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)
        if isinstance(total_norm, DTensor):  # FSDP2: per-shard partial norms, reduced across ranks here
            total_norm = total_norm.full_tensor()
    else:
        total_norm = torch.zeros(())
    values: list[float] = []
    if alongside is not None:
        grad_norm, *values = alongside(total_norm).tolist()
    else:
        grad_norm = float(total_norm) if grads else 0.0

    held = gate(grad_norm, values) if gate is not None and math.isfinite(grad_norm) else None
    applied = math.isfinite(grad_norm) and held is None
    clipped = False
    step_options = {"measure_update_rms": True} if measure_update_rms else {}
    if applied:
        # Clip only when the norm really exceeds the limit, so `clipped` says exactly whether the gradients
        # were scaled (torch's clip_grad_norm_ would also shave norms within 1e-6 below the limit).
        if grad_clip > 0 and grad_norm > grad_clip:
            # torch's clip_grad_norm_ coefficient (1e-6 guards a zero norm); one Python float, so the same
            # code scales plain tensors and FSDP2's DTensor shards alike.
            coefficient = grad_clip / (grad_norm + 1e-6)
            for grad in grads:
                grad.mul_(coefficient)
            clipped = True
        if scaler.is_enabled():
            # The scaler found no inf/NaN (the norm is finite), so this steps; its own check stays in charge.
            scaler.step(optimizer, **step_options)  # passed on to optimizer.step
        else:
            optimizer.step(**step_options)
    # On a non-finite norm nothing touches the optimizer: parameters and its state stay bit-identical.
    if scaler.is_enabled():
        scaler.update()  # backs the scale off when unscale_ found inf/NaN, else counts toward growth
    scale_after = _current_scale(scaler)

    if applied and scale_after < scale_before:  # defensive: the scaler skipped the step after all
        applied = False
    if applied:
        reason = "ok"
    elif held is not None:
        reason = held
    elif scale_after < scale_before:
        reason = "overflow"
    else:
        reason = "nonfinite_grad"
    return UpdateOutcome(applied=applied, reason=reason, grad_norm=grad_norm, clipped=clipped and applied,
                         loss_scale_before=scale_before, loss_scale_after=scale_after)
