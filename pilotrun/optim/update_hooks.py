"""What follows an applied update, as objects the trainer calls without knowing what they do.

After the optimizer has applied an update (never after a skipped one), two model-side corrections run, in
this order (docs/MODEL.md, "one optimizer step"):

- QK-Clip: every attention head whose largest pre-softmax logit in this update exceeded `tau` has its query
  and key projections scaled down so the logit would have been `tau`;
- the auxiliary-loss-free expert-bias update: each MoE router's bias moves toward balancing the expert
  loads counted in this update, at a speed set by the schedule.

Each is an `UpdateHook`: `after_update` (the statistics the step agreed on across ranks: tokens per expert,
max logit per head), `window_metrics` (fields it adds to the next `train` event, then forgets), and
`state_dict`/`load_state_dict` for what it keeps across a checkpoint (under its `name` in the trainer's
state). `build_update_hooks` is the one place that decides which hooks a recipe gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pilotrun.config import RunConfig
from pilotrun.model.balancing import update_expert_bias
from pilotrun.optim.qk_clip import QKClipCounters, apply_qk_clip, qk_clip_events
from pilotrun.optim.schedule import expert_bias_speed


@dataclass
class StepStatistics:
    """What one update's forward passes measured, agreed across ranks (expert counts summed, logits maxed)."""

    tokens_per_expert: torch.Tensor
    qk_max_logit: torch.Tensor


class UpdateHook:
    """Base of the after-update hooks. `name` keys its state in the checkpoint and its metrics in the
    event."""

    name = ""

    def after_update(self, step: int, statistics: StepStatistics) -> list[dict[str, Any]]:
        """Runs after applied update number `step + 1` (so `step` is the schedule's step for it); returns the
        fields of events to log (logged by the trainer outside the timed region)."""
        return []

    def window_metrics(self) -> dict[str, Any]:
        """Fields for the `train` event that closes the window; the window's accumulators start again."""
        return {}

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class QKClipHook(UpdateHook):
    """QK-Clip with its run-long counters (how often each head was clipped) and the window's figures. Built
    for every recipe, so every `train` event carries the same fields; with QK-Clip off it only counts zero."""

    name = "qk_clip"

    def __init__(self, model: torch.nn.Module, n_heads: int, enabled: bool, tau: float):
        self.model = model
        self.enabled = enabled
        self.tau = tau
        self.counters = QKClipCounters(len(model.attention_layers()), n_heads)
        self._reset_window()

    def _reset_window(self) -> None:
        self.heads_clipped = 0
        self.min_gamma = 1.0
        self.first_clipped: list[tuple[int, int]] = []  # (layer, head) clipped for the first time in the run

    def after_update(self, step: int, statistics: StepStatistics) -> list[dict[str, Any]]:
        if not self.enabled:
            return []
        clip = apply_qk_clip(self.model, statistics.qk_max_logit, self.tau)
        if not (clip.n_heads_clipped or clip.skipped_nonfinite_layers):  # the usual case: nothing more to do
            return []
        first = self.counters.update(clip)
        self.first_clipped += first
        self.heads_clipped += int(clip.n_heads_clipped)
        self.min_gamma = min(self.min_gamma, float(clip.min_gamma))
        return qk_clip_events(clip, statistics.qk_max_logit, first)

    def window_metrics(self) -> dict[str, Any]:
        metrics = {"heads_clipped": self.heads_clipped, "min_gamma": self.min_gamma,
                   "first_clipped": self.first_clipped, "updates_with_clip": self.counters.updates_with_clip,
                   "cumulative_interventions": self.counters.total_interventions(),
                   "nonfinite_layer_skips": self.counters.nonfinite_layer_skips}
        self._reset_window()
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return self.counters.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters.load_state_dict(state)


class ExpertBiasHook(UpdateHook):
    """The auxiliary-loss-free balancing update of every MoE router's bias; its speed follows the applied
    update count through the schedule (0 once the bias is frozen). Reports the speed of the window's last
    applied update."""

    name = "moe"

    def __init__(self, model: torch.nn.Module, config: RunConfig):
        self.model = model
        self.speed = config.model.bias_update_speed
        self.schedule = config.optim.schedule
        self.last_speed: float | None = None

    def after_update(self, step: int, statistics: StepStatistics) -> list[dict[str, Any]]:
        self.last_speed = expert_bias_speed(step, self.speed, self.schedule)
        update_expert_bias(self.model, statistics.tokens_per_expert, self.last_speed)
        return []

    def window_metrics(self) -> dict[str, Any]:
        metrics = {} if self.last_speed is None else {"bias_update_speed": self.last_speed}
        self.last_speed = None
        return metrics


def build_update_hooks(model: torch.nn.Module, config: RunConfig) -> list[UpdateHook]:
    """The hooks a recipe gets, in the order they run after an applied update."""
    qk = config.optim.qk_clip
    return [QKClipHook(model, config.model.n_heads, qk.enabled, qk.tau), ExpertBiasHook(model, config)]
