"""RoPE: relative-position property, interleaved pairing equals a complex-number rotation, content dims
untouched."""

import torch

from pilotrun.model.mla import MLA
from pilotrun.model.rope import apply_rope, build_rope_table


def complex_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Independent implementation: adjacent pairs as complex numbers times exp(i * position * freq)."""
    dim = x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.double()[:, None] * freqs[None, :]
    rotation = torch.polar(torch.ones_like(angles), angles)  # [T, dim/2]
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], dim // 2, 2).contiguous())
    rotated = pairs * rotation[None, :, None, :]
    return torch.view_as_real(rotated).flatten(-2)


def test_interleaved_rotation_equals_complex_multiplication():
    torch.manual_seed(0)
    x = torch.randn(2, 50, 3, 16)
    cos, sin = build_rope_table(16, 64, 10000.0)
    ours = apply_rope(x, cos[:50], sin[:50])
    reference = complex_reference(x, torch.arange(50), 10000.0)
    assert torch.allclose(ours.double(), reference, rtol=0, atol=1e-5)
    assert ours.dtype == torch.float32


def test_dot_products_depend_only_on_relative_position():
    torch.manual_seed(0)
    q = torch.randn(1, 40, 2, 8)
    k = torch.randn(1, 40, 2, 8)
    cos, sin = build_rope_table(8, 64, 10000.0)
    plain = torch.einsum(
        "bihd,bjhd->bhij", apply_rope(q, cos[:40], sin[:40]), apply_rope(k, cos[:40], sin[:40])
    )
    shifted = torch.einsum(
        "bihd,bjhd->bhij", apply_rope(q, cos[7:47], sin[7:47]), apply_rope(k, cos[7:47], sin[7:47])
    )
    assert torch.allclose(plain, shifted, rtol=0, atol=1e-5)
    unrotated = torch.einsum("bihd,bjhd->bhij", q, k)
    assert not torch.allclose(plain, unrotated, atol=1e-2)  # the rotation did something


def test_rotation_keeps_norms_and_dtype_and_position_zero_is_identity():
    torch.manual_seed(0)
    x = torch.randn(2, 10, 4, 8, dtype=torch.bfloat16)
    cos, sin = build_rope_table(8, 10, 10000.0)
    rotated = apply_rope(x, cos, sin)
    assert rotated.dtype == torch.bfloat16
    assert torch.equal(rotated[:, 0], x[:, 0])
    assert torch.allclose(rotated.float().norm(dim=-1), x.float().norm(dim=-1), rtol=1e-2)


def test_only_the_rotary_slices_of_queries_and_keys_are_rotated():
    torch.manual_seed(0)
    mla = MLA(d_model=32, n_heads=2, q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
              v_head_dim=8)
    x = torch.randn(1, 12, 32)
    cos, sin = build_rope_table(4, 12, 10000.0)
    q, k, v = mla.project_queries_keys_values(x, cos, sin)
    # no rotation
    q0, k0, v0 = mla.project_queries_keys_values(x, torch.ones_like(cos), torch.zeros_like(sin))
    assert (
        torch.equal(q[..., :8], q0[..., :8]) and torch.equal(k[..., :8], k0[..., :8]) and torch.equal(v, v0)
    )
    assert not torch.allclose(q[..., 8:], q0[..., 8:]) and not torch.allclose(k[..., 8:], k0[..., 8:])
    # One rotary key shared by every head.
    assert torch.equal(k[:, 0, :, 8:], k[:, 1, :, 8:])
