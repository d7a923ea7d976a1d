"""What a spike is, defined once for everyone who looks for one: the trainer's detector
(training/spikes/detector.py, on each applied update's loss and gradient norm), the verdict's grad_spikes rule
(report/verdict/stability.py, on the logged train windows' largest gradient norms) and watch's loss_spike
alert (report/watch/alerts.py, on a live run's window losses). Torch-free and at the floor, since the trainer
and the report both stand on it.

A value is a spike when it is not finite, or when its history holds at least `min_history` values and it lies
above

    bound = median + factor x scale,   scale = max(spread, floor_share x |median|)

of that history (its last `window` values). Median and spread are robust: a spike does not lift the bound that
judges the next one, where a mean and standard deviation would be dragged up by the first (OLMo-core's
skip-step optimizer uses a mean and std over its window instead). The spread is a robust standard deviation,
measured one of two ways according to what the history is:
- `level_spread`: MAD_TO_STD x the median absolute deviation of the values themselves. Single updates scatter
  about a level: over the trainer's window their noise is far larger than the loss's trend.
- `tail_spread`: the same, or the upper tail's spread where that is wider: the trainer's loss, one update's on
  the run's batch, whose bad batches lie above the core's noise more often than a normal's would.
- `step_spread`: the same of successive differences, over sqrt 2 since a difference carries two values' noise.
  Logged windows, each the mean of log_every updates, follow the trend more than they scatter about it: over
  the 20 windows of a falling loss the MAD of the values measures the descent, not the noise (a loss 3 nats
  above its trend would sit inside it), while differences leave a smooth trend out. The floor keeps a history
  without spread (identical values, MAD 0) from making every rounding wobble a spike, and says per signal how
  far above its median a value must lie in any case (MIN_SCALE_SHARE).

Where the numbers live: the trainer's factor, window and min_history are the recipe's `train.spike.*`
(config/train.py: they decide which updates are applied, so they belong to the recipe and its identity); the
logged windows' are the verdict's thresholds spike_factor, spike_median_window and spike_min_history
(report/verdict/thresholds.py), which watch takes from the lock like every threshold; the floor per signal is
MIN_SCALE_SHARE here, one table for both.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

MAD_TO_STD = 1.4826  # the MAD of a normal distribution times this is its standard deviation
UPPER_DECILE_Z = 1.2816  # a normal's 90th percentile lies this many standard deviations above its median
# The scale never falls below this share of the median, per signal. For the loss, only so that a window of
# identical values (MAD 0) does not make every wobble of rounding a spike. Gradient norms are heavy-tailed:
# on the CPU stability recipe a few healthy batches give a few times the window's median norm, far past 6
# MADs of its narrow core, and the run goes on unharmed, where a poisoned batch gives a larger multiple; with
# this floor a norm must also exceed (1 + factor / 2) times the median (4x at the trainer's default factor 6,
# 5x at the verdict's default spike_factor 8, the multiple its grad_spikes rule asks of a window). The
# trainer's, per update, grows on batches of fewer tokens (grad_norm_floor_share below).
MIN_SCALE_SHARE = {"loss": 0.01, "grad_norm": 0.5}
# The tokens per update at which the gradient norm's share above was measured (the CPU stability recipe,
# 8 x 64). A gradient over fewer tokens is a noisier estimate: its norm's spread about the median grows as one
# over the square root of the tokens (a mean over fewer samples), so on fewer tokens the floor grows by that
# factor. Measured on healthy CPU runs (BENCHMARKS.md "Spike false alarms"): at 128 tokens per update a norm
# reached 5.4x the window's median and at 64 tokens 7.1x, where the 4x floor called 3 and 5 false spikes per
# 1,000 updates; with the scaled floor (7x at 128 tokens, 9.5x at 64) none. The price, measured too: noise
# documents planted late in such runs moved the norm 1.1-6.2x, inside the healthy range, and the 4x floor
# caught 4 of 11 of them beside 12 false spikes; the scaled floor catches none of those, and still
# the early one the rollback tests plant (9.9x). Never lowered below this share: a larger batch keeps the 4x
# that its healthy runs never reached.
GRAD_NORM_SHARE_TOKENS = 512


def grad_norm_floor_share(tokens_per_update: int | None) -> float:
    """The gradient norm's floor share for updates over `tokens_per_update` tokens: MIN_SCALE_SHARE's,
    times sqrt(GRAD_NORM_SHARE_TOKENS / tokens) where the update has fewer tokens (None: the share as it
    is)."""
    share = MIN_SCALE_SHARE["grad_norm"]
    if not tokens_per_update or tokens_per_update >= GRAD_NORM_SHARE_TOKENS:
        return share
    return share * math.sqrt(GRAD_NORM_SHARE_TOKENS / tokens_per_update)


def level_spread(values: Sequence[float]) -> float:
    """A robust standard deviation of values scattering about a level: MAD_TO_STD x their median absolute
    deviation (0.0 for no values)."""
    if not values:
        return 0.0
    median = statistics.median(values)
    return MAD_TO_STD * statistics.median([abs(v - median) for v in values])


def tail_spread(values: Sequence[float]) -> float:
    """`level_spread`, or the spread the upper tail shows when it is heavier: the 90th percentile's distance
    above the median over a normal's (1.2816 standard deviations), once 10 values are in. One update's loss on
    a small batch is not normal: a batch of unusual text lies far above the rest more often than the core's
    MAD says (a CPU run of 1,000 healthy 128-token updates reached 5.75 of those spreads, 4.2 of this one).
    The 90th percentile of a window moves little for one or two spikes in it, so a spike still does not lift
    its bound."""
    spread = level_spread(values)
    if len(values) < 10:
        return spread
    ordered = sorted(values)
    return max(spread, (ordered[int(0.9 * (len(ordered) - 1))] - statistics.median(ordered)) / UPPER_DECILE_Z)


def step_spread(values: Sequence[float]) -> float:
    """A robust standard deviation of values following a trend: MAD_TO_STD x the median absolute deviation of
    successive differences, over sqrt 2. A trend adds to the differences too, which only makes the estimate,
    and every bound on it, more cautious. 0.0 with fewer than 3 values (two differences)."""
    if len(values) < 3:
        return 0.0
    diffs = [b - a for a, b in zip(values, values[1:], strict=False)]
    centre = statistics.median(diffs)
    return MAD_TO_STD * statistics.median(abs(d - centre) for d in diffs) / math.sqrt(2)


def robust_bound(values: Sequence[float], factor: float, floor_share: float = 0.01,
                 spread: Callable[[Sequence[float]], float] = level_spread) -> tuple[float, float, float]:
    """(median, scale, bound = median + factor x scale) of a non-empty history; scale = max(spread,
    floor_share x |median|) (the module's docstring)."""
    median = statistics.median(values)
    scale = max(spread(values), floor_share * abs(median))
    return median, scale, median + factor * scale


Bound = tuple[float, float, float]  # (median, scale, bound), as robust_bound gives it


def spike_against(value: float, history: Sequence[float], factor: float, floor_share: float, min_history: int,
                  spread: Callable[[Sequence[float]], float] = level_spread) -> tuple[bool, Bound | None]:
    """(is `value` a spike, the (median, scale, bound) it was held to, None before `min_history` values). A
    non-finite value is always one; `history` is the window the caller keeps (its last `window` values)."""
    if not math.isfinite(value):
        return True, None
    if len(history) < max(1, min_history):
        return False, None
    found = robust_bound(history, factor, floor_share, spread)
    return value > found[2], found
