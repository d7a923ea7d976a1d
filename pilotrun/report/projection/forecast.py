"""What validation loss the long run will reach: a schedule-aware law fitted to the pilot's validation losses,
its prediction at the long run's evaluation steps and schedule, and a 90% interval from what the fit leaves
unexplained.

Torch-free (numpy): the lock writes it (commands/freeze.py, through forecast_record.py, which also grades it
for summarize), watch holds the long run to its band (report/watch/forecast_watch.py). docs/FORECAST.md says
which law and why, with the measurement.

The laws (x: applied updates; eta_i: the LR multiplier of update i, pilotrun/optim/lr_shape.py):
- `area`, the default: L = A * S1^-alpha, S1 = sum of eta_i * w_i (the forward area of the LR-annealing law of
  Tissue et al. 2024, arXiv 2408.11029), with no floor;
- `annealing`, that law whole: L = L0 + A * S1^-alpha - C * S2, S2 = sum of m_i, m_i = lam * m_(i-1) + max(0,
  eta_(i-1) - eta_i) (the annealing area, a momentum of the LR's decreases; a warm-up's increases are not
  annealing); `annealing-nofloor` without L0; `area+floor` with it;
- `steps` (L = A * x^-alpha) and `steps+floor`, blind to the schedule.
Which is the default and why (measured): DEFAULT_LAW below and docs/FORECAST.md.
w_i weighs each update's tokens by what they are worth: 1 on the first pass over the training split, then
exp(-R / R*) where R is the passes already repeated (Muennighoff et al. 2023, arXiv 2305.16264, R* = 15.4: the
marginal worth of their effective-data formula D' = U + U R* (1 - exp(-R / R*))).

The fit: for each alpha on a grid, a law is linear in (L0, A, C): least squares, with A > 0, C >= 0; the alpha
of least squared error wins. The interval: a residual bootstrap (the pilot's points are the fit plus resampled
residuals, refitted BOOTSTRAP times; the residuals scaled up as fewer independent points by their lag-1
autocorrelation: DEFAULT_INTERVAL), each prediction plus one resampled residual (the long run's own
evaluation is as noisy as the pilot's), widened by the drift the pilot measures on itself (holdout_drift); its
5th and 95th percentiles. The band watch holds the run to is the same at BAND_LEVEL, never narrower than
BAND_MIN_SHARE.

Refused ("no forecast: <why>", never a number): fewer than MIN_POINTS evaluations from the fit's start
(fit_start: twice the warm-up under the default weighting); a loss
that does not fall; residual noise above MAX_NOISE_SHARE of the fall it is fitted to; an interval wider than
MAX_HALF_WIDTH of the value; a schedule kind the laws do not model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from pilotrun.optim.lr_shape import lr_multiplier

LEVEL = 0.90
BAND_LEVEL = 0.99
MIN_POINTS = 6
MAX_NOISE_SHARE = 0.25
MAX_HALF_WIDTH = 0.10
BOOTSTRAP = 200
ALPHAS = np.geomspace(0.02, 3.0, 64)
REFINE = 41  # the fine grid's points between the best alpha's neighbours
ANNEALING_LAMBDA = 0.99
REPEAT_R_STAR = 15.4
# The bootstrap's spread says how well the law fits the pilot, not how far it carries: the interval also takes
# the drift the pilot measures on itself (holdout_drift: fitted on its first HOLDOUT_SHARE, the median miss on
# the rest per e-fold of updates) times the e-folds to the target step, by these weights. The 90% interval's
# weight is chosen held out (benchmarks/bench_forecast.py, docs/FORECAST.md): of the weights in
# DRIFT_WEIGHTS, the narrowest that held every healthy long run of one half of the benchmark's pilots inside,
# graded on the other half: 1/4 on either half, holding the other 6 of 6 (no drift: 8 of 12 inside; measured
# with the independent residual bootstrap, before DEFAULT_INTERVAL: not chosen again since). Half of
# it made WSD and constant intervals of +-6.3-9.6% around forecasts that missed by at most 4.4%: a pilot's
# plateau makes its own hold-out miss large while the long run falls past it. The band's weight is watch's
# (its 99%), unchanged.
HOLDOUT_SHARE = 0.6
WIDEN = {LEVEL: 0.25, BAND_LEVEL: 1.5}
DRIFT_WEIGHTS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0)
# The band watch holds a run to is never narrower than this share of the prediction either side. Measured on
# the benchmark's healthy long runs: between twice the pilot's updates and the middle of the run a tiny
# model's loss rose up to 7.6% above the law (a plateau before a second fall, at the same data for every
# seed), then met it again; +-5% (the pilot's own loss envelope's share) alerted on 3 healthy runs of 10.
BAND_MIN_SHARE = 0.08
SCHEDULE_KINDS = ("cosine", "wsd", "constant")
SCHEDULE_FIELDS = ("kind", "warmup_steps", "horizon", "min_lr_ratio", "decay_fraction")
LAWS = {
    "area": "L = A * S1^-alpha (a power law in the LR area S1, no floor)",
    "area+floor": "L = L0 + A * S1^-alpha",
    "annealing": "L = L0 + A * S1^-alpha - C * S2 (the LR-annealing law, Tissue et al. 2024, "
    "arXiv 2408.11029)",
    "annealing-nofloor": "L = A * S1^-alpha - C * S2",
    "steps": "L = A * x^-alpha (x: applied updates, blind to the schedule)",
    "steps+floor": "L = L0 + A * x^-alpha",
}
# How the fit weighs the pilot's evaluations: "log-updates" each by the span of log-updates it stands for
# (half the log-distance to its neighbours: equal weight per e-fold, as a power law is a line in log-log),
# "equal" each alike (the default before it; a lock records which: fitted_on.weighting). A pilot
# evaluated every 10 updates puts 7 of its 9 points in its last e-fold, where this tiny model plateaus, and
# weighed alike they flatten alpha. Chosen held out over "equal" (benchmarks/bench_forecast.py,
# docs/FORECAST.md): on either half of the healthy pilots per e-fold won, and graded on the other half the
# median error fell from 2.18% to 0.95% and from 1.78% to 0.92%. What it costs there: one mixture pilot is
# refused (too noisy under this fit), so its broken twin keeps only the rise check. The rise check's refit
# weighs alike (RISE_WEIGHTING).
# "log-updates-from-2x-warmup", the default: per e-fold as "log-updates", but only the evaluations from twice
# the warm-up on (FIT_FROM_WARMUPS). Under "log-updates" the first evaluation past the warm-up stands for the
# steepest e-fold of the pilot, and where that first evaluation lies is the cadence's choice: the six flat-LR
# pilots evaluated every 5 updates instead of 10 (a first point at 15, not 20) forecast 2.5-3.2% lower. From a
# step the cadence does not choose, the same pilots move +0.5% to +0.7% between the cadences (measured:
# bench_forecast's cadence table), and at every 10 updates the forecast is the same as under "log-updates".
FIT_WEIGHTINGS = ("log-updates-from-2x-warmup", "log-updates", "equal")
DEFAULT_WEIGHTING = "log-updates-from-2x-warmup"
# The weightings that fit only the evaluations from this many warm-ups on (at least the first update past it).
FIT_FROM_WARMUPS = {"log-updates-from-2x-warmup": 2}
# Chosen by measurement (docs/FORECAST.md, benchmarks/bench_forecast.py): fitted to pilots of 100 updates, the
# laws with a floor L0 put it at the pilot's plateau and miss the long run's further fall by ~11% (median);
# the floor-free power law in the LR area misses by ~1%. A pilot this short does not identify a floor.
DEFAULT_LAW = "area"


# How the refits of the bootstrap resample the pilot's residuals (a lock records which: interval_method).
# "residual-bootstrap" draws each one apart, as if the evaluations were independent; the fit's residuals are
# correlated from one evaluation to the next (the law misses the plateau for several evaluations in a row),
# so a finer cadence adds points the refits count but little they may count: the interval narrowed with the
# cadence (docs/FORECAST.md, "The interval counts correlated residuals"). "ar1-inflated" scales the refits'
# residuals by sqrt(n / n_eff), n_eff = n (1 - rho) / (1 + rho) the effective count of an AR(1) series whose
# lag-1 autocorrelation rho is the residuals' own (in step order, at least 0, at most RHO_MAX);
# "block-bootstrap" resamples runs of consecutive residuals, each as long as n / n_eff (rounded up). The one
# residual each prediction takes (the long run's own evaluation noise) is drawn apart under every method.
# Chosen held out at every 5 and every 10 updates (benchmarks/bench_forecast.py, docs/FORECAST.md).
INTERVAL_METHODS = ("ar1-inflated", "block-bootstrap", "residual-bootstrap")
DEFAULT_INTERVAL = "ar1-inflated"
# A lag-1 autocorrelation estimated from a few residuals reaches 1 by chance: held below it, the inflation
# is at most sqrt(1.9 / 0.1), 4.4x (an interval that wide is refused as too wide, MAX_HALF_WIDTH).
RHO_MAX = 0.9


# The long run's own check (forecast_record.risen): the law refitted to the pilot's evaluations and the run's
# own ones so far predicts its next; an evaluation more than this share above that is a rise. Measured on the
# benchmark's runs (docs/FORECAST.md): healthy long runs rose at most 2.4% above it two evaluations in a row,
# those whose LR was made 10x at 10% of their updates 4.8% and 5.3% at once; between them.
RISE_SHARE = 0.035
# The refit weighs its points alike, as RISE_SHARE was measured with, whatever DEFAULT_WEIGHTING is: a lock
# written before the per-e-fold weighting is watched as it was then.
RISE_WEIGHTING = "equal"
# At most this many of the run's own evaluations refit the law at each evaluation: watch and summarize refit
# at every one of a long run's evaluations.
MAX_OWN_POINTS = 200


class NoForecast(Exception):
    """Why the pilot gives no forecast (said as "no forecast: <why>")."""


class TooNoisy(NoForecast):
    """The pilot's curve falls but is too noisy to extrapolate alone: its rise check still holds the long run
    (refitted with the run's own evaluations, which pin down what the pilot's few cannot)."""


# ---------------------------------------------------------------------------------------------- schedule
def multipliers(schedule: dict[str, Any], steps: int) -> np.ndarray:
    """The LR multiplier of each update 1..steps (update i + 1 follows i applied updates)."""
    cfg = SimpleNamespace(**{k: schedule.get(k) for k in SCHEDULE_FIELDS})
    return np.array([lr_multiplier(i, cfg) for i in range(steps)], dtype=float)


def data_weights(steps: int, tokens_per_update: int | None, train_tokens: int | None) -> np.ndarray:
    """Each update's worth in new-token equivalents: 1 on the first pass, exp(-R / R*) once R passes
    repeat."""
    if not tokens_per_update or not train_tokens:
        return np.ones(steps)
    passes = np.arange(1, steps + 1) * tokens_per_update / train_tokens
    return np.exp(-np.maximum(passes - 1.0, 0.0) / REPEAT_R_STAR)


def areas(
    eta: np.ndarray, weights: np.ndarray, lam: float = ANNEALING_LAMBDA
) -> tuple[np.ndarray, np.ndarray]:
    """(S1, S2) after each number of updates 0..len(eta)."""
    s1 = np.concatenate([[0.0], np.cumsum(eta * weights)])
    drops = np.maximum(np.concatenate([[0.0], eta[:-1] - eta[1:]]), 0.0)
    momentum, m = np.empty_like(drops), 0.0
    for i, drop in enumerate(drops):
        m = lam * m + drop
        momentum[i] = m
    return s1, np.concatenate([[0.0], np.cumsum(momentum)])


# ---------------------------------------------------------------------------------------------- fit
@dataclass
class Fit:
    law: str
    alpha: float
    coef: np.ndarray  # (L0, A, C); C = 0 for the laws without annealing
    residuals: np.ndarray
    weighting: str = "equal"  # FIT_WEIGHTINGS: how its points were weighed (its refits weigh theirs alike)

    def parameters(self) -> dict[str, float]:
        named = {"A": self.coef[1], "alpha": self.alpha}
        if _has(self.law, "floor"):
            named["L0"] = self.coef[0]
        if _has(self.law, "annealing"):
            named.update(C=self.coef[2], lam=ANNEALING_LAMBDA)
        return {k: float(v) for k, v in named.items()}


def _has(law: str, term: str) -> bool:
    """Whether a law has the floor L0 ("floor") or the annealing term ("annealing")."""
    if term == "floor":
        return law == "annealing" or law.endswith("+floor")
    return law.startswith("annealing")


def _columns(
    law: str, x: np.ndarray, s1: np.ndarray, s2: np.ndarray, annealing: bool, alphas: np.ndarray
) -> np.ndarray:
    """The law's design matrix at every alpha of the grid: (alphas, points, [1, base, -S2]), a term the law
    (or
    this try) lacks as a column of zeros (its coefficient then solves to 0)."""
    base = (x if law.startswith("steps") else s1)[None, :] ** -alphas[:, None]
    ones = np.ones_like(base) * float(_has(law, "floor"))
    return np.stack([ones, base, np.broadcast_to(-s2, base.shape) * float(annealing)], axis=2)


def fit_weights(x: np.ndarray, weighting: str) -> np.ndarray | None:
    """Each point's weight in the fit (mean 1), None for "equal". "log-updates": half the log-distance from
    the step before to the step after (the first and the last: the log-distance to their one neighbour),
    shared by the points at one step (a branch's evaluation at a step the pilot also evaluated)."""
    if weighting == "equal":
        return None
    if weighting not in FIT_WEIGHTINGS:
        raise ValueError(f"unknown fit weighting {weighting!r} ({', '.join(FIT_WEIGHTINGS)})")
    steps = np.unique(np.asarray(x, dtype=float))
    if len(steps) < 2:
        return None
    logs = np.log(steps)
    edges = np.concatenate(
        [[1.5 * logs[0] - 0.5 * logs[1]], (logs[1:] + logs[:-1]) / 2, [1.5 * logs[-1] - 0.5 * logs[-2]]]
    )
    index = np.searchsorted(steps, np.asarray(x, dtype=float))
    weights = np.diff(edges)[index] / np.bincount(index, minlength=len(steps))[index]
    return weights / weights.mean()


def _solve(
    cols: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Least squares at every alpha at once (normal equations, a little ridge against a singular grid point),
    each point's squared error times its weight: (coefficients (alphas, terms), weighted squared errors
    (alphas,))."""
    if weights is not None:
        root = np.sqrt(weights)
        cols, y = cols * root[None, :, None], y * root
    gram = np.einsum("anp,anq->apq", cols, cols) + 1e-12 * np.eye(cols.shape[2])
    coef = np.linalg.solve(gram, np.einsum("anp,n->ap", cols, y)[..., None])[..., 0]
    sse = np.sum((np.einsum("anp,ap->an", cols, coef) - y) ** 2, axis=1)
    return coef, sse


def fit_law(
    law: str, x: np.ndarray, y: np.ndarray, s1: np.ndarray, s2: np.ndarray, weighting: str = "equal"
) -> Fit | None:
    """The least-squares fit over the alpha grid, then over a fine grid between the best one's neighbours (a
    10x extrapolation moves with alpha's third digit), A > 0 and C >= 0 (an annealing term that would come out
    negative is dropped: the law then has none); None where no alpha gives a falling curve. `weighting`:
    FIT_WEIGHTINGS."""
    weights = fit_weights(x, weighting)
    best = _best(law, x, y, s1, s2, ALPHAS, weights)
    if best is None:
        return None
    i = int(np.searchsorted(ALPHAS, best[1]))
    fine = np.linspace(ALPHAS[max(i - 1, 0)], ALPHAS[min(i + 1, len(ALPHAS) - 1)], REFINE)
    _, alpha, coef = _best(law, x, y, s1, s2, fine, weights) or best
    return Fit(law, alpha, coef, y - law_values(law, alpha, coef, x, s1, s2), weighting)


def _best(
    law: str,
    x: np.ndarray,
    y: np.ndarray,
    s1: np.ndarray,
    s2: np.ndarray,
    alphas: np.ndarray,
    weights: np.ndarray | None = None,
) -> tuple[float, float, np.ndarray] | None:
    """(squared error, alpha, coefficients) of the best alpha of `alphas`, or None."""
    best: tuple[float, float, np.ndarray] | None = None
    for annealing in (True, False) if _has(law, "annealing") else (False,):
        coef, sse = _solve(_columns(law, x, s1, s2, annealing, alphas), y, weights)
        ok = (coef[:, 1] > 0) & (coef[:, 2] >= 0) & np.isfinite(sse)
        if not ok.any():
            continue
        i = int(np.argmin(np.where(ok, sse, np.inf)))
        if best is None or sse[i] < best[0]:
            best = (float(sse[i]), float(alphas[i]), coef[i])
    return best


def law_values(
    law: str, alpha: float, coef: np.ndarray, x: np.ndarray, s1: np.ndarray, s2: np.ndarray
) -> np.ndarray:
    return coef[0] + coef[1] * (x if law.startswith("steps") else s1) ** -alpha - coef[2] * s2


# ---------------------------------------------------------------------------------------------- forecast
@dataclass
class Setting:
    """A run's schedule and data, for the areas: the pilot's (fitted on) or the long run's (predicted at)."""

    schedule: dict[str, Any]
    steps: int
    tokens_per_update: int | None = None
    train_tokens: int | None = None
    # A branch of the pilot: (the pilot's step it branched at, its own schedule from there on); `schedule` is
    # then the pilot's, which the branch followed up to that step.
    then: tuple[int, dict[str, Any]] | None = None

    def eta(self) -> np.ndarray:
        eta = multipliers(self.schedule, self.steps)
        if self.then is not None:
            at, schedule = self.then
            eta[at:] = multipliers(schedule, self.steps)[at:]
        return eta

    def features(self, at: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s1, s2 = _areas_of(json.dumps(dataclasses.asdict(self), sort_keys=True, default=str))
        idx = np.asarray(at, dtype=int)
        return idx.astype(float), s1[idx], s2[idx]


@functools.lru_cache(maxsize=64)
def _areas_of(setting_json: str) -> tuple[np.ndarray, np.ndarray]:
    """A Setting's (S1, S2) at every step, kept: watch and the grade refit at each of a long run's evaluations
    on the same setting, whose areas are a loop over all its updates."""
    setting = Setting(**json.loads(setting_json))
    if setting.then is not None:
        setting.then = (int(setting.then[0]), setting.then[1])
    weights = data_weights(setting.steps, setting.tokens_per_update, setting.train_tokens)
    s1, s2 = areas(setting.eta(), weights)
    s1.flags.writeable = s2.flags.writeable = False
    return s1, s2


def fit_start(schedule: dict[str, Any], weighting: str) -> int:
    """The first update a weighting fits an evaluation at: past the warm-up, and from FIT_FROM_WARMUPS
    warm-ups on for the weightings that name it (a step the evaluation cadence does not choose)."""
    warmup = int(schedule.get("warmup_steps") or 0)
    return max(warmup + 1, FIT_FROM_WARMUPS.get(weighting, 0) * warmup)


def fit_points(
    points: list[tuple[int, float]], pilot: Setting, weighting: str = "equal"
) -> tuple[np.ndarray, np.ndarray]:
    """The pilot's finite evaluations from the weighting's fit_start on, in step order, refused where too few
    to fit."""
    start = fit_start(pilot.schedule, weighting)
    kept = sorted(
        (int(s), float(v))
        for s, v in points
        if isinstance(v, (int, float)) and math.isfinite(v) and start <= int(s) <= pilot.steps
    )
    if len(kept) < MIN_POINTS:
        warmup = int(pilot.schedule.get("warmup_steps") or 0)
        where = f"past its warm-up of {warmup} updates" + (
            f" from update {start} on" if start > warmup + 1 else ""
        )
        raise NoForecast(
            f"the pilot has {len(kept)} validation evaluation(s) {where}; "
            f"a fit needs at least {MIN_POINTS} (evaluate more often: train.eval_every)"
        )
    return np.array([s for s, _ in kept]), np.array([v for _, v in kept])


def _with_branches(pilot: tuple, branches: tuple) -> tuple[np.ndarray, ...]:
    """The pilot's (x, y, S1, S2) with each branch's evaluations past its branch point appended (its earlier
    ones are the pilot's own)."""
    parts = [pilot]
    for points, setting in branches:
        at = setting.then[0] if setting.then else 0
        kept = sorted(
            (int(s), float(v)) for s, v in points if at < int(s) <= setting.steps and math.isfinite(v)
        )
        if kept:
            bx = np.array([s for s, _ in kept])
            _, b1, b2 = setting.features(bx)
            parts.append((bx, np.array([v for _, v in kept]), b1, b2))
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(4))


def _check_fit(fit: Fit | None, y: np.ndarray) -> Fit:
    fall = float(y[0] - np.min(y))
    if fit is None or fall <= 0:
        raise NoForecast("the pilot's validation loss does not fall (no falling fit)")
    noise = float(np.std(fit.residuals, ddof=min(len(y) - 1, 3)))
    if noise > MAX_NOISE_SHARE * fall:
        raise TooNoisy(
            f"the pilot's validation loss is too noisy to fit: residual sigma {noise:.4g} against a fall "
            f"of {fall:.4g} over its evaluations (more than {MAX_NOISE_SHARE:g} of it)"
        )
    return fit


_RESAMPLED = {
    "residual-bootstrap": "each drawn apart",
    "ar1-inflated": "scaled by sqrt((1 + rho) / (1 - rho)), rho their lag-1 autocorrelation",
    "block-bootstrap": "in runs of consecutive residuals n / n_eff long",
}


def lag1_autocorrelation(residuals: np.ndarray) -> float:
    """The residuals' lag-1 autocorrelation in step order (the lagged products' sum over the squares' sum,
    centred), held to [0, RHO_MAX]: a negative one would narrow the interval below the independent draw's."""
    r = np.asarray(residuals, dtype=float) - float(np.mean(residuals))
    squares = float(np.sum(r * r))
    if len(r) < 3 or squares <= 0:
        return 0.0
    return float(min(max(float(np.sum(r[1:] * r[:-1])) / squares, 0.0), RHO_MAX))


def _resampler(scaled: np.ndarray, rho: float, method: str):
    """How one refit draws its n residuals under an interval method (INTERVAL_METHODS)."""
    n = len(scaled)
    if method == "residual-bootstrap":
        return lambda rng: rng.choice(scaled, n)
    if method == "ar1-inflated":
        inflated = scaled * math.sqrt((1 + rho) / (1 - rho))
        return lambda rng: rng.choice(inflated, n)
    if method != "block-bootstrap":
        raise ValueError(f"unknown interval method {method!r} ({', '.join(INTERVAL_METHODS)})")
    block = min(math.ceil((1 + rho) / (1 - rho) - 1e-9), n)
    runs = np.stack([scaled[i : i + block] for i in range(n - block + 1)])

    def draw(rng: np.random.Generator) -> np.ndarray:
        return runs[rng.integers(0, len(runs), math.ceil(n / block))].reshape(-1)[:n]

    return draw


def bootstrap(
    fit: Fit,
    x: np.ndarray,
    feats: tuple,
    target: tuple,
    rng: np.random.Generator,
    draws: int = BOOTSTRAP,
    method: str = "residual-bootstrap",
    rho: float = 0.0,
) -> np.ndarray:
    """Predictions at the target features from refits of the fit plus resampled residuals (drawn under
    `method`, INTERVAL_METHODS, with the residuals' lag-1 autocorrelation `rho`), each plus one resampled
    residual (draws x len(target))."""
    s1, s2 = feats
    fitted = law_values(fit.law, fit.alpha, fit.coef, x, s1, s2)
    n, p = len(x), 2 + _has(fit.law, "floor") + _has(fit.law, "annealing")
    scaled = (fit.residuals - fit.residuals.mean()) * math.sqrt(n / max(n - p, 1))
    resample = _resampler(scaled, rho, method)
    out = []
    for _ in range(draws):
        refit = fit_law(fit.law, x, fitted + resample(rng), s1, s2, fit.weighting)
        if refit is None:
            continue
        out.append(law_values(fit.law, refit.alpha, refit.coef, *target) + rng.choice(scaled, len(target[0])))
    return np.array(out)


def holdout_drift(fit: Fit, x: np.ndarray, y: np.ndarray, s1: np.ndarray, s2: np.ndarray) -> float:
    """How far the law drifts per e-fold of updates it extrapolates, measured inside the pilot: fitted on its
    first HOLDOUT_SHARE of the evaluations, the median miss on the rest over log(last step / last fitted
    step). 0 where
    too few evaluations are left to fit on."""
    n = max(math.ceil(HOLDOUT_SHARE * len(x)), 4)
    if n >= len(x):
        return 0.0
    part = fit_law(fit.law, x[:n], y[:n], s1[:n], s2[:n], fit.weighting)
    if part is None:
        return 0.0
    miss = np.abs(law_values(fit.law, part.alpha, part.coef, x[n:], s1[n:], s2[n:]) - y[n:])
    return float(np.median(miss) / math.log(x[-1] / x[n - 1]))


def forecast(
    points: list[tuple[int, float]],
    pilot: Setting,
    target: Setting,
    at_steps: list[int],
    law: str | None = None,
    seed: int = 0,
    draws: int = BOOTSTRAP,
    branches: tuple[tuple[list[tuple[int, float]], Setting], ...] = (),
    drift_weight: float | None = None,
    weighting: str | None = None,
    interval: str | None = None,
) -> dict[str, Any]:
    """The forecast of the target run's validation loss at `at_steps` (the last is its final value), or raise
    NoForecast. `law`: one of LAWS, DEFAULT_LAW when None. `branches`: short runs from the pilot's checkpoints
    on another schedule (a cooldown), each (its validation points, its Setting with `then`), fitted with the
    pilot's points; the drift that widens the interval is measured on the pilot's points alone.
    `drift_weight`: the 90% interval's weight on that drift (WIDEN's when None; the benchmark tries
    DRIFT_WEIGHTS). `weighting`: how the fit weighs the points (DEFAULT_WEIGHTING when None). `interval`: how
    the bootstrap's refits resample the residuals (INTERVAL_METHODS; DEFAULT_INTERVAL when None)."""
    law = law or DEFAULT_LAW
    interval = interval or DEFAULT_INTERVAL
    widen = {**WIDEN, **({} if drift_weight is None else {LEVEL: float(drift_weight)})}
    for setting, who in ((pilot, "pilot"), (target, "long run")):
        if setting.schedule.get("kind") not in SCHEDULE_KINDS:
            raise NoForecast(
                f"the {who}'s schedule kind {setting.schedule.get('kind')!r} is not modelled "
                f"({', '.join(SCHEDULE_KINDS)})"
            )
    weighting = weighting or DEFAULT_WEIGHTING
    x, y = fit_points(points, pilot, weighting)
    _, s1, s2 = pilot.features(x)
    pilot_only = (x, y, s1, s2)
    x, y, s1, s2 = _with_branches(pilot_only, branches)
    fit = _check_fit(fit_law(law, x, y, s1, s2, weighting), y)
    steps = np.asarray(at_steps, dtype=int)
    feats = target.features(steps)
    centre = law_values(law, fit.alpha, fit.coef, *feats)
    rho = lag1_autocorrelation(fit.residuals[: len(pilot_only[0])])  # the pilot's own, in step order
    preds = bootstrap(fit, x, (s1, s2), feats, np.random.default_rng(seed), draws, interval, rho)
    spread = preds - np.median(preds, axis=0)
    last = pilot_only[0][-1]
    drift = holdout_drift(fit, *pilot_only) * np.log(np.maximum(steps, last) / last)
    lows = {lv: centre + np.quantile(spread, (1 - lv) / 2, axis=0) - drift * w for lv, w in widen.items()}
    highs = {lv: centre + np.quantile(spread, (1 + lv) / 2, axis=0) + drift * w for lv, w in widen.items()}
    lows[BAND_LEVEL] = np.minimum(lows[BAND_LEVEL], centre * (1 - BAND_MIN_SHARE))
    highs[BAND_LEVEL] = np.maximum(highs[BAND_LEVEL], centre * (1 + BAND_MIN_SHARE))
    final = float(centre[-1])
    half = (highs[LEVEL][-1] - lows[LEVEL][-1]) / 2
    if not math.isfinite(final) or final <= 0 or half > MAX_HALF_WIDTH * final:
        raise NoForecast(
            f"the interval is too wide to be of use: +-{half:.4g} around {final:.4g} (more than "
            f"{MAX_HALF_WIDTH:.0%} of it): the pilot's curve does not pin the law down"
        )
    curve = [
        [int(s), float(c), float(lo), float(hi), float(blo), float(bhi)]
        for s, c, lo, hi, blo, bhi in zip(
            steps, centre, lows[LEVEL], highs[LEVEL], lows[BAND_LEVEL], highs[BAND_LEVEL], strict=True
        )
    ]
    return {
        "law": law,
        "formula": LAWS[law],
        "parameters": fit.parameters(),
        "fitted_on": {
            "points": [[int(s), float(v)] for s, v in zip(x, y, strict=True)],
            "residual_sigma": float(np.std(fit.residuals)),
            "weighting": fit.weighting,
            "residual_lag1": rho,
            "pilot_steps": pilot.steps,
        },
        "curve_columns": ["step", "predicted", "low", "high", "band_low", "band_high"],
        "curve": curve,
        "final": {
            "step": int(steps[-1]),
            "value": final,
            "low": float(lows[LEVEL][-1]),
            "high": float(highs[LEVEL][-1]),
            "level": LEVEL,
            "half_width_share": float(half / final),
        },
        "interval_method": interval,
        "interval_from": f"a residual bootstrap of the fit ({draws} refits of the fit plus the pilot's "
        f"resampled residuals, {_RESAMPLED[interval]}), each plus one resampled residual, widened by the "
        "drift the pilot measures on "
        f"itself (fitted on its first {HOLDOUT_SHARE:.0%} of evaluations, the miss on the rest "
        f"per e-fold of updates) x the e-folds extrapolated, weighted {widen[LEVEL]:g} (the band "
        f"{widen[BAND_LEVEL]:g}); "
        f"{LEVEL:.0%} interval; the band at {BAND_LEVEL:.0%}, at least +-{BAND_MIN_SHARE:.0%} "
        "of the prediction",
    }


def refitted_at(
    law: str,
    pilot_points: list[tuple[int, float]],
    pilot: Setting,
    own_points: list[tuple[int, float]],
    run: Setting,
    step: int,
) -> float | None:
    """The law refitted to the pilot's fitted points and the run's own evaluations before `step` past its
    warm-up (at the run's own schedule), at `step`; None where no falling fit is found."""
    warmup = int(run.schedule.get("warmup_steps") or 0)
    own = sorted((s, v) for s, v in own_points if warmup < s < step and math.isfinite(v))
    if len(own) > MAX_OWN_POINTS:  # a long run's many evaluations, thinned evenly (its latest always kept)
        own = own[::-1][:: math.ceil(len(own) / MAX_OWN_POINTS)][::-1]
    px = np.array([s for s, _ in pilot_points], dtype=int)
    ox = np.array([s for s, _ in own] + [step], dtype=int)
    _, p1, p2 = pilot.features(px)
    _, o1, o2 = run.features(ox)
    y = np.array([v for _, v in pilot_points] + [v for _, v in own])
    x, s1, s2 = (np.concatenate([a, b[:-1]]) for a, b in ((px, ox), (p1, o1), (p2, o2)))
    fit = fit_law(law, x, y, s1, s2, RISE_WEIGHTING)
    if fit is None:
        return None
    return float(law_values(law, fit.alpha, fit.coef, ox[-1:], o1[-1:], o2[-1:])[0])
