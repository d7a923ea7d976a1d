"""Decoupled rotary position embedding for MLA.

Only the d_r rotary slice of each query head and the one shared rotary key are rotated; the d_n "content" dims
never see a position. Pairs are adjacent (x[2i], x[2i+1]) -- DeepSeek's official interleaved layout, which
released checkpoints use -- and the rotation runs in fp32 whatever the activation dtype, then casts back.
"""

from __future__ import annotations

import torch


def build_rope_table(rope_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_seq_len, rope_dim // 2] fp32.

    The frequencies are built with dim = d_r (not d_qk, not d_n): inv_freq_i = theta^(-2i/d_r).
    Angles are formed in float64 so that long tables do not lose precision at large positions.
    """
    if rope_dim % 2:
        raise ValueError(f"rope dim must be even, got {rope_dim}")
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim
    inverse_frequencies = 1.0 / (theta**exponents)
    positions = torch.arange(max_seq_len, dtype=torch.float64)
    angles = torch.outer(positions, inverse_frequencies)
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the last dim of x [B, T, H, d_r] by the per-position angles.

    cos, sin: [T, d_r // 2] (already sliced to the positions of x). Computed in fp32, returned in x's dtype.
    """
    input_dtype = x.dtype
    x32 = x.float()
    even = x32[..., 0::2]
    odd = x32[..., 1::2]
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    rotated_even = even * cos - odd * sin
    rotated_odd = even * sin + odd * cos
    return torch.stack((rotated_even, rotated_odd), dim=-1).flatten(-2).to(input_dtype)
