"""training/spikes/bound.py: the one definition of a spike (median + factor x max(spread, floor)), its two
spreads, and the cases every caller relies on: before min_history nothing is judged, a non-finite value always
is a spike."""

from __future__ import annotations

import math
import statistics

import pytest

from pilotrun.training.spikes.bound import (
    MIN_SCALE_SHARE,
    level_spread,
    robust_bound,
    spike_against,
    step_spread,
    tail_spread,
)


def test_robust_bound_is_median_plus_factor_mads_with_a_floor():
    median, scale, bound = robust_bound([1.0, 2.0, 3.0, 4.0, 100.0], 2.0)
    assert median == 3.0 and scale == pytest.approx(1.4826) and bound == pytest.approx(3.0 + 2 * 1.4826)
    assert robust_bound([5.0] * 4, 6.0) == (5.0, 0.05, 5.0 + 6 * 0.05)  # MAD 0: 1% of the median


def test_the_step_spread_leaves_a_smooth_trend_out_where_the_level_spread_counts_it_as_noise():
    falling = [2.0 + 5.0 * math.exp(-s / 20.0) for s in range(5, 45, 5)]  # 8 windows of a falling loss
    assert level_spread(falling) > 1.0 and step_spread(falling) < 0.2  # the curvature alone
    # A loss 3 nats above its trend is a spike only against the step spread: the level spread takes the
    # descent itself for noise and lets a value inside the history's range pass.
    value = 2.0 + 5.0 * math.exp(-45 / 20.0) + 3.0
    assert spike_against(value, falling, 8.0, MIN_SCALE_SHARE["loss"], 5, step_spread)[0]
    assert not spike_against(value, falling, 8.0, MIN_SCALE_SHARE["loss"], 5, level_spread)[0]


def test_step_spread_is_the_robust_std_of_successive_differences():
    wobble = [3.0 + 0.1 * math.sin(i * 12.9898) for i in range(12)]
    diffs = [b - a for a, b in zip(wobble, wobble[1:], strict=False)]
    centre = statistics.median(diffs)
    assert step_spread(wobble) == 1.4826 * statistics.median(abs(d - centre) for d in diffs) / math.sqrt(2)
    assert step_spread([1.0, 2.0]) == 0.0 and level_spread([]) == 0.0


def test_the_floor_per_signal_holds_a_norm_to_a_multiple_of_its_median():
    flat = [1.0] * 10
    median, scale, bound = robust_bound(flat, 8.0, MIN_SCALE_SHARE["grad_norm"], step_spread)
    assert (median, scale, bound) == (1.0, 0.5, 5.0)  # the verdict's default: 5x the median
    assert robust_bound(flat, 6.0, MIN_SCALE_SHARE["grad_norm"])[2] == 4.0  # the trainer's default: 4x


def test_nothing_is_judged_before_min_history_and_a_non_finite_value_always_is_a_spike():
    assert spike_against(100.0, [1.0] * 4, 6.0, 0.01, 5) == (False, None)
    assert spike_against(math.nan, [], 6.0, 0.01, 5) == (True, None)
    assert spike_against(-math.inf, [1.0] * 10, 6.0, 0.01, 5) == (True, None)
    spiked, found = spike_against(1.07, [1.0] * 5, 6.0, 0.01, 5)
    assert spiked and found == (1.0, 0.01, 1.0 + 6 * 0.01)
    assert spike_against(1.06, [1.0] * 5, 6.0, 0.01, 5)[0] is False  # at the bound is not above it


def test_the_tail_spread_widens_for_a_heavy_upper_tail_and_not_for_one_spike():
    core = [6.0 + 0.01 * (i % 5 - 2) for i in range(50)]  # a narrow core: level spread 0.0148
    # as wide, for a tail no heavier
    assert level_spread(core) <= tail_spread(core) < 1.1 * level_spread(core)
    assert tail_spread(core[:9]) == level_spread(core[:9])
    heavy = core[:42] + [6.4, 6.5, 6.6, 6.7, 6.8, 6.5, 6.6, 6.9]  # one update in six on a hard batch
    spread = (sorted(heavy)[44] - statistics.median(heavy)) / 1.2816
    assert tail_spread(heavy) == spread > 10 * level_spread(heavy)
    # held by the tail, not the core's MAD
    assert not spike_against(7.2, heavy, 6.0, 0.01, 20, tail_spread)[0]
    assert spike_against(7.2, heavy, 6.0, 0.01, 20, level_spread)[0]
    spiked = core[:48] + [12.0, 13.0]  # two spikes in the window move its 90th percentile by one core value
    assert (
        tail_spread(spiked) == tail_spread(core) and spike_against(9.0, spiked, 6.0, 0.01, 20, tail_spread)[0]
    )


def test_the_gradient_norm_s_floor_share_grows_as_one_over_the_root_of_the_tokens_below_512():
    from pilotrun.training.spikes.bound import grad_norm_floor_share

    assert grad_norm_floor_share(None) == grad_norm_floor_share(512) == grad_norm_floor_share(10**6) == 0.5
    assert grad_norm_floor_share(128) == 1.0 and grad_norm_floor_share(64) == 0.5 * math.sqrt(8)
