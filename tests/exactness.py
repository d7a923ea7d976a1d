"""One bit-for-bit comparison of nested training states, shared by the checkpoint and resume tests."""

from __future__ import annotations

import torch


def assert_exactly_equal(a, b, where: str = "state") -> None:
    """Tensors: same dtype, shape and values (`torch.equal`); containers: same keys / lengths, recursively;
    scalars: equal and of the same type, NaN equal to NaN. `where` names the first difference."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys differ"
        for key in a:
            assert_exactly_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), f"{where}: lengths differ"
        for index, (x, y) in enumerate(zip(a, b)):
            assert_exactly_equal(x, y, f"{where}[{index}]")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, f"{where}: NaN vs {b!r}"
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} != {b!r}"
