"""The checks' decisions against synthetic validation losses: a recipe set right, too high and too low, and a
batch below, at and above the critical one."""

from __future__ import annotations

import json
import math

import pytest

from pilotrun.report.verdict.tuning import (
    LR_FACTORS,
    critical_batch,
    factor_name,
    judge_batch,
    judge_lr,
    noise_yardstick,
    read_tune_result,
    tune_evidence_lines,
)

NOISE = 0.01


def sweep(best_factor: float, curvature: float = 0.2) -> dict[float, float]:
    """A bowl in log2(factor) with its bottom at best_factor, 3.0 there."""
    return {f: 3.0 + curvature * (math.log2(f) - math.log2(best_factor)) ** 2 for f in LR_FACTORS}


def test_a_recipe_at_the_best_rate_is_within_one_step_and_named_right():
    found = judge_lr(sweep(1.0), NOISE)
    assert found["within_one_step"] is True
    assert found["direction"] == "right"
    assert found["best_factor"] == 1.0
    assert found["sensitivity"] == pytest.approx(0.2)
    assert "within one step of the best seen" in found["line"]


def test_a_recipe_one_grid_step_off_is_still_within_one_step():
    found = judge_lr(sweep(math.sqrt(2)), NOISE)
    assert found["within_one_step"] is True and found["best_factor"] == pytest.approx(math.sqrt(2))


def test_a_rate_too_high_names_the_smaller_factor_and_by_how_much():
    found = judge_lr(sweep(0.25), NOISE)  # the best lies below the sweep: its smallest factor wins
    assert found["direction"] == "too high"
    assert found["within_one_step"] is False
    assert found["best_factor"] == 0.5
    assert found["gain"] == pytest.approx(0.2 * (4 - 1))
    assert "1/2x reaches a validation loss 0.6 lower" in found["line"]
    assert "edge of the sweep" in found["line"]


def test_a_rate_too_low_names_the_larger_factor():
    found = judge_lr(sweep(2.0), NOISE)
    assert (found["direction"], found["best_factor"], found["edge"]) == ("too low", 2.0, True)


def test_a_difference_within_the_noise_is_not_a_finding():
    losses = {f: 3.0 for f in LR_FACTORS}
    losses[2.0] = 3.0 - NOISE / 2
    assert judge_lr(losses, NOISE)["within_one_step"] is True


def test_the_sweep_needs_the_recipes_own_branch():
    with pytest.raises(ValueError, match="factor 1"):
        judge_lr({0.5: 3.0, 2.0: 3.1}, NOISE)


def test_the_critical_batch_is_the_largest_that_keeps_up_with_its_band():
    found = critical_batch({0.5: 3.00, 1.0: 3.005, 2.0: 3.02, 4.0: 3.10}, NOISE)
    assert found["critical"] == 1.0
    assert found["band"] == [1.0, 2.0]
    assert found["keeps_up"] == [0.5, 1.0]


def test_a_batch_below_the_critical_one_could_grow():
    points = [{"step": 40, "losses": {0.5: 3.0, 1.0: 3.0, 2.0: 3.004, 4.0: 3.008}},
              {"step": 80, "losses": {0.5: 2.5, 1.0: 2.5, 2.0: 2.5, 4.0: 2.5}}]
    found = judge_batch(points, NOISE)
    assert (found["critical"], found["band"], found["direction"]) == (4.0, [4.0, None], "could grow")
    assert "open above" in found["line"]
    assert "below the critical batch" in found["line"]


def test_a_batch_above_the_critical_one_is_named_too_large():
    points = [{"step": 40, "losses": {0.5: 3.0, 1.0: 3.05, 2.0: 3.1, 4.0: 3.2}},
              {"step": 80, "losses": {0.5: 2.5, 1.0: 2.5, 2.0: 2.55, 4.0: 2.6}}]
    found = judge_batch(points, NOISE)
    assert (found["critical"], found["band"], found["direction"]) == (0.5, [0.5, 1.0], "too large")
    assert [p["critical"] for p in found["points"]] == [0.5, 1.0]


def test_a_batch_at_the_critical_one_is_right():
    found = judge_batch([{"step": 40, "losses": {0.5: 3.0, 1.0: 3.0, 2.0: 3.2, 4.0: 3.4}}], NOISE)
    assert found["direction"] == "right"


def test_factor_names():
    assert [factor_name(f) for f in (*LR_FACTORS, 4.0)] == ["1/2", "1/sqrt2", "1", "sqrt2", "2", "4"]


def test_the_yardstick_scales_the_window_noise_to_one_evaluation():
    losses = [3.0 + 0.1 * math.sin(i * i) for i in range(20)]  # irregular, so that its spread is not 0
    per_window = noise_yardstick(losses, 100, 100)
    assert per_window is not None and per_window > 0
    assert noise_yardstick(losses, 100, 400) == pytest.approx(per_window / 2)
    assert noise_yardstick(losses[:2], 100, 100) is None


def test_the_verdict_reads_the_findings_as_evidence_lines(tmp_path):
    assert tune_evidence_lines(tmp_path) == []
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "tune.json").write_text(json.dumps(
        {"lr": {"line": "the recipe's learning rates look too high", "from_steps": [40], "updates": 8}}))
    assert read_tune_result(tmp_path)["lr"]["updates"] == 8
    assert tune_evidence_lines(tmp_path) == [
        "lr check (from step 40, 8 updates a branch): the recipe's learning rates look too high"]


def test_a_diverged_branch_is_never_the_best():
    losses = sweep(1.0)
    losses[2.0] = math.inf
    found = judge_lr(losses, NOISE)
    assert found["best_factor"] == 1.0 and found["within_one_step"] is True
    assert found["sensitivity"] == pytest.approx(0.2)  # across the finite ones
    assert critical_batch({0.5: 3.0, 1.0: 3.0, 2.0: math.inf, 4.0: math.inf}, NOISE)["band"] == [1.0, 2.0]
