"""Newton-Schulz coefficients chosen per iteration: the `polar_express` variant of `optim.muon.ns_variant`.

The idea is Polar Express (Amsel, Persson, Musco and Gower 2025, arXiv 2505.16932): instead of one quintic
p(x) = a x + b x^3 + c x^5 applied at every iteration, each iteration uses the odd quintic that brings every
singular value it may meet closest to 1. The singular values of the Frobenius-normalised update lie in
[lower, 1]; iteration t takes the quintic that minimises max |1 - p(x)| over its interval [l_t, u_t] (a
minimax problem, solved here by the Remez exchange), and after it every singular value lies in
[1 - E_t, 1 + E_t], the next interval. The sequence is greedy, so the first k iterations are the same
whatever the total: `ns_steps` takes the first `ns_steps` of them.

Derived here, not copied: the Remez exchange on four alternation points (two ends, two interior extrema of
the error), the interval's top widened by SAFETY so that rounding (bf16 above all) that lifts a singular value
slightly above the bound still lands near 1, and, once the interval is so narrow that the exchange's linear
system loses its precision, the quintic with p(1) = 1 and p'(1) = p''(1) = 0 (x (15 - 10 x^2 + 3 x^4) / 8, the
Taylor polynomial of x (x^2)^(-1/2) around 1), which is what the minimax quintic tends to as the interval
shrinks onto 1.
"""

from __future__ import annotations

import functools

LOWER_BOUND = 1e-3  # the smallest singular value planned for, after the Frobenius normalisation
SAFETY = 1.01  # each interval's top, widened: rounding may lift a singular value slightly above it
NARROW = 1e-4  # an interval narrower than this takes the limit quintic (the exchange would be ill-posed)
LIMIT_QUINTIC = (15 / 8, -10 / 8, 3 / 8)
REMEZ_ROUNDS = 60


def _solve(matrix: list[list[float]], right: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting, for the exchange's 4 x 4 system."""
    n = len(right)
    rows = [list(row) + [value] for row, value in zip(matrix, right)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            rows[r] = [value - factor * top for value, top in zip(rows[r], rows[col])]
    out = [0.0] * n
    for r in reversed(range(n)):
        out[r] = (rows[r][n] - sum(rows[r][k] * out[k] for k in range(r + 1, n))) / rows[r][r]
    return out


def _interior_extrema(a: float, b: float, c: float, low: float, high: float) -> list[float]:
    """The x in (low, high) where p'(x) = a + 3 b x^2 + 5 c x^4 = 0 (a quadratic in x^2)."""
    qa, qb, qc = 5 * c, 3 * b, a
    disc = qb * qb - 4 * qa * qc
    if qa == 0 or disc < 0:
        return []
    roots = [(-qb - disc**0.5) / (2 * qa), (-qb + disc**0.5) / (2 * qa)]
    return sorted(y**0.5 for y in roots if y > 0 and low < y**0.5 < high)


def minimax_quintic(low: float, high: float) -> tuple[tuple[float, float, float], float]:
    """The odd quintic closest to 1 on [low, high] in the max norm, and its error E: on the interval,
    1 - E <= p(x) <= 1 + E, with equality at four alternating points."""
    points = [low, low + (high - low) / 4, low + 3 * (high - low) / 4, high]
    coefficients, error = LIMIT_QUINTIC, 0.0
    for _ in range(REMEZ_ROUNDS):
        # p(x_i) + (-1)^i E = 1: the error alternates, positive at the low end (p < 1 there).
        matrix = [[x, x**3, x**5, (-1) ** i] for i, x in enumerate(points)]
        a, b, c, error = _solve(matrix, [1.0] * 4)
        coefficients = (a, b, c)
        inner = _interior_extrema(a, b, c, low, high)
        if len(inner) != 2:
            break
        moved = [low, *inner, high]
        if max(abs(new - old) for new, old in zip(moved, points)) < 1e-15:
            break
        points = moved
    return coefficients, abs(error)


@functools.cache
def polar_express_coefficients(steps: int) -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) of each of the first `steps` iterations, from [LOWER_BOUND, 1]."""
    low, high = LOWER_BOUND, 1.0
    schedule = []
    for _ in range(steps):
        if high - low < NARROW:
            coefficients = LIMIT_QUINTIC
            low, high = 1 - (1 - low) ** 2, 1.0 + (high - 1) ** 2  # its error is second order, or less
        else:
            coefficients, error = minimax_quintic(low, high * SAFETY)
            low, high = 1 - error, 1 + error
        schedule.append(coefficients)
    return tuple(schedule)
