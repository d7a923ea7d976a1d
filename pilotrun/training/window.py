"""One logging window: what the loop accumulates between two `train` events, and the event built from it.

`Window` accumulates on the device (no host synchronisation in the hot loop). When the window closes, the
trainer reads it off the device into `WindowFigures` (plain numbers) and `train_event_fields` builds the
event, a pure function of those numbers, unit-tested without training. docs/RUN_RECORD.md lists every
field it writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


class Window:
    """Accumulators for one logging window; tensors stay on the device until the window closes."""

    def __init__(self, device: torch.device):
        self.ce_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.aux_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.microbatches = 0
        self.attempted = 0
        self.applied = 0
        self.skipped = 0
        self.clipped = 0
        self.grad_norm: float | None = None
        self.grad_norm_max = -math.inf
        self.loss_scale = 1.0
        self.tokens_per_expert: torch.Tensor | None = None
        self.qk_max_logit: torch.Tensor | None = None
        self.update_rms: dict[str, float] | None = None  # per group, from the update numbered update_rms_step
        self.update_rms_step: int | None = None
        # Update attempts run under torch.profiler (train.profile) and their microbatches: their time is the
        # profile phase's, so the training-only figures must not count their tokens either.
        self.profiled_attempts = 0
        self.profiled_microbatches = 0
        # On CUDA, a pair of timing events around each update in the training phase: the device's own seconds
        # for the work, which other load on the host does not stretch while the device stays fed. The verdict
        # tells a busier machine from a slower run with them, as it does with the process CPU time on a CPU.
        self._device_events: list[tuple[Any, Any]] = [] if device.type == "cuda" else None  # type: ignore[assignment]
        self._open_event: Any = None

    def update_started(self) -> None:
        """Mark the start of an update's device work (CUDA only; a no-op elsewhere, no host sync)."""
        if self._device_events is not None:
            self._open_event = torch.cuda.Event(enable_timing=True)
            self._open_event.record()

    def update_finished(self) -> None:
        if self._device_events is not None and self._open_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._device_events.append((self._open_event, end))
            self._open_event = None

    def device_seconds(self) -> float | None:
        """The summed device seconds of the window's timed updates (None off CUDA). Waits for the last event:
        called when the window closes, where the loop leaves the training phase anyway."""
        if not self._device_events:
            return None
        self._device_events[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self._device_events) / 1000.0

    def add_statistics(self, tokens_per_expert: torch.Tensor, qk_max_logit: torch.Tensor) -> None:
        if self.tokens_per_expert is None:
            self.tokens_per_expert = tokens_per_expert.clone()
            self.qk_max_logit = qk_max_logit.clone()
        else:
            self.tokens_per_expert += tokens_per_expert
            torch.maximum(self.qk_max_logit, qk_max_logit, out=self.qk_max_logit)


@dataclass
class WindowFigures:
    """A closed window as plain numbers: its counts, its seconds and the figures measured over it."""

    updates_applied: int
    updates_attempted: int
    updates_skipped: int
    clipped: int
    microbatches: int
    tokens: int
    train_seconds: float
    wall_seconds: float
    cpu_seconds: float  # the process's CPU seconds in the window's training phase (contention vs slowdown)
    loss: float  # mean cross-entropy over the window's microbatches, all ranks
    aux_loss: float
    grad_norm: float | None  # at the window's last applied update
    grad_norm_max: float  # -inf when no update was applied
    loss_scale: float
    update_rms: dict[str, float] | None = None
    update_rms_step: int | None = None
    profiled_attempts: int = 0  # update attempts run under the profiler (their seconds are not train_seconds)
    profiled_tokens: int = 0  # their tokens (inside `tokens`)
    profile_seconds: float = 0.0  # their seconds (inside `wall_seconds`)
    device_seconds: float | None = None  # CUDA: device seconds of the training-phase updates (timing events)
    involuntary_switches: int | None = None  # times the process's threads were descheduled for other tasks
    other_cpu_seconds: float | None = None  # CPU seconds the rest of the machine used during the window


def train_event_fields(
    window: WindowFigures,
    *,
    lr: float,
    base_lr: float | None,
    epoch: int,
    data_restarts: int,
    throughput: dict[str, Any],
    moe: dict[str, Any],
    attention: dict[str, Any],
    hook_metrics: dict[str, dict[str, Any]],
    memory: dict[str, Any],
    block_output_rms: list[float | None],
    weight_rms: dict[str, float],
) -> dict[str, Any]:
    """The fields of a `train` event (the writer adds event, time, session_id and the counters).

    `hook_metrics` are the update hooks' window metrics by hook name: `qk_clip`'s join the attention
    figures under `qk_clip`; `moe`'s (the expert-bias speed) join the MoE diagnostics when the model has any.
    """
    applied = window.updates_applied > 0
    moe_section = {**moe, **hook_metrics.get("moe", {})} if moe else {}
    return {
        "window": {
            "updates_applied": window.updates_applied,
            "updates_attempted": window.updates_attempted,
            "updates_skipped": window.updates_skipped,
            "clipped": window.clipped,
            "microbatches": window.microbatches,
            "tokens": window.tokens,
            "train_seconds": window.train_seconds,
            "wall_seconds": window.wall_seconds,
            "cpu_seconds": window.cpu_seconds,
            "profiled_attempts": window.profiled_attempts,
            "profiled_tokens": window.profiled_tokens,
            "profile_seconds": window.profile_seconds,
            "device_seconds": window.device_seconds,
            "involuntary_switches": window.involuntary_switches,
            "other_cpu_seconds": window.other_cpu_seconds,
        },
        "loss": window.loss,
        "aux_loss": window.aux_loss,
        "lr": lr,
        "lr_multiplier": lr / base_lr if base_lr else None,
        "grad_norm": window.grad_norm,
        "grad_norm_max": window.grad_norm_max if applied else None,
        "loss_scale": window.loss_scale,
        "epoch": epoch,
        "data_restarts": data_restarts,
        "throughput": throughput,
        "moe": moe_section,
        "qk_clip": {
            "max_logit": attention.get("max_logit"),
            "max_logit_per_head": attention.get("max_logit_per_head"),
            **hook_metrics.get("qk_clip", {}),
        },
        "memory": memory,
        "activations": {"block_output_rms": block_output_rms},
        "optimizer": {
            "weight_rms": weight_rms,
            "update_rms": window.update_rms,
            "update_rms_step": window.update_rms_step,
        },
    }
