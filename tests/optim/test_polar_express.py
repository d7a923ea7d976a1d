"""pilotrun/optim/polar_express.py and the `polar_express` Newton-Schulz variant: each derived quintic is the
minimax one on its interval (the error equioscillates), the scalar map lands every planned singular value in
the band the derivation states, and the matrix iteration (square and rectangular, fp32 and bf16) gives
singular values in that band."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pilotrun.optim.muon_adamw import MuonAdamW, newton_schulz_orthogonalize, newton_schulz_schedule
from pilotrun.optim.polar_express import (
    LIMIT_QUINTIC,
    LOWER_BOUND,
    SAFETY,
    minimax_quintic,
    polar_express_coefficients,
)


def quintic(coefficients, x: torch.Tensor) -> torch.Tensor:
    a, b, c = coefficients
    return a * x + b * x**3 + c * x**5


def band_after(steps: int) -> tuple[float, float]:
    """Where the derivation says every singular value in [LOWER_BOUND, 1] lies after `steps` iterations."""
    low, high = LOWER_BOUND, 1.0
    for _ in range(steps):
        _, error = minimax_quintic(low, high * SAFETY)
        low, high = 1 - error, 1 + error
    return low, high


@pytest.mark.parametrize("low, high", [(LOWER_BOUND, 1.0), (0.1, 1.9), (0.9, 1.1)])
def test_each_quintic_is_the_minimax_one_on_its_interval(low, high):
    coefficients, error = minimax_quintic(low, high)
    x = torch.linspace(low, high, 200_001, dtype=torch.float64)
    deviation = 1 - quintic(coefficients, x)
    assert float(deviation.abs().max()) == pytest.approx(error, rel=1e-6)
    # Equioscillation: +E at the low end, -E at the top, and both signs reached inside.
    assert float(deviation[0]) == pytest.approx(error, rel=1e-9)
    assert float(deviation[-1]) == pytest.approx(-error, rel=1e-9)
    assert float(deviation.max()) == pytest.approx(error, rel=1e-6)
    assert float(deviation.min()) == pytest.approx(-error, rel=1e-6)
    # A nudged quintic is worse: the minimum is strict.
    for nudge in ((1e-3, 0, 0), (0, 1e-3, 0), (0, 0, 1e-3), (0, 0, -1e-3)):
        nudged = [value + delta for value, delta in zip(coefficients, nudge)]
        assert float((1 - quintic(nudged, x)).abs().max()) > error


def test_the_scalar_map_lands_every_planned_singular_value_in_the_stated_band():
    x = torch.logspace(-3, 0, 100_001, dtype=torch.float64)
    y = x.clone()
    for steps, coefficients in enumerate(polar_express_coefficients(6), start=1):
        y = quintic(coefficients, y)
        low, high = band_after(steps)
        assert float(y.min()) >= low - 1e-9 and float(y.max()) <= high + 1e-9, steps
    assert band_after(5)[0] > 0.87 and band_after(5)[1] < 1.13  # 5 steps: within 13% of 1
    assert band_after(6)[0] > 0.998  # 6 steps: orthogonal to 0.2%


def test_the_sequence_is_greedy_and_ends_in_the_limit_quintic():
    assert polar_express_coefficients(3) == polar_express_coefficients(5)[:3]
    assert newton_schulz_schedule(4, "polar_express") == list(polar_express_coefficients(4))
    assert polar_express_coefficients(9)[-1] == LIMIT_QUINTIC
    a, b, c = LIMIT_QUINTIC  # p(1) = 1, p'(1) = 0, p''(1) = 0
    assert a + b + c == 1 and a + 3 * b + 5 * c == 0 and 6 * b + 20 * c == 0


@pytest.mark.parametrize("dtype, slack", [(torch.float32, 1e-3), (torch.bfloat16, 0.06)])
@pytest.mark.parametrize("shape", [(64, 64), (128, 128), (64, 256), (256, 64), (160, 512)])
@pytest.mark.parametrize("steps", [4, 5])
def test_the_matrix_iteration_is_near_orthogonal_in_the_stated_band(shape, dtype, slack, steps):
    """Singular values in [1 - E, 1 + E] of the derivation (E = 0.124 after 5 steps, 0.558 after 4), within
    the rounding of the compute dtype, for every direction at or above the planned LOWER_BOUND (a square
    Gaussian matrix may have one below it, which no fixed number of steps reaches)."""
    low, high = band_after(steps)
    for seed in range(3):
        gradient = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        orthogonal = newton_schulz_orthogonalize(gradient, steps, dtype, "polar_express")
        assert orthogonal.dtype == torch.float32 and orthogonal.shape == gradient.shape
        singular_values = torch.linalg.svdvals(orthogonal.double())
        normalised = torch.linalg.svdvals(gradient.double()) / (gradient.double().norm() + 1e-7)
        reached = int((normalised >= LOWER_BOUND).sum())
        if shape[0] != shape[1]:
            assert reached == min(shape)
        assert float(singular_values[:reached].max()) <= high + slack
        assert float(singular_values[:reached].min()) >= low - slack


def test_the_variant_reaches_the_optimizer_through_the_recipe():
    from pilotrun.config import ModelConfig, OptimConfig
    from pilotrun.model.transformer import build_model
    from pilotrun.optim.partition import partition_parameters

    muon = dataclasses.replace(OptimConfig().muon, ns_variant="polar_express", ns_steps=4)
    groups = partition_parameters(build_model(ModelConfig(vocab_size=64)), OptimConfig(muon=muon))
    assert all((g["ns_variant"], g["ns_steps"]) == ("polar_express", 4) for g in groups if g["use_muon"])
    param = torch.nn.Parameter(torch.zeros(96, 160))
    gradient = torch.randn(96, 160, generator=torch.Generator().manual_seed(4))
    opt = MuonAdamW([{"params": [param], "use_muon": True, "lr": 1.0, "weight_decay": 0.0, "momentum": 0.0,
                      "nesterov": False, "ns_variant": "polar_express", "ns_steps": 4}])
    param.grad = gradient.clone()
    opt.step()
    expected = newton_schulz_orthogonalize(gradient, 4, torch.float32, "polar_express")
    scale = 0.2 * max(96, 160) ** 0.5  # moonlight
    assert torch.equal(param.detach(), -scale * expected)
