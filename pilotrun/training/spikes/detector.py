"""Loss spikes, detected in the loop: the decision every rank makes alike over a running window, and what the
loop hands on to the policy (rollback.py) and the record.

A spike is an update attempt whose loss (the mean cross-entropy of its microbatches over every rank) or global
gradient norm is a spike of its signal's history, as pilotrun/training/spikes/bound.py defines it once for the
trainer, the verdict and watch: above median + `train.spike.factor` x scale of the last `train.spike.window`
applied updates (scale = 1.4826 MAD of the values, for the loss the upper tail's spread where wider, floored
per signal at spike_bound.MIN_SCALE_SHARE of the median, the gradient norm's raised for a batch of fewer
than 512 tokens: spike_bound.grad_norm_floor_share), once `min_history` applied updates are in the
window, or not finite. An fp16 overflow is the scaler's business (precision.py) and is not a spike; the judge
is consulted only for a finite gradient norm.

No host synchronisation of its own: the skip decision already brings the gradient norm to the host
(precision.apply_update), and the update's loss rides along in the same transfer (`alongside`). Under torchrun
each rank's (norm, loss) pair is all-gathered first (a collective on the device, no host sync), so that every
rank judges the same numbers: the largest norm and the mean loss. A spike confined to one rank (a gradient
corrupted after the all-reduce) is then still seen by every rank alike, and the replay can name the rank.

The detector is an update hook (optim/update_hooks.py) so that its window travels in the checkpoint's trainer
state: a resumed run judges each update against the same history as a run that never stopped.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pilotrun.common.errors import ConfigError
from pilotrun.config import SpikeConfig
from pilotrun.data.skipped_documents import read_documents
from pilotrun.optim.update_hooks import StepStatistics, UpdateHook
from pilotrun.training.spikes.bound import (
    MIN_SCALE_SHARE,
    grad_norm_floor_share,
    level_spread,
    spike_against,
    tail_spread,
)

SIGNALS = ("loss", "grad_norm")
# The loss's spread per update follows its upper tail (spike_bound.tail_spread: the batch's noise); the
# gradient norm's heavy tail is held by its floor share instead, which a planted noise document must still
# clear.
SPREADS = {"loss": tail_spread, "grad_norm": level_spread}
ACTIONS = ("recorded", "skipped", "rollback", "stopped")
CAUSES = ("batch", "model_state", "not_reproducible")


@dataclass
class SpikeVerdict:
    """One spiking update attempt: its figures, what exceeded which bound, and what the policy did."""

    step: int  # the step the update would have made
    loss: float  # mean cross-entropy over every rank's microbatches
    grad_norm: float  # the largest over ranks (all equal under DDP unless one rank's gradient is corrupted)
    signals: list[str]  # which of SIGNALS exceeded its bound ("loss" also for a non-finite loss)
    bounds: dict[str, dict[str, float]]  # per signal: median, scale, bound (empty before min_history)
    per_rank: list[list[float]]  # [grad_norm, loss] per rank
    batches: list[int]  # the global batch cursor positions its microbatches read
    action: str = "recorded"  # one of ACTIONS
    note: str = ""
    replay: dict[str, Any] | None = None  # replay.py: the cause and the replayed figures
    # On a `model_state` cause, the checkpoint the rollback restores and what it steps over (restore_point.py)
    restore_point: Any = None

    def fields(self, tokens_per_microbatch: int) -> dict[str, Any]:
        """The `spike` event's fields (docs/RUN_RECORD.md)."""
        return {
            "spike_step": self.step,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "signals": self.signals,
            "bounds": self.bounds,
            "per_rank": self.per_rank,
            "batches": self.batches,
            "tokens": len(self.batches) * tokens_per_microbatch,
            "action": self.action,
            "skipped": self.action != "recorded",
            "note": self.note,
            "replay": self.replay,
            "cause": (self.replay or {}).get("cause"),
        }


class SpikeDetector(UpdateHook):
    """The window of applied updates' (loss, grad norm), the number of rollbacks so far and the data they
    skip, in the checkpoint's trainer state: a resume skips exactly what the run it continues skipped."""

    name = "spike"
    # a checkpoint written before spikes were detected has none: start with an empty window
    state_optional = True

    def __init__(self, config: SpikeConfig, tokens_per_update: int | None = None) -> None:
        self.config = config
        # the gradient norm's floor follows the batch's noise (spike_bound.grad_norm_floor_share)
        self.floor_shares = {**MIN_SCALE_SHARE, "grad_norm": grad_norm_floor_share(tokens_per_update)}
        self.history: dict[str, deque[float]] = {s: deque(maxlen=config.window) for s in SIGNALS}
        self.rollbacks = 0
        # One record per rollback (rollback.py, docs/RUN_RECORD.md `skip_data`): the global batch
        # range the loader steps over and the documents it holds. The range is what the loader acts on.
        self.skip_data: list[dict[str, Any]] = []
        self.pending: tuple[float, float] | None = None  # the attempt in flight, added once it is applied

    def skip_ranges(self, recipe: list[list[int]]) -> list[list[int]]:
        """Every [first_batch, batches] range the loader steps over: the recipe's `train.skip_data` (a user's,
        or a run's from before rollbacks kept their own) and this run's rollbacks'."""
        return [*recipe, *([int(r["first_batch"]), int(r["batches"])] for r in self.skip_data)]

    def judge(self, loss: float, grad_norm: float) -> tuple[list[str], dict[str, dict[str, float]]]:
        """Which signals exceed their bound, and the bounds (pure given the window)."""
        exceeded, bounds = [], {}
        for signal, value in zip(SIGNALS, (loss, grad_norm), strict=True):
            spiked, found = spike_against(value, list(self.history[signal]), self.config.factor,
                                          self.floor_shares[signal], self.config.min_history, SPREADS[signal])
            if found is not None:
                bounds[signal] = dict(zip(("median", "scale", "bound"), found, strict=True))
            if spiked:
                exceeded.append(signal)
        return exceeded, bounds

    def after_update(self, step: int, statistics: StepStatistics) -> list[dict[str, Any]]:
        if self.pending is not None:
            for signal, value in zip(SIGNALS, self.pending, strict=True):
                if math.isfinite(value):
                    self.history[signal].append(value)
        self.pending = None
        return []

    def state_dict(self) -> dict[str, Any]:
        # The records as one JSON string: a plain value both storages keep whole (DCP would take a list of
        # objects apart by index and load it into a template of another length).
        return {**{s: list(self.history[s]) for s in SIGNALS}, "rollbacks": self.rollbacks,
                "skip_data": json.dumps(self.skip_data, sort_keys=True)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        for signal in SIGNALS:
            self.history[signal] = deque((float(v) for v in state.get(signal, [])), maxlen=self.config.window)
        self.rollbacks = int(state.get("rollbacks", 0))
        # A checkpoint from before rollbacks kept their records has none: its ranges are in its recipe.
        self.skip_data = json.loads(state.get("skip_data", "[]"))
        self.pending = None


def gathered_values(
    norm: torch.Tensor, loss_sum: torch.Tensor, microbatches: int, context: Any
) -> torch.Tensor:
    """What apply_update brings to the host with the gradient norm (`alongside`): [this rank's norm, then
    (norm, loss) of every rank]. One transfer; under torchrun one all_gather before it."""
    pair = torch.stack([norm.detach().reshape(()).to(torch.float64),
                        (loss_sum / microbatches).to(norm.device, torch.float64)])
    if context is not None and context.is_distributed:
        import torch.distributed as dist

        gathered = [torch.empty_like(pair) for _ in range(context.world_size)]
        dist.all_gather(gathered, pair)
        return torch.cat([pair[:1], *gathered])
    return torch.cat([pair[:1], pair])


def per_rank_pairs(values: list[float]) -> list[list[float]]:
    """[grad_norm, loss] per rank from the values `gathered_values` brought (its first element left out)."""
    return [[values[i], values[i + 1]] for i in range(0, len(values), 2)]


def agreed(pairs: list[list[float]]) -> tuple[float, float]:
    """(grad_norm, loss) every rank judges: the largest norm and the mean loss, NaN kept."""
    norms, losses = [p[0] for p in pairs], [p[1] for p in pairs]
    norm = math.nan if any(math.isnan(n) for n in norms) else max(norms)
    return norm, sum(losses) / len(losses)


@dataclass
class SpikeGate:
    """The judge apply_update consults before it steps (`gate`); it keeps the verdict for the loop. `replay`
    (replay.py) names the cause while the weights are still those the update started from."""

    detector: SpikeDetector
    step: int
    batches: list[int]
    can_roll_back: bool
    replay: Callable[[SpikeVerdict], dict[str, Any]] | None = None
    # restore_point.model_state_restore_point for this session: a RestorePoint, or the line saying why none
    restore_point: Callable[[SpikeVerdict], Any] | None = None
    verdict: SpikeVerdict | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.detector.pending = None  # an attempt whose norm is not finite never reaches the judge

    def __call__(self, grad_norm: float, values: list[float]) -> str | None:
        pairs = per_rank_pairs(values)
        norm, loss = agreed(pairs)
        self.detector.pending = (loss, norm)
        signals, bounds = self.detector.judge(loss, norm)
        if not signals:
            return None
        verdict = SpikeVerdict(self.step, loss, norm, signals, bounds, pairs, list(self.batches))
        config = self.detector.config
        if self.replay is not None:
            verdict.replay = self.replay(verdict)
        if config.policy == "skip":
            verdict.action = "skipped"
        elif config.policy == "rollback":
            if self.detector.rollbacks >= config.max_rollbacks:
                verdict.action = "stopped"
                verdict.note = (
                    f"train.spike.max_rollbacks={config.max_rollbacks} rollbacks done: the run stops "
                    "instead of rolling back again"
                )
            elif not self.can_roll_back:
                verdict.action = "skipped"
                verdict.note = "no committed checkpoint to roll back to: the update is skipped instead"
            else:
                verdict.action = "rollback"
                self.place_restore(verdict)
        self.verdict = verdict
        return None if verdict.action == "recorded" else "spike"


    def place_restore(self, verdict: SpikeVerdict) -> None:
        """On a `model_state` cause, the checkpoint from before the documents read since the newest one
        (restore_point.py); with none early enough the run stops, its line the note. Decided here, with the
        action, so that the loop's stop check sees it."""
        if self.restore_point is None or (verdict.replay or {}).get("cause") != "model_state":
            return
        point = self.restore_point(verdict)
        if isinstance(point, str):
            verdict.action, verdict.note = "stopped", point
        else:
            verdict.restore_point = point


def skip_ahead(batch_index: int, skip_data: list[list[int]]) -> int:
    """The cursor position a loader at `batch_index` reads next, past every `train.skip_data` range it is
    in."""
    moved = True
    while moved:
        moved = False
        for first, count in skip_data:
            if first <= batch_index < first + count:
                batch_index, moved = first + count, True
    return batch_index


def upcoming_batches(batch_index: int, count: int, skip_data: list[list[int]]) -> list[int]:
    """The cursor positions of the next `count` microbatches from `batch_index`, skips applied."""
    out = []
    for _ in range(count):
        batch_index = skip_ahead(batch_index, skip_data)
        out.append(batch_index)
        batch_index += 1
    return out


def one_pass_batches(loader: Any) -> int:
    """Global batches that read the training data once: a folder's batches per pass; a mixture's, all its
    sources' windows over the windows a global batch takes (each source on its own share of them)."""
    per_epoch = getattr(loader, "batches_per_epoch", None)
    if per_epoch is not None:
        return max(1, int(per_epoch))
    return max(1, sum(loader.windows) // loader.global_batch_windows)


def check_skip_ranges(ranges: list[list[int]], loader: Any) -> None:
    """A `train.skip_data` range longer than one pass over the data would skip every document in it, and
    run.json describes a range pass by pass (what each pass's batches read): 10^12 batches over a small corpus
    would be a billion entries, gigabytes written before the first update. Refused as bad input before
    anything is written."""
    per_pass = one_pass_batches(loader)
    for first, count in ranges:
        if count > per_pass:
            raise ConfigError(
                f"train.skip_data range [{first}, {count}]: {count:,} batches is more than one pass over "
                f"the training data ({per_pass:,} global batches): it would skip every document; skip "
                "at most one pass"
            )


def skip_data_section(recipe: list[list[int]], detector: SpikeDetector, loader: Any, eos_id: int
                      ) -> list[dict[str, Any]]:
    """run.json's `skip_data`: every range the loader steps over, the recipe's (described now from the data)
    and the rollbacks' records, each naming the documents its batches read (docs/RUN_RECORD.md)."""
    check_skip_ranges(recipe, loader)  # before a range is described pass by pass
    given = [{"origin": "recipe", "first_batch": first, "batches": count,
              "read": read_documents(loader, eos_id, first, count)} for first, count in recipe]
    return [*given, *detector.skip_data]
