"""The learning-rate schedule: a pure function of the applied-update count and the schedule's own horizon.

The multiplier depends on `step` (updates actually applied so far) and on
`optim.schedule`, never on `train.max_steps` and never on attempts. A skipped fp16 update therefore does not
move the schedule, and raising `max_steps` on resume continues exactly the curve a longer run would follow.

Shapes (multiplier of each group's base lr; `step` is the number of updates already applied, so the update
about to be applied is number step + 1):
  warmup    step < warmup_steps: (step + 1) / warmup_steps (linear; the first update is not wasted at lr 0)
  cosine    then min + (1 - min) * (1 + cos(pi * p)) / 2, p = (step - warmup) / (horizon - warmup), in [0, 1]
  wsd       then 1 until the last `decay_fraction` of the horizon, then linear down to min (K2 2.5 uses WSD)
  constant  then 1
Past the horizon every shape holds its final value (min_lr_ratio for cosine and wsd).
"""

from __future__ import annotations

import torch

from pilotrun.config import RunConfig, ScheduleConfig
from pilotrun.optim.lr_shape import lr_multiplier


def set_learning_rates(optimizer: torch.optim.Optimizer, step: int, schedule_cfg: ScheduleConfig) -> float:
    """Set every group's `lr = base_lr * lr_multiplier(step)`; returns the multiplier.

    Idempotent: calling it twice for the same step sets the same values, which is what makes a resumed run
    agree with one that never stopped.
    """
    multiplier = lr_multiplier(step, schedule_cfg)
    for group in optimizer.param_groups:
        if "base_lr" not in group:
            raise ValueError(f"param group '{group.get('name', '?')}' has no base_lr; build it with "
                             "pilotrun.optim.partition.partition_parameters")
        group["lr"] = group["base_lr"] * multiplier
    return multiplier


def expert_bias_speed(step: int, speed: float, schedule_cfg: ScheduleConfig) -> float:
    """The aux-free bias update speed gamma for update number `step` (0-based, as the LR): `speed`, or 0 in
    the final `bias_freeze_fraction` of the horizon, so that the routing settles before training ends
    (DeepSeek-V3 sets gamma = 0 for the last 500B of 14.8T tokens, Moonlight in its cooldown)."""
    frozen_steps = round(schedule_cfg.bias_freeze_fraction * schedule_cfg.horizon)
    return 0.0 if frozen_steps > 0 and step >= schedule_cfg.horizon - frozen_steps else speed


def final_lr_multiplier(config: RunConfig) -> float:
    """The LR multiplier of the run's last update (number train.max_steps)."""
    return lr_multiplier(config.train.max_steps - 1, config.optim.schedule)


def schedule_warnings(config: RunConfig) -> list[str]:
    """What a person shortening or lengthening a run with `--set train.max_steps=N` needs to hear: the
    schedule runs on its own horizon (so that a resume may raise max_steps exactly), so a max_steps that
    differs from it either stops before the LR has decayed or holds the final LR for the remaining updates.
    Empty when they agree or the schedule is constant."""
    schedule, max_steps = config.optim.schedule, config.train.max_steps
    if schedule.kind == "constant" or max_steps == schedule.horizon:
        return []
    final = final_lr_multiplier(config)
    lrs = f"muon lr {config.optim.muon.lr * final:.3g}, adamw lr {config.optim.adamw.lr * final:.3g}"
    if max_steps < schedule.horizon:
        return [
            f"train.max_steps={max_steps} < optim.schedule.horizon={schedule.horizon}: the {schedule.kind} "
            f"schedule will not finish; the last update runs at {final:.3g}x the base LR ({lrs}), not "
            f"{schedule.min_lr_ratio:g}x. To shorten a run, set both: --set train.max_steps={max_steps} "
            f"--set optim.schedule.horizon={max_steps}"
        ]
    return [
        f"train.max_steps={max_steps} > optim.schedule.horizon={schedule.horizon}: the last "
        f"{max_steps - schedule.horizon} updates run at the schedule's final {final:.3g}x the base LR ({lrs})"
    ]
