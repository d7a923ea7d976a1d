"""Expert segments rounded up to a few lengths for the low-precision matmuls on the CPU.

The routed experts multiply one segment of rows per expert, and a segment's length (the slots routed to that
expert) changes with every forward. In fp32 the compiled kernels (cpu_kernels.py) multiply the segments with
MKL, which keeps nothing per shape. Under CPU autocast the experts run through grouped_mm or per-segment
matmuls, and where the CPU has AVX512 (BW/VL/DQ for bf16; AVX512-FP16 or AMX for fp16) torch sends bf16/fp16
matmuls to oneDNN, which builds and keeps a compiled kernel for every new matmul shape: resident memory then
grows for as long as new segment lengths keep appearing (tens of updates, a kernel kept for every shape).
Rounding each segment up to a bucket length (zero rows, dropped after the matmuls) bounds the shapes a run can
issue: 8 lengths up to 64 rows, then 8 per doubling, with under an eighth of a segment beyond 64 rows padding
(at most 7 rows below).

Padding rows are zero, so they add nothing to the real rows' outputs or to any gradient; the lengths depend
only on the routing, so the same inputs give the same result bit for bit. fp32 never pads (its results are
unchanged). Under torch.compile tracing nothing is padded (the lengths would need a host read in the graph).
"""

from __future__ import annotations

import torch

# Segments up to BUCKET_FLOOR rows round up to a multiple of BUCKET_STEP; longer ones to BUCKETS_PER_DOUBLING
# steps per doubling (8: under an eighth padded, ~4% on average).
BUCKET_STEP = 8
BUCKET_FLOOR = 64
BUCKETS_PER_DOUBLING = 8
LOW_PRECISION = (torch.bfloat16, torch.float16)


def bucket_rows(count: int) -> int:
    """The padded length of a segment of `count` rows: 0 stays 0; up to 64, the next multiple of 8; above, the
    next multiple of an eighth of the power of two below it (65..128 -> steps of 8, 129..256 -> steps of
    16)."""
    if count <= 0:
        return 0
    if count <= BUCKET_FLOOR:
        step = BUCKET_STEP
    else:
        step = (1 << ((count - 1).bit_length() - 1)) // BUCKETS_PER_DOUBLING
    return -(-count // step) * step


def pads_segments(device: torch.device, compute_dtype: torch.dtype) -> bool:
    """Whether the expert segments are padded: bf16/fp16 matmuls on the CPU, not while torch.compile
    traces."""
    return device.type == "cpu" and compute_dtype in LOW_PRECISION and not torch.compiler.is_compiling()


class PaddedSegments:
    """Where each sorted slot's row lies once every segment is padded to its bucket length."""

    def __init__(self, counts: list[int], device: torch.device):
        padded = [bucket_rows(count) for count in counts]
        self.counts = padded
        self.rows = sum(padded)
        starts = torch.tensor([0, *counts[:-1]], dtype=torch.int64).cumsum(0)
        padded_starts = torch.tensor([0, *padded[:-1]], dtype=torch.int64).cumsum(0)
        shift = torch.repeat_interleave(padded_starts - starts, torch.tensor(counts, dtype=torch.int64))
        self.positions = (torch.arange(sum(counts), dtype=torch.int64) + shift).to(device)

    def offsets(self, device: torch.device) -> torch.Tensor:
        """grouped_mm's offsets (where each padded segment ends), int32."""
        return torch.tensor(self.counts, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """[slots, d] sorted rows -> [padded rows, d] with zero rows after each segment (differentiable)."""
        return rows.new_zeros(self.rows, rows.shape[-1]).index_copy(0, self.positions, rows)

    def unpad(self, rows: torch.Tensor) -> torch.Tensor:
        """[padded rows, d] -> the real rows [slots, d], in the sorted order (differentiable)."""
        return rows.index_select(0, self.positions)
