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


def _steep_start(setting: Setting, steps: list[int]) -> np.ndarray:
    """The default law plus what the benchmark's flat-LR pilots show and the law does not: a first fall just
    past the warm-up steeper than the law's, and a slow wave after it."""
    s = np.array(steps, dtype=float)
    return truth(setting, steps, AREA) + 0.3 * np.exp(-(s - 10) / 6) + 0.03 * np.sin(s / 25)


def test_the_default_forecast_of_one_pilot_does_not_move_with_its_evaluation_cadence():
    """The same pilot evaluated every 5, 10 or 20 updates: the default's centre within 0.5% across the three
    (the target docs/FORECAST.md states); per e-fold from the first evaluation past the warm-up
    ("log-updates", the default before) the first evaluation, at 5 or 10 or 20, weighs the steep fall by as
    much as the cadence puts there, and the centre moves by more."""
    pilot, long = Setting(schedule("constant", 200), 200), Setting(schedule("constant", 2000), 2000)

    def centres(weighting: str) -> list[float]:
        out = []
        for every in (5, 10, 20):
            steps = list(range(every, 201, every))
            points = list(zip(steps, _steep_start(pilot, steps), strict=True))
            made = fc.forecast(points, pilot, long, [2000], weighting=weighting, draws=20)
            out.append(made["final"]["value"])
        return out

    def spread(values: list[float]) -> float:
        return (max(values) - min(values)) / min(values)

    assert fc.DEFAULT_WEIGHTING == "log-updates-from-2x-warmup"
    assert spread(centres(fc.DEFAULT_WEIGHTING)) <= 0.005
    assert spread(centres("log-updates")) > 0.005


def test_evaluations_before_twice_the_warm_up_change_nothing_in_the_default_forecast():
    """Exact: the default fits from twice the warm-up on, so a pilot's evaluations before it (a finer
    cadence's first ones) leave the whole forecast bit for bit as it was; where the first evaluation is at
    twice the warm-up (every 10 updates of a 10-update warm-up, the benchmark's pilots) it is "log-updates"'
    own."""
    pilot, long = Setting(schedule("wsd", 100), 100), Setting(schedule("wsd", 1000), 1000)
    every_10 = list(range(20, 101, 10))
    every_5 = list(range(15, 101, 5))
    coarse = list(zip(every_10, _steep_start(pilot, every_10), strict=True))
    early = [(s, v) for s, v in zip(every_5, _steep_start(pilot, every_5), strict=True) if s < 20]
    made = fc.forecast(coarse, pilot, long, [500, 1000], draws=20)
    assert fc.forecast(early + coarse, pilot, long, [500, 1000], draws=20) == made
    assert made["fitted_on"]["points"][0][0] == 20 and made["fitted_on"]["weighting"] == fc.DEFAULT_WEIGHTING
    per_e_fold = fc.forecast(coarse, pilot, long, [500, 1000], draws=20, weighting="log-updates")
    assert {**made, "fitted_on": None} == {**per_e_fold, "fitted_on": None}
    with_early = fc.forecast(early + coarse, pilot, long, [500, 1000], draws=20, weighting="log-updates")
    assert with_early != per_e_fold
    assert fc.fit_start(schedule("wsd", 100), "log-updates") == 11
    assert fc.fit_start(schedule("wsd", 100, warmup=0), fc.DEFAULT_WEIGHTING) == 1


def test_a_pilot_with_too_few_evaluations_from_twice_the_warm_up_is_refused_saying_so():
    pilot, long = Setting(schedule("constant", 100), 100), Setting(schedule("constant", 1000), 1000)
    steps = [12, 14, 16, 18, 20, 40, 60, 80, 100]
    points = list(zip(steps, _steep_start(pilot, steps), strict=True))
    why = "5 validation evaluation.s. past its warm-up of 10 updates from update 20 on"
    with pytest.raises(NoForecast, match=why):
        fc.forecast(points, pilot, long, [1000], draws=20)
    per_e_fold = fc.forecast(points, pilot, long, [1000], draws=20, weighting="log-updates")
    assert per_e_fold["fitted_on"]["points"][0][0] == 12


def _ar1_noise(rng: np.random.Generator, steps: int, every_updates: float, sigma: float) -> np.ndarray:
    """Noise at each update 0..steps, an AR(1) series whose correlation falls by e every `every_updates`
    updates (0: independent draws): what a law that misses a plateau leaves for several evaluations in a
    row."""
    if every_updates == 0:
        return rng.normal(0, sigma, steps + 1)
    phi = math.exp(-1 / every_updates)
    out = np.empty(steps + 1)
    out[0] = rng.normal(0, sigma)
    for i in range(1, steps + 1):
        out[i] = phi * out[i - 1] + rng.normal(0, sigma * math.sqrt(1 - phi**2))
    return out


def _mean_half_widths(correlated_over: float, draws_of_noise: int = 8) -> dict[tuple[int, str], float]:
    """The mean 90% half-width share (without the drift term, which the pilot measures on itself apart) of
    a constant pilot of 200 updates forecast to 6,000, the default law plus noise, evaluated every 5 and
    every 10 updates from the same noise, under each interval method."""
    pilot, long = Setting(schedule("constant", 200), 200), Setting(schedule("constant", 6000), 6000)
    halves: dict[tuple[int, str], list[float]] = {}
    for seed in range(draws_of_noise):
        noise = _ar1_noise(np.random.default_rng(seed), 200, correlated_over, 0.02)
        for every in (5, 10):
            steps = list(range(20, 201, every))
            points = list(zip(steps, truth(pilot, steps, AREA) + noise[steps], strict=True))
            for method in fc.INTERVAL_METHODS:
                made = fc.forecast(points, pilot, long, [6000], draws=40, drift_weight=0.0, interval=method)
                halves.setdefault((every, method), []).append(made["final"]["half_width_share"])
    return {key: float(np.mean(values)) for key, values in halves.items()}


def test_correlated_residuals_give_an_interval_that_does_not_narrow_with_the_evaluation_cadence():
    """AR(1) noise correlated over 20 updates (the fits' residuals' lag-1 +0.04 to +0.71 at every 10, +0.30
    to +0.82 at every 5, over the 8 draws): twice the evaluations are far fewer than twice the independent
    points. The default counts them as such: its mean interval at every 5 is within 5% of its own at every
    10 (measured: 0.96 of it); drawing each residual apart (`residual-bootstrap`, the default before)
    narrows it by more than 10% (measured: 0.80 of it)."""
    halves = _mean_half_widths(correlated_over=20)
    assert fc.DEFAULT_INTERVAL == "ar1-inflated"
    assert halves[(5, "ar1-inflated")] >= 0.95 * halves[(10, "ar1-inflated")]
    assert halves[(5, "residual-bootstrap")] < 0.90 * halves[(10, "residual-bootstrap")]


def test_independent_residuals_keep_about_the_independent_bootstraps_interval():
    """Independent noise: the residuals' lag-1 autocorrelation is near 0 (held at 0 when negative), and the
    default's mean interval is within 1.25x of the independent residual bootstrap's at either cadence, never
    narrower (measured: 1.05x at every 10, 1.02x at every 5; both narrow at every 5, as twice the independent
    points should)."""
    halves = _mean_half_widths(correlated_over=0)
    for every in (5, 10):
        ratio = halves[(every, "ar1-inflated")] / halves[(every, "residual-bootstrap")]
        assert 1.0 <= ratio <= 1.25


def test_the_residuals_lag_1_autocorrelation_is_held_between_0_and_its_cap():
    assert fc.lag1_autocorrelation(np.array([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])) == 0.0
    assert fc.lag1_autocorrelation(np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])) == pytest.approx(0.5)
    assert fc.lag1_autocorrelation(np.repeat([1.0, -1.0], 50)) == fc.RHO_MAX
    assert fc.lag1_autocorrelation(np.zeros(6)) == 0.0
