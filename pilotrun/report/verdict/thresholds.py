"""The verdict's vocabulary: what a rule finds (PASS, WARN or FAIL with its figure, threshold and evidence)
and the thresholds every rule is held to, each declared with its default and its meaning, with `--threshold
NAME=VALUE` parsing.

A threshold's meaning is part of its declaration (the field's metadata), so `verdict --help` and report.html
print the same words the code is held to; the rule table (rules.py) names which rule reads each field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from pilotrun.common.errors import PilotrunError

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"


class ThresholdError(PilotrunError):
    """An unknown threshold name or a value of the wrong type (`--threshold NAME=VALUE`)."""


def _threshold(default: Any, meaning: str) -> Any:
    """A Thresholds field: its default and what it bounds (read by `verdict --help` and the report)."""
    return field(default=default, metadata={"meaning": meaning})


@dataclass
class Thresholds:
    """The bounds the verdict's rules hold a pilot to. Grouped by the rule that reads them (rules.py)."""

    # loss_decreased
    min_loss_drop: float = _threshold(
        0.05, "a real drop smaller than this share of the first windows' mean loss WARNs (allows GO)"
    )
    min_loss_drop_floor: float = _threshold(
        0.01, "a drop smaller than this share of the first windows' mean loss FAILs: not learning"
    )
    loss_drop_sigmas: float = _threshold(
        3.0,
        "the drop must exceed this many standard errors of the difference of "
        "the two means (from the window-to-window noise), else it FAILs as "
        "within the loss's own noise",
    )
    loss_window_fraction: float = _threshold(
        0.2, "share of the train windows averaged at the start and at the end"
    )
    # loss_rise_at_end
    loss_rise_window_fraction: float = _threshold(
        0.25,
        "share of the train windows (at least 3) at the end of the "
        "run whose median loss is compared with the lowest median "
        "of as many consecutive windows before them",
    )
    loss_rise_sigmas: float = _threshold(
        4.0,
        "a rise of the end's median over that best level FAILs only beyond "
        "this many standard errors of the difference of two medians (from "
        "the window-to-window noise)",
    )
    min_loss_rise: float = _threshold(
        0.02,
        "and only beyond this share of the best level: the slow wander of a "
        "plateau (harder text late in the split) is not a rise",
    )
    # data_passes
    max_train_passes: float = _threshold(
        4.0,
        "passes over the training split a successive-mode pilot may make; "
        "any re-read WARNs, more passes FAIL: past about four epochs "
        "repeated tokens stop being worth fresh ones (Muennighoff et al., "
        "Scaling Data-Constrained Language Models, 2023) and the loss "
        "measures memorised text, not the long run's",
    )
    # val_tracks_train
    max_val_gap_growth: float = _threshold(
        0.5, "nats the val-minus-train gap may grow between the evaluations of the second half of the run"
    )
    max_val_rise: float = _threshold(0.05, "share by which the last val loss may exceed the best one")
    # grad_spikes (watch's loss_spike alert holds a live run's window losses to the same bound:
    # training/spikes/bound.py)
    spike_factor: float = _threshold(8.0, "a window's figure above median + this many times the scale of the "
                                          "previous windows is a spike; scale = max(robust std of successive "
                                          "windows, a share of the median: half for the gradient norm, so at "
                                          "least 5x the median at 8; 1% for the loss)")
    spike_median_window: int = _threshold(20, "previous windows the median and scale are taken over")
    spike_min_history: int = _threshold(5, "windows of history before spikes are looked for")
    max_grad_spikes: int = _threshold(1, "spikes allowed (each one WARNs); more FAIL")
    # clip_rate
    max_clip_rate: float = _threshold(
        0.5,
        "share of applied updates clipped over the second half of the pilot (warm-up clipping is expected)",
    )
    # skip_rate
    max_skip_rate: float = _threshold(0.05, "skipped / attempted updates over the kept history")
    # throughput_steady
    min_throughput_ratio: float = _threshold(
        0.6,
        "median training-only tokens/s of the last third of windows over "
        "the first third's; the same bound holds tokens per process CPU "
        "second (CPU) or per device second (CUDA), which tell a busier "
        "machine from a slower run",
    )
    min_cpu_share_ratio: float = _threshold(
        0.6,
        "on a CPU, a share of the CPU (process CPU seconds per training "
        "second) that fell below this fraction of the first third's means "
        "other load took the CPU: WARN, judge the speed on a quiet machine",
    )
    min_other_cpus_rise: float = _threshold(
        0.5,
        "on a CPU, CPUs the rest of the machine used (window."
        "other_cpu_seconds per wall second), last third's median minus the "
        "first third's, from which a slowdown is the machine's: WARN",
    )
    min_switch_ratio: float = _threshold(
        4.0,
        "on a CPU, involuntary context switches per second (the run's "
        "threads descheduled for other tasks), last third's median over the "
        "first third's (at least 1/s), from which a slowdown is the "
        "machine's: WARN",
    )
    # memory
    memory_budget_gb: float = _threshold(
        0.0,
        "peak memory (CUDA max allocated, else peak RSS) must fit; 0 = the "
        "recipe's train.memory_budget_gb (0 there too = no budget)",
    )
    max_memory_growth: float = _threshold(1.5, "RSS at a session's last window over its first (a leak)")
    # experts
    max_imbalance: float = _threshold(1.5, "max / mean tokens per expert, per MoE layer")
    max_dead_experts: int = _threshold(0, "experts that received no token")
    balance_window_fraction: float = _threshold(
        0.25, "share of the last train windows whose expert loads are summed"
    )
    # qk_clip
    max_qk_clip_rate: float = _threshold(0.5, "share of applied updates on which QK-Clip rescaled any head")
    # spikes
    max_spikes: int = _threshold(
        3,
        "spike events (train.spike: loss or gradient norm above the running bound) "
        "allowed, each named with its cause and WARNing; more FAIL",
    )
    max_spike_rollbacks: int = _threshold(1, "rollbacks a spike needed, allowed with a WARN; more FAIL")
    max_unreproduced_spikes: int = _threshold(
        1, "spikes the replay could not reproduce (hardware suspect), allowed with a WARN; more FAIL"
    )
    # resumed
    resume_required: bool = _threshold(
        True,
        "the pilot must have come through a resume; false (--no-resume-required) "
        "turns a missing resume into a WARN",
    )


THRESHOLD_FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(Thresholds)


def threshold_meaning(name: str) -> str:
    """What the threshold `name` bounds, as declared with its field."""
    return Thresholds.__dataclass_fields__[name].metadata["meaning"]


def parse_thresholds(overrides: list[str], base: Thresholds | None = None) -> Thresholds:
    """Apply `NAME=VALUE` overrides; an unknown name or a bad value is one clear error."""
    thresholds = dataclasses.replace(base or Thresholds())
    types = {f.name: f.type for f in THRESHOLD_FIELDS}
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
class Finding:
    """What one rule's judge found: the rule table adds the rule's name (a RuleResult)."""

    status: str  # PASS, WARN or FAIL
    figure: str  # what was measured, with numbers
    threshold: str  # the bound it was held to
    evidence: str  # which records the figure comes from


@dataclass
class RuleResult:
    name: str
    status: str
    figure: str  # what was measured, with numbers
    threshold: str  # the bound it was held to
    evidence: str  # which records the figure comes from
