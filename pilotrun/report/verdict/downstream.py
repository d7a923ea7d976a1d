"""The in-loop downstream figures (`downstream` events, training/callbacks/downstream_eval.py) read back: the
verdict's `downstream` rule, watch's fall-back alert and the pilot's figures a recipe lock carries.

At pilot scale a multiple-choice accuracy sits near chance and moves by whole examples: on n examples with
chance c, a model that only guesses scores c give or take sqrt(c (1 - c) / n) (one standard error of a
guesser, `guess_noise`), 0.068 for 40 four-way examples. So the figures are shown, never judged as a
model's quality: the rule PASSes when every task's last figure is above chance by more than that noise and
WARNs otherwise (never FAILs); watch alerts only when a task that had risen clear of chance (by more than
RISEN_NOISES of it) is back within one noise of chance, or, against a lock, below what the pilot measured on
the same task file (same sha256) by more than RISEN_NOISES of it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from pilotrun.report.verdict.thresholds import PASS, WARN, Finding, Thresholds
from pilotrun.run.record import is_finite_number

if TYPE_CHECKING:
    from pilotrun.report.record_check.summarize import Summary

RISEN_NOISES = 2.0


def guess_noise(chance: float, examples: int) -> float:
    """One standard error of a guesser's accuracy: sqrt(chance (1 - chance) / examples)."""
    return math.sqrt(chance * (1 - chance) / examples) if examples > 0 else math.inf


def task_series(events: list[dict[str, Any]]) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """task -> [(step, its figures)] of the `downstream` events, in order (figures with a finite acc only)."""
    series: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for event in events:
        if event.get("event") != "downstream" or not isinstance(event.get("tasks"), dict):
            continue
        for name, figures in event["tasks"].items():
            if isinstance(figures, dict) and is_finite_number(figures.get("acc")) \
                    and is_finite_number(figures.get("chance")) and isinstance(figures.get("examples"), int):
                series.setdefault(str(name), []).append((int(event["step"]), figures))
    return series


def _describe(name: str, points: list[tuple[int, dict[str, Any]]]) -> str:
    step, last = points[-1]
    noise = guess_noise(last["chance"], last["examples"])
    first = f"; {points[0][1]['acc']:.3f} at step {points[0][0]}" if len(points) > 1 else ""
    return (f"{name} acc {last['acc']:.3f} at step {step} (chance {last['chance']:.3f}, "
            f"{last['acc'] - last['chance']:+.3f} above it, +-{noise:.3f} a guesser's noise on "
            f"{last['examples']} examples{first})")


def judge_downstream(summary: Summary, t: Thresholds) -> Finding:
    threshold = ("shown, never failed: each task's last figure above chance by more than a guesser's noise "
                 "(sqrt(c(1-c)/n)) PASSes, else WARN; near chance and noisy at pilot scale")
    series = task_series(summary.kept_events)
    if not series:
        return Finding(
            PASS,
            "no in-loop task scored (train.downstream.tasks, train.downstream.every)",
            threshold,
            "downstream events of the kept history",
        )
    near = [name for name, points in series.items()
            if points[-1][1]["acc"] - points[-1][1]["chance"] <= guess_noise(points[-1][1]["chance"],
                                                                            points[-1][1]["examples"])]
    figure = "; ".join(_describe(name, points) for name, points in series.items())
    evidence = f"downstream events of the kept history ({sum(len(p) for p in series.values())} task scorings)"
    if near:
        return Finding(
            WARN,
            f"{figure}. Within a guesser's noise of chance: {', '.join(near)} (expected of a small "
            "pilot: it says nothing against the recipe, nor would a higher figure say much for it)",
            threshold,
            evidence,
        )
    return Finding(PASS, figure, threshold, evidence)


def fallback_problem(points: list[tuple[int, dict[str, Any]]]) -> tuple[str, float, float] | None:
    """(message, figure, bound) when the task rose clear of chance and its last figure is back near it."""
    if len(points) < 2:
        return None
    step, last = points[-1]
    noise = guess_noise(last["chance"], last["examples"])
    best_step, best = max(points[:-1], key=lambda p: p[1]["acc"])
    risen = best["acc"] - best["chance"] > RISEN_NOISES * noise
    if risen and last["acc"] - last["chance"] <= noise:
        bound = last["chance"] + noise
        return (
            f"acc {last['acc']:.3f} at step {step} fell back toward chance {last['chance']:.3f} (within "
            f"+-{noise:.3f}, a guesser's noise on {last['examples']} examples) after {best['acc']:.3f} at "
            "step "
            f"{best_step}",
            last["acc"],
            bound,
        )
    return None


def below_pilot_problem(points: list[tuple[int, dict[str, Any]]], pilot: dict[str, Any] | None
                        ) -> tuple[str, float, float] | None:
    """(message, figure, bound) when the task, at or past the pilot's last scored step, is below the pilot's
    figure on the same task file by more than RISEN_NOISES guesser's noises."""
    if not isinstance(pilot, dict) or not points or not is_finite_number(pilot.get("acc")):
        return None
    step, last = points[-1]
    if last.get("sha256") != pilot.get("sha256") or step < int(pilot.get("step") or 0):
        return None
    bound = pilot["acc"] - RISEN_NOISES * guess_noise(last["chance"], last["examples"])
    if last["acc"] < bound:
        return (
            f"acc {last['acc']:.3f} at step {step} is below the pilot's {pilot['acc']:.3f} at its step "
            f"{pilot.get('step')} on the same task file by more than {RISEN_NOISES:g} guesser's noises "
            "(bound "
            f"{bound:.3f})",
            last["acc"],
            bound,
        )
    return None


def pilot_figures(summary: Summary) -> dict[str, Any]:
    """What a lock records of the pilot's in-loop tasks: per task its file's sha256, the examples, chance, the
    last figure and its step, and the whole series (step, acc)."""
    return {name: {"sha256": points[-1][1].get("sha256"), "examples": points[-1][1]["examples"],
                   "chance": points[-1][1]["chance"], "acc": points[-1][1]["acc"],
                   "acc_norm": points[-1][1].get("acc_norm"), "step": points[-1][0],
                   "series": [[step, figures["acc"]] for step, figures in points]}
            for name, points in task_series(summary.kept_events).items()}
