"""Bucket lengths of the low-precision expert segments: few, never shorter than the segment, little padding;
the padded layout puts every row back where it was."""

import pytest
import torch

from pilotrun.model.segment_buckets import PaddedSegments, bucket_rows, pads_segments


def test_bucket_lengths_are_few_and_cover_every_segment_with_little_padding():
    lengths = {bucket_rows(count) for count in range(0, 4097)}
    # 0, 8, 16, ..., 64, then 8 per doubling up to 4096: a run's shapes are bounded whatever the routing does.
    assert sorted(lengths)[:20] == [
        0,
        8,
        16,
        24,
        32,
        40,
        48,
        56,
        64,
        72,
        80,
        88,
        96,
        104,
        112,
        120,
        128,
        144,
        160,
        176,
    ]
    assert len(lengths) == 9 + 8 * 6
    for count in range(1, 4097):
        padded = bucket_rows(count)
        assert padded >= count and bucket_rows(padded) == padded  # a bucket length is its own bucket
        assert padded - count < (8 if count <= 64 else count / 8)
    assert bucket_rows(0) == 0


def test_padded_segments_put_each_row_back_and_pad_with_zeros():
    counts = [3, 0, 17, 65, 1]
    rows = torch.randn(sum(counts), 5, requires_grad=True)
    segments = PaddedSegments(counts, rows.device)
    assert segments.counts == [8, 0, 24, 72, 8] and segments.rows == 112
    assert segments.offsets(rows.device).tolist() == [8, 8, 32, 104, 112]
    assert segments.offsets(rows.device).dtype == torch.int32
    padded = segments.pad(rows)
    ends = [0, 8, 8, 32, 104, 112]
    start = 0
    for expert, count in enumerate(counts):  # each segment at the start of its bucket, zeros after it
        block = padded[ends[expert]:ends[expert + 1]]
        assert torch.equal(block[:count], rows[start:start + count])
        assert torch.equal(block[count:], torch.zeros_like(block[count:]))
        start += count
    assert torch.equal(segments.unpad(padded), rows)
    weights = torch.randn(112, 5)
    # the gradient skips the padding rows
    (segments.unpad(padded * 3) * weights[:sum(counts)]).sum().backward()
    assert torch.equal(rows.grad, 3 * weights[:sum(counts)])


@pytest.mark.parametrize(("dtype", "expected"), [(torch.bfloat16, True), (torch.float16, True),
                                                 (torch.float32, False), (torch.float64, False)])
def test_only_low_precision_cpu_matmuls_are_padded(dtype, expected):
    assert pads_segments(torch.device("cpu"), dtype) is expected
    assert not pads_segments(torch.device("cuda"), dtype)
