"""The forecast's fit, on curves drawn from a known law plus noise: parameters recovered, the interval's
coverage,
the repeated-data weights, and every refusal."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pilotrun.report.projection import forecast as fc
from pilotrun.report.projection.forecast import NoForecast, Setting, areas, data_weights, multipliers

TRUE = {"L0": 2.0, "A": 3.0, "alpha": 0.5, "C": 0.004}  # the LR-annealing law's
AREA = {
    "L0": 0.0,
    "A": 9.0,
    "alpha": 0.07,
    "C": 0.0,
}  # the default law's, near what the benchmark's pilots fit


def schedule(kind: str, horizon: int, warmup: int = 10) -> dict:
    return {
        "kind": kind,
        "warmup_steps": warmup,
        "horizon": horizon,
        "min_lr_ratio": 0.1,
        "decay_fraction": 0.2,
    }


def truth(setting: Setting, steps: list[int], law: dict = TRUE) -> np.ndarray:
    s1, s2 = areas(multipliers(setting.schedule, setting.steps), np.ones(setting.steps))
    idx = np.asarray(steps)
    return law["L0"] + law["A"] * s1[idx] ** -law["alpha"] - law["C"] * s2[idx]


def pilot_points(
    setting: Setting, every: int, sigma: float, rng: np.random.Generator, law: dict = TRUE
) -> list[tuple[int, float]]:
    steps = list(range(every, setting.steps + 1, every))
    return list(zip(steps, truth(setting, steps, law) + rng.normal(0, sigma, len(steps)), strict=True))


PILOT = Setting(schedule("cosine", 200), 200)
LONG = Setting(schedule("cosine", 2000), 2000)
LONG_STEPS = list(range(100, 2001, 100))


def test_the_multipliers_are_the_schedules():
    eta = multipliers(schedule("wsd", 100), 100)
    assert (
        eta[0] == pytest.approx(0.1) and eta[50] == 1.0 and eta[-1] == pytest.approx(0.1 + 0.9 / 20, abs=1e-9)
    )
    assert np.all(multipliers(schedule("constant", 50), 50)[10:] == 1.0)


def test_a_noise_free_curve_gives_back_its_parameters():
    fit = fc.fit_law("annealing", *_xy(pilot_points(PILOT, 10, 0.0, np.random.default_rng(0))))
    got = fit.parameters()
    assert got["alpha"] == pytest.approx(TRUE["alpha"], rel=0.1)
    assert got["L0"] == pytest.approx(TRUE["L0"], abs=0.1)
    assert got["C"] == pytest.approx(TRUE["C"], rel=0.2)
    area = fc.fit_law(fc.DEFAULT_LAW, *_xy(pilot_points(PILOT, 10, 0.0, np.random.default_rng(0), AREA)))
    assert area.parameters() == pytest.approx({"A": AREA["A"], "alpha": AREA["alpha"]}, rel=0.05)


def _xy(points):
    x = np.array([s for s, _ in points if s > 10])
    y = np.array([v for s, v in points if s > 10])
    _, s1, s2 = PILOT.features(x)
    return x, y, s1, s2


@pytest.mark.parametrize("law, drawn", [(fc.DEFAULT_LAW, AREA), ("annealing", TRUE)])
def test_the_forecast_of_a_known_law_lands_on_its_long_run_and_covers_it(law, drawn):
    inside, errors, refused = 0, [], 0
    for seed in range(12):
        points = pilot_points(PILOT, 10, 0.005, np.random.default_rng(seed), drawn)
        try:
            out = fc.forecast(points, PILOT, LONG, LONG_STEPS, law=law, seed=seed, draws=60)
        except (
            NoForecast
        ) as why:  # a noise draw the pilot's own hold-out check finds too loose: said, not guessed
            assert "interval is too wide" in str(why)
            refused += 1
            continue
        final, real = out["final"], truth(LONG, [2000], drawn)[0]
        inside += final["low"] <= real <= final["high"]
        errors.append(abs(final["value"] - real) / real)
    # A 90% interval: all but 2 of those given (binomial, p ~ 0.9 when the interval is honest).
    assert refused <= 2 and inside >= 12 - refused - 2
    assert np.median(errors) < 0.02
    assert out["curve"][-1][0] == 2000 and len(out["curve"]) == len(LONG_STEPS)
    assert out["law"] == law and set(out["parameters"]) >= {"A", "alpha"}


def test_the_schedule_matters_a_constant_pilot_forecasts_a_cosine_long_run():
    constant = Setting(schedule("constant", 200), 200)
    points = pilot_points(constant, 10, 0.0, np.random.default_rng(0), AREA)
    out = fc.forecast(points, constant, LONG, LONG_STEPS, draws=30)
    # Two laws fitted alike: the schedule-blind one takes the long run's cosine for the pilot's constant LR.
    blind = fc.forecast(points, constant, LONG, LONG_STEPS, law="steps", draws=30)
    real = truth(LONG, [2000], AREA)[0]
    assert abs(out["final"]["value"] - real) < abs(blind["final"]["value"] - real)


def test_repeated_tokens_are_worth_less_after_the_first_pass():
    w = data_weights(40, 10, 100)  # 10 updates a pass
    assert np.all(w[:10] == 1.0)
    assert w[19] == pytest.approx(math.exp(-1 / fc.REPEAT_R_STAR)) and np.all(np.diff(w[10:]) < 0)
    assert np.all(data_weights(5, None, None) == 1.0)


@pytest.mark.parametrize(
    "points, why",
    [
        ([(20, 5.0), (40, 4.0), (60, 3.5)], "a fit needs at least"),
        ([(s, 5.0 + 0.001 * s) for s in range(20, 220, 20)], "does not fall"),
        ([(s, 5.0 - 0.001 * s + (0.3 if (s // 20) % 2 else -0.3)) for s in range(20, 220, 20)], "too noisy"),
    ],
)
def test_a_pilot_too_short_flat_or_noisy_gets_no_forecast(points, why):
    with pytest.raises(NoForecast, match=why):
        fc.forecast(points, PILOT, LONG, LONG_STEPS, draws=20)


def test_a_schedule_the_laws_do_not_model_is_refused():
    points = pilot_points(PILOT, 10, 0.0, np.random.default_rng(0))
    with pytest.raises(NoForecast, match="schedule kind 'linear' is not modelled"):
        fc.forecast(points, PILOT, Setting(schedule("linear", 2000), 2000), LONG_STEPS, draws=20)


def test_non_finite_and_warm_up_evaluations_are_left_out_of_the_fit():
    points = pilot_points(PILOT, 10, 0.0, np.random.default_rng(0), AREA)
    out = fc.forecast(points + [(5, 1.0), (205, float("nan"))], PILOT, LONG, LONG_STEPS, draws=20)
    assert [p[0] for p in out["fitted_on"]["points"]] == list(range(20, 201, 10))


NOFLOOR = {"L0": 0.0, "A": 9.0, "alpha": 0.07, "C": 0.004}  # an annealing term and no floor


def _branch_points(branch: Setting, every: int, law: dict) -> list[tuple[int, float]]:
    s1, s2 = areas(branch.eta(), np.ones(branch.steps))
    steps = range(every, branch.steps + 1, every)
    return [(s, law["L0"] + law["A"] * s1[s] ** -law["alpha"] - law["C"] * s2[s]) for s in steps]


def test_a_branch_follows_the_pilots_schedule_to_its_branch_point_then_its_own():
    pilot = Setting(schedule("constant", 200), 200)
    branch = Setting(pilot.schedule, 150, then=(100, {**schedule("wsd", 150), "decay_fraction": 50 / 150}))
    eta = branch.eta()
    assert np.array_equal(eta[:100], multipliers(pilot.schedule, 100)) and eta[100] == 1.0
    assert eta[101] < 1.0 and eta[-1] == pytest.approx(0.1 + 0.9 / 50)


def test_a_cooldown_branch_pins_the_annealing_term_a_constant_pilot_cannot():
    pilot = Setting(schedule("constant", 200), 200)
    points = pilot_points(pilot, 10, 0.0, np.random.default_rng(0), NOFLOOR)
    branch = Setting(pilot.schedule, 150, then=(100, {**schedule("wsd", 150), "decay_fraction": 50 / 150}))
    with_branch = ((_branch_points(branch, 5, NOFLOOR), branch),)
    long_run = Setting(schedule("wsd", 2000), 2000)
    real = truth(long_run, [2000], NOFLOOR)[0]
    alone = fc.forecast(points, pilot, long_run, LONG_STEPS, law="annealing-nofloor", draws=20)
    pinned = fc.forecast(
        points, pilot, long_run, LONG_STEPS, law="annealing-nofloor", draws=20, branches=with_branch
    )
    # The constant pilot's LR never falls (S2 = 0): its own points say nothing of C; the branch's decay does.
    assert alone["parameters"]["C"] == 0.0
    assert pinned["parameters"]["C"] == pytest.approx(NOFLOOR["C"], rel=0.05)
    assert abs(pinned["final"]["value"] - real) < abs(alone["final"]["value"] - real)
    # The branch's points before its branch point are the pilot's own, not fitted twice.
    early = ((_branch_points(branch, 5, NOFLOOR)[:20], branch),)
    same = fc.forecast(points, pilot, long_run, LONG_STEPS, law="annealing-nofloor", draws=20, branches=early)
    assert same["final"]["value"] == alone["final"]["value"]


def test_the_refit_on_a_long_runs_own_evaluations_thins_them_and_keeps_the_latest(monkeypatch):
    pilot_fit = pilot_points(PILOT, 10, 0.0, np.random.default_rng(0), AREA)[1:]
    own = [(s, float(v)) for s, v in zip(LONG_STEPS, truth(LONG, LONG_STEPS, AREA), strict=True)]
    seen = []
    real_fit = fc.fit_law
    monkeypatch.setattr(fc, "fit_law", lambda law, x, *rest: seen.append(x.copy()) or real_fit(law, x, *rest))
    monkeypatch.setattr(fc, "MAX_OWN_POINTS", 7)
    at = fc.refitted_at("area", pilot_fit, PILOT, own, LONG, 2000)
    steps = seen[0][len(pilot_fit) :]
    assert len(steps) <= 7 and steps[-1] == 1900 and np.all(np.diff(steps) > 0)
    assert at == pytest.approx(truth(LONG, [2000], AREA)[0], rel=1e-3)


def test_the_log_updates_weighting_gives_each_e_fold_of_updates_the_same_weight():
    x = np.arange(20, 101, 10)
    weights = fc.fit_weights(x, "log-updates")
    assert weights.mean() == pytest.approx(1.0)
    # the first and the last: the log-distance to their one neighbour; the others half the one around them
    assert weights[0] / weights[-1] == pytest.approx(math.log(30 / 20) / math.log(100 / 90))
    assert weights[3] / weights[-1] == pytest.approx(math.log(60 / 40) / 2 / math.log(100 / 90))
    doubling = fc.fit_weights(np.array([10, 20, 40, 80, 160]), "log-updates")
    assert doubling == pytest.approx(np.ones(5))
    shared = fc.fit_weights(np.array([20, 40, 40, 80]), "log-updates")  # a branch's point at a pilot's step
    assert shared[1] == shared[2] == pytest.approx(shared[0] / 2)
    assert fc.fit_weights(x, "equal") is None
    with pytest.raises(ValueError, match="unknown fit weighting"):
        fc.fit_weights(x, "linear")


def test_a_pilot_that_plateaus_in_its_last_e_fold_is_forecast_lower_weighed_per_e_fold():
    """A constant-LR pilot on the default law whose loss stops falling over its last updates (a plateau, as
    the benchmark's tiny model shows from update 60 to 100): weighed alike, its many late points flatten
    alpha and the forecast of a long run that falls past the plateau is high; weighed per e-fold, less so."""
    pilot, long = Setting(schedule("constant", 100), 100), Setting(schedule("constant", 1000), 1000)
    steps = list(range(20, 101, 10))
    law = truth(pilot, steps, AREA)
    flat = np.where(np.array(steps) > 60, law[steps.index(60)] - 0.02 * (np.array(steps) - 60) / 40, law)
    points = list(zip(steps, flat, strict=True))
    real = truth(long, [1000], AREA)[0]
    by = {w: fc.forecast(points, pilot, long, [1000], weighting=w, draws=20) for w in fc.FIT_WEIGHTINGS}
    assert by["equal"]["final"]["value"] > by["log-updates"]["final"]["value"] > real
    assert {w: f["fitted_on"]["weighting"] for w, f in by.items()} == {w: w for w in fc.FIT_WEIGHTINGS}
    assert by[fc.DEFAULT_WEIGHTING] == fc.forecast(points, pilot, long, [1000], draws=20)
