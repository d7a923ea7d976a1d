"""What validation loss the long run will reach: a schedule-aware law fitted to the pilot's validation losses, its
prediction at the long run's evaluation steps and schedule, and a 90% interval from what the fit leaves unexplained.

Torch-free (numpy): the lock writes it (commands/freeze.py), watch holds the long run to its band
(report/watch/forecast_watch.py), summarize grades it (report/record_check/forecast_grade.py). docs/FORECAST.md
says which law and why, with the measurement.

The laws (x: applied updates; eta_i: the LR multiplier of update i, pilotrun/optim/lr_shape.py):
- `annealing`, the LR-annealing law (Tissue et al. 2024, arXiv 2408.11029): L = L0 + A * S1^-alpha - C * S2,
  S1 = sum of eta_i * w_i (the forward area), S2 = sum of m_i, m_i = lam * m_(i-1) + max(0, eta_(i-1) - eta_i)
  (the annealing area, a momentum of the LR's decreases; a warm-up's increases are not annealing);
- `area`: the same without the annealing term; `steps`: L = L0 + A * x^-alpha, blind to the schedule.
w_i weighs each update's tokens by what they are worth: 1 on the first pass over the training split, then
exp(-R / R*) where R is the passes already repeated (Muennighoff et al. 2023, arXiv 2305.16264, R* = 15.4: the
marginal worth of their effective-data formula D' = U + U R* (1 - exp(-R / R*))).

The fit: for each alpha on a grid, the law is linear in (L0, A, C): least squares, with A > 0, C >= 0; the alpha
of least squared error wins. The interval: a residual bootstrap (the pilot's points are the fit plus resampled
residuals, refitted BOOTSTRAP times), each prediction plus one resampled residual (the long run's own evaluation is
as noisy as the pilot's), widened by the measured extrapolation factor (EXTRAPOLATION_WIDENING); its 5th and 95th
percentiles. The band watch holds the run to is the same at BAND_LEVEL.

Refused ("no forecast: <why>", never a number): fewer than MIN_POINTS evaluations past the warm-up; a loss that
does not fall; residual noise above MAX_NOISE_SHARE of the fall it is fitted to; an interval wider than
MAX_HALF_WIDTH of the value; a schedule kind the laws do not model.
"""

from __future__ import annotations

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
ANNEALING_LAMBDA = 0.99
REPEAT_R_STAR = 15.4
# The bootstrap's spread says how well the law fits the pilot, not how far it carries: the measured spread of
# extrapolation errors over 10x horizons (docs/FORECAST.md) is this many times the bootstrap's.
EXTRAPOLATION_WIDENING = 1.0
SCHEDULE_KINDS = ("cosine", "wsd", "constant")
SCHEDULE_FIELDS = ("kind", "warmup_steps", "horizon", "min_lr_ratio", "decay_fraction")
LAWS = {
    "annealing": "L = L0 + A * S1^-alpha - C * S2 (the LR-annealing law, Tissue et al. 2024, arXiv 2408.11029)",
    "area": "L = L0 + A * S1^-alpha (S1: the LR area)",
    "steps": "L = L0 + A * x^-alpha (x: applied updates, blind to the schedule)",
}
DEFAULT_LAW = "annealing"


class NoForecast(Exception):
    """Why the pilot gives no forecast (said as "no forecast: <why>")."""


# ---------------------------------------------------------------------------------------------- schedule
def multipliers(schedule: dict[str, Any], steps: int) -> np.ndarray:
    """The LR multiplier of each update 1..steps (update i + 1 follows i applied updates)."""
    cfg = SimpleNamespace(**{k: schedule.get(k) for k in SCHEDULE_FIELDS})
    return np.array([lr_multiplier(i, cfg) for i in range(steps)], dtype=float)


def data_weights(steps: int, tokens_per_update: int | None, train_tokens: int | None) -> np.ndarray:
    """Each update's worth in new-token equivalents: 1 on the first pass, exp(-R / R*) once R passes repeat."""
    if not tokens_per_update or not train_tokens:
        return np.ones(steps)
    passes = np.arange(1, steps + 1) * tokens_per_update / train_tokens
    return np.exp(-np.maximum(passes - 1.0, 0.0) / REPEAT_R_STAR)


def areas(eta: np.ndarray, weights: np.ndarray, lam: float = ANNEALING_LAMBDA) -> tuple[np.ndarray, np.ndarray]:
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

    def parameters(self) -> dict[str, float]:
        named = {"L0": self.coef[0], "A": self.coef[1], "alpha": self.alpha}
        if self.law == "annealing":
            named.update(C=self.coef[2], lam=ANNEALING_LAMBDA)
        return {k: float(v) for k, v in named.items()}


def _columns(law: str, x: np.ndarray, s1: np.ndarray, s2: np.ndarray) -> np.ndarray:
    """The law's design matrix at every alpha of the grid: (alphas, points, terms)."""
    base = (x if law == "steps" else s1)[None, :] ** -ALPHAS[:, None]
    cols = [np.ones_like(base), base] + ([np.broadcast_to(-s2, base.shape)] if law == "annealing" else [])
    return np.stack(cols, axis=2)


def _solve(cols: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least squares at every alpha at once (normal equations, a little ridge against a singular grid point):
    (coefficients (alphas, terms), squared errors (alphas,))."""
    gram = np.einsum("anp,anq->apq", cols, cols) + 1e-12 * np.eye(cols.shape[2])
    coef = np.linalg.solve(gram, np.einsum("anp,n->ap", cols, y)[..., None])[..., 0]
    sse = np.sum((np.einsum("anp,ap->an", cols, coef) - y) ** 2, axis=1)
    return coef, sse


def fit_law(law: str, x: np.ndarray, y: np.ndarray, s1: np.ndarray, s2: np.ndarray) -> Fit | None:
    """The least-squares fit over the alpha grid, A > 0 and C >= 0 (an annealing term that would come out
    negative is dropped: the law then has none); None where no alpha gives a falling curve."""
    best: tuple[float, float, np.ndarray] | None = None
    for use in ((law,) if law != "annealing" else ("annealing", "area")):
        coef, sse = _solve(_columns(use, x, s1, s2), y)
        ok = (coef[:, 1] > 0) & ((coef[:, 2] >= 0) if use == "annealing" else True) & np.isfinite(sse)
        if not ok.any():
            continue
        i = int(np.argmin(np.where(ok, sse, np.inf)))
        if best is None or sse[i] < best[0]:
            best = (float(sse[i]), float(ALPHAS[i]), np.concatenate([coef[i], [0.0] * (3 - coef.shape[1])]))
    if best is None:
        return None
    _, alpha, coef = best
    return Fit(law, alpha, coef, y - law_values(law, alpha, coef, x, s1, s2))


def law_values(law: str, alpha: float, coef: np.ndarray, x: np.ndarray, s1: np.ndarray, s2: np.ndarray
               ) -> np.ndarray:
    return coef[0] + coef[1] * (x if law == "steps" else s1) ** -alpha - coef[2] * s2


# ---------------------------------------------------------------------------------------------- forecast
@dataclass
class Setting:
    """A run's schedule and data, for the areas: the pilot's (fitted on) or the long run's (predicted at)."""
    schedule: dict[str, Any]
    steps: int
    tokens_per_update: int | None = None
    train_tokens: int | None = None

    def features(self, at: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s1, s2 = areas(multipliers(self.schedule, self.steps),
                       data_weights(self.steps, self.tokens_per_update, self.train_tokens))
        idx = np.asarray(at, dtype=int)
        return idx.astype(float), s1[idx], s2[idx]


def fit_points(points: list[tuple[int, float]], pilot: Setting) -> tuple[np.ndarray, np.ndarray]:
    """The pilot's finite evaluations past its warm-up, in step order, refused where too few to fit."""
    warmup = int(pilot.schedule.get("warmup_steps") or 0)
    kept = sorted((int(s), float(v)) for s, v in points
                  if isinstance(v, (int, float)) and math.isfinite(v) and warmup < int(s) <= pilot.steps)
    if len(kept) < MIN_POINTS:
        raise NoForecast(f"the pilot has {len(kept)} validation evaluation(s) past its warm-up of {warmup} updates; "
                         f"a fit needs at least {MIN_POINTS} (evaluate more often: train.eval_every)")
    return np.array([s for s, _ in kept]), np.array([v for _, v in kept])


def _check_fit(fit: Fit | None, y: np.ndarray) -> Fit:
    if fit is None:
        raise NoForecast("the pilot's validation loss does not fall along the law (no falling fit)")
    fall = float(y[0] - np.min(y))
    noise = float(np.std(fit.residuals, ddof=min(len(y) - 1, 3)))
    if fall <= 0 or noise > MAX_NOISE_SHARE * fall:
        raise NoForecast(f"the pilot's validation loss is too noisy to fit: residual sigma {noise:.4g} against a fall "
                         f"of {fall:.4g} over its evaluations (more than {MAX_NOISE_SHARE:g} of it)")
    return fit


def bootstrap(fit: Fit, x: np.ndarray, feats: tuple, target: tuple, rng: np.random.Generator,
              draws: int = BOOTSTRAP) -> np.ndarray:
    """Predictions at the target features from refits of the fit plus resampled residuals, each plus one
    resampled residual (draws x len(target))."""
    s1, s2 = feats
    fitted = law_values(fit.law, fit.alpha, fit.coef, x, s1, s2)
    n, p = len(x), (3 if fit.law == "annealing" else 2) + 1
    scaled = (fit.residuals - fit.residuals.mean()) * math.sqrt(n / max(n - p, 1))
    out = []
    for _ in range(draws):
        refit = fit_law(fit.law, x, fitted + rng.choice(scaled, n), s1, s2)
        if refit is None:
            continue
        out.append(law_values(fit.law, refit.alpha, refit.coef, *target) + rng.choice(scaled, len(target[0])))
    return np.array(out)


def forecast(points: list[tuple[int, float]], pilot: Setting, target: Setting, at_steps: list[int],
             law: str = DEFAULT_LAW, seed: int = 0, draws: int = BOOTSTRAP) -> dict[str, Any]:
    """The forecast of the target run's validation loss at `at_steps` (the last is its final value), or raise
    NoForecast."""
    for setting, who in ((pilot, "pilot"), (target, "long run")):
        if setting.schedule.get("kind") not in SCHEDULE_KINDS:
            raise NoForecast(f"the {who}'s schedule kind {setting.schedule.get('kind')!r} is not modelled "
                             f"({', '.join(SCHEDULE_KINDS)})")
    x, y = fit_points(points, pilot)
    _, s1, s2 = pilot.features(x)
    fit = _check_fit(fit_law(law, x, y, s1, s2), y)
    steps = np.asarray(at_steps, dtype=int)
    feats = target.features(steps)
    centre = law_values(law, fit.alpha, fit.coef, *feats)
    preds = bootstrap(fit, x, (s1, s2), feats, np.random.default_rng(seed), draws)
    spread = (preds - np.median(preds, axis=0)) * EXTRAPOLATION_WIDENING
    lows = {lv: centre + np.quantile(spread, (1 - lv) / 2, axis=0) for lv in (LEVEL, BAND_LEVEL)}
    highs = {lv: centre + np.quantile(spread, (1 + lv) / 2, axis=0) for lv in (LEVEL, BAND_LEVEL)}
    final = float(centre[-1])
    half = (highs[LEVEL][-1] - lows[LEVEL][-1]) / 2
    if not math.isfinite(final) or final <= 0 or half > MAX_HALF_WIDTH * final:
        raise NoForecast(f"the interval is too wide to be of use: +-{half:.4g} around {final:.4g} (more than "
                         f"{MAX_HALF_WIDTH:.0%} of it): the pilot's curve does not pin the law down")
    curve = [[int(s), float(c), float(lo), float(hi), float(blo), float(bhi)] for s, c, lo, hi, blo, bhi in zip(
        steps, centre, lows[LEVEL], highs[LEVEL], lows[BAND_LEVEL], highs[BAND_LEVEL], strict=True)]
    return {"law": law, "formula": LAWS[law], "parameters": fit.parameters(),
            "fitted_on": {"points": [[int(s), float(v)] for s, v in zip(x, y, strict=True)],
                          "residual_sigma": float(np.std(fit.residuals)), "pilot_steps": pilot.steps},
            "curve_columns": ["step", "predicted", "low", "high", "band_low", "band_high"], "curve": curve,
            "final": {"step": int(steps[-1]), "value": final, "low": float(lows[LEVEL][-1]),
                      "high": float(highs[LEVEL][-1]), "level": LEVEL, "half_width_share": float(half / final)},
            "interval_from": f"a residual bootstrap of the fit ({draws} refits of the fit plus the pilot's "
                             f"resampled residuals), each plus one resampled residual, spread x "
                             f"{EXTRAPOLATION_WIDENING:g} (the measured extrapolation factor); "
                             f"{LEVEL:.0%} interval, band at {BAND_LEVEL:.0%}"}
