"""The verdict's vocabulary: rule outcomes (PASS, WARN, FAIL with figure, threshold and evidence) and the
thresholds every rule is held to, with `--threshold NAME=VALUE` parsing. verdict.py documents each rule."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from pilotrun.errors import PilotrunError

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"


class ThresholdError(PilotrunError):
    """An unknown threshold name or a value of the wrong type (`--threshold NAME=VALUE`)."""


@dataclass
class Thresholds:
    min_loss_drop: float = 0.05
    min_loss_drop_floor: float = 0.01
    loss_drop_sigmas: float = 3.0
    loss_window_fraction: float = 0.2
    max_val_gap_growth: float = 0.5
    max_val_rise: float = 0.05
    spike_factor: float = 5.0
    spike_median_window: int = 20
    spike_min_history: int = 5
    max_grad_spikes: int = 1
    max_clip_rate: float = 0.5
    max_skip_rate: float = 0.05
    min_throughput_ratio: float = 0.6
    min_cpu_share_ratio: float = 0.6
    memory_budget_gb: float = 0.0
    max_memory_growth: float = 1.5
    max_imbalance: float = 1.5
    max_dead_experts: int = 0
    balance_window_fraction: float = 0.25
    max_qk_clip_rate: float = 0.5
    resume_required: bool = True


def parse_thresholds(overrides: list[str], base: Thresholds | None = None) -> Thresholds:
    """Apply `NAME=VALUE` overrides; an unknown name or a bad value is one clear error."""
    thresholds = dataclasses.replace(base or Thresholds())
    types = {f.name: f.type for f in dataclasses.fields(Thresholds)}
    for text in overrides:
        if "=" not in text:
            raise ThresholdError(f"--threshold expects NAME=VALUE, got '{text}'")
        name, raw = (part.strip() for part in text.split("=", 1))
        if name not in types:
            raise ThresholdError(f"--threshold: unknown name '{name}' (known: {', '.join(types)})")
        kind = types[name]
        try:
            if kind == "bool":
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(raw)
                value: Any = raw.lower() in ("true", "1")
            elif kind == "int":
                value = int(raw)
            else:
                value = float(raw)
        except ValueError:
            raise ThresholdError(f"--threshold {name}: '{raw}' is not a valid {kind}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ThresholdError(f"--threshold {name}: '{raw}' is not a finite number")
        setattr(thresholds, name, value)
    return thresholds


@dataclass
class RuleResult:
    name: str
    status: str
    figure: str  # what was measured, with numbers
    threshold: str  # the bound it was held to
    evidence: str  # which records the figure comes from
