"""The learning-rate shape alone, torch-free: the multiplier of the base LR after `step` applied updates (the
shapes are described in pilotrun/optim/schedule.py). Kept apart from the optimizer so that the report's
forecast (pilotrun/report/projection/forecast.py) computes the same schedule a run follows without importing
torch. `schedule_cfg` is a ScheduleConfig or anything with its fields (kind, warmup_steps, horizon,
min_lr_ratio,
decay_fraction)."""

from __future__ import annotations

import math
from typing import Any


def lr_multiplier(step: int, schedule_cfg: Any) -> float:
    """Multiplier of the base learning rate for the update that follows `step` applied updates."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    warmup = schedule_cfg.warmup_steps
    horizon = schedule_cfg.horizon
    floor = schedule_cfg.min_lr_ratio
    if step < warmup:
        return (step + 1) / warmup
    kind = schedule_cfg.kind
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        span = horizon - warmup
        progress = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "wsd":
        decay_steps = max(1, round(schedule_cfg.decay_fraction * horizon))
        decay_start = max(warmup, horizon - decay_steps)
        if step < decay_start:
            return 1.0
        span = horizon - decay_start
        progress = 1.0 if span <= 0 else min(1.0, (step - decay_start) / span)
        return 1.0 - (1.0 - floor) * progress
    raise ValueError(f"unknown schedule kind '{kind}' (expected cosine, wsd or constant)")
