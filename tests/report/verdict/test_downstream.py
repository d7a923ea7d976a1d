"""pilotrun/report/verdict/downstream.py: the downstream rule shows the figures and never fails; the fall-back
and below-the-pilot judgements watch alerts on; the pilot's figures a lock carries."""

from __future__ import annotations

import math
from types import SimpleNamespace

from pilotrun.report.verdict.downstream import (
    below_pilot_problem,
    fallback_problem,
    guess_noise,
    judge_downstream,
    pilot_figures,
    task_series,
)
from pilotrun.report.verdict.thresholds import PASS, WARN, Thresholds


def scored(step: int, acc: float, examples: int = 40, chance: float = 0.25, sha: str = "abc") -> dict:
    return {
        "event": "downstream",
        "step": step,
        "session_id": "s",
        "tasks": {
            "next": {"acc": acc, "acc_norm": acc, "chance": chance, "examples": examples, "sha256": sha}
        },
    }


def summary_of(*events) -> SimpleNamespace:
    return SimpleNamespace(kept_events=list(events))


def test_a_guessers_noise_is_one_standard_error_of_chance():
    assert guess_noise(0.25, 40) == math.sqrt(0.25 * 0.75 / 40)
    assert guess_noise(0.5, 0) == math.inf


def test_the_rule_passes_clear_of_chance_warns_near_it_and_never_fails():
    clear = judge_downstream(summary_of(scored(20, 0.3), scored(40, 0.55)), Thresholds())
    assert clear.status == PASS and "next acc 0.550 at step 40 (chance 0.250, +0.300 above it" in clear.figure
    assert "0.300 at step 20" in clear.figure
    near = judge_downstream(summary_of(scored(40, 0.3)), Thresholds())
    assert near.status == WARN and "Within a guesser's noise of chance: next" in near.figure
    assert judge_downstream(summary_of(scored(40, 0.0)), Thresholds()).status == WARN
    nothing = judge_downstream(summary_of({"event": "train", "step": 1}), Thresholds())
    assert nothing.status == PASS and "no in-loop task" in nothing.figure


def test_a_fall_back_toward_chance_after_rising_is_named_and_a_plain_plateau_is_not():
    risen_then_back = task_series([scored(10, 0.25), scored(20, 0.5), scored(30, 0.3)])["next"]
    message, figure, bound = fallback_problem(risen_then_back)
    assert "fell back toward chance 0.250" in message and "after 0.500 at step 20" in message
    assert figure == 0.3 and bound == 0.25 + guess_noise(0.25, 40)
    assert fallback_problem(task_series([scored(10, 0.25), scored(20, 0.3)])["next"]) is None  # never risen
    assert fallback_problem(task_series([scored(10, 0.5), scored(20, 0.45)])["next"]) is None  # still clear
    assert fallback_problem(task_series([scored(10, 0.5)])["next"]) is None


def test_below_the_pilot_only_on_the_same_task_file_at_or_past_the_pilots_step():
    pilot = {"acc": 0.6, "step": 40, "sha256": "abc"}
    points = task_series([scored(40, 0.4)])["next"]
    assert "below the pilot's 0.600" in below_pilot_problem(points, pilot)[0]
    # before the pilot's step
    assert below_pilot_problem(task_series([scored(30, 0.4)])["next"], pilot) is None
    assert below_pilot_problem(task_series([scored(40, 0.4, sha="other")])["next"], pilot) is None
    assert below_pilot_problem(task_series([scored(40, 0.55)])["next"], pilot) is None  # within the noise
    assert below_pilot_problem(points, None) is None


def test_the_pilots_figures_are_its_last_per_task_with_the_series():
    figures = pilot_figures(summary_of(scored(20, 0.3), scored(40, 0.55)))
    assert figures == {
        "next": {
            "sha256": "abc",
            "examples": 40,
            "chance": 0.25,
            "acc": 0.55,
            "acc_norm": 0.55,
            "step": 40,
            "series": [[20, 0.3], [40, 0.55]],
        }
    }
    assert task_series([{"event": "downstream", "step": 1, "tasks": {"x": {"acc": float("nan"), "chance": 0.5,
                                                                          "examples": 2}}}]) == {}
