"""The fused CPU routing kernel (routing_kernel.cpp): build, load, and wrap it as one autograd function.

The kernel is compiled on first use with torch's C++ extension builder (g++ and ninja; 13 s on the 2-core
machine, then cached under TORCH_EXTENSIONS_DIR; the Makefile's set-up builds it once ahead). Where it cannot be
built or does not apply (CUDA tensors, torch.compile tracing, group-limited routing, `model.fused_routing:
false`), MoE keeps the reference path of moe.py, which defines the same quantities with PyTorch operators;
tests/model/test_routing_fused.py holds the two together.
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from pathlib import Path

import torch

KERNEL_SOURCE = Path(__file__).with_name("routing_kernel.cpp")


@functools.cache
def routing_kernel_loaded() -> bool:
    """Build (once per machine and source version) and load the kernel; False, with one warning, if that fails."""
    try:
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # the PyPI wheel's binary, when the virtual environment is not active
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

        # -ffp-contract=off: no fused multiply-adds, so the combine's sums round as index_add_'s do.
        load(name="pilotrun_routing", sources=[str(KERNEL_SOURCE)], extra_cflags=["-O3", "-ffp-contract=off"],
             is_python_module=False, verbose=False)
        return hasattr(torch.ops.pilotrun_routing, "route_forward")
    except Exception as error:  # no compiler, no ninja, a read-only cache: the reference path still works
        detail = str(error).strip().splitlines()[-1:] or [""]  # the compiler's full log can run to pages
        warnings.warn(f"pilotrun: the fused routing kernel could not be built ({type(error).__name__}: {detail[0]}); "
                      "using the PyTorch reference routing (same results, slower on the CPU)", stacklevel=2)
        return False


def fused_routing_applies(logits: torch.Tensor, n_groups: int) -> bool:
    """CPU fp32/fp64 logits, no group-limited routing, not being traced by torch.compile, and the kernel built."""
    return (logits.device.type == "cpu" and n_groups <= 1 and not torch.compiler.is_compiling()
            and logits.dtype in (torch.float32, torch.float64) and routing_kernel_loaded())


class FusedRouting(torch.autograd.Function):
    """logits [N, E] -> gate weights [N, K] and the balance value, both differentiable; the rest is routing
    bookkeeping without gradient (indices, sort order, counts, statistics)."""

    @staticmethod
    def forward(ctx, logits, bias, top_k, sigmoid, route_norm, route_scale, groups):
        # The score function by PyTorch's vectorized operator (the reference's, bit for bit), the rest in one pass.
        scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
        (indices, weights, order, token_of_slot, counts, fraction, row_sums,
         sums) = torch.ops.pilotrun_routing.route_forward(logits, scores, bias, top_k, sigmoid, route_norm, route_scale,
                                                          groups)
        ctx.save_for_backward(scores, indices, weights, fraction, row_sums)
        ctx.settings = (sigmoid, route_norm, route_scale)
        balance_value = sums[4].clone()  # ROUTER_STATISTICS order: tokens, entropy, spread, mass, balance, 1, |z|max
        ctx.mark_non_differentiable(indices, order, token_of_slot, counts, sums)
        return weights, balance_value, indices, order, token_of_slot, counts, sums

    @staticmethod
    def backward(ctx, grad_weights, grad_balance, *unused):
        scores, indices, weights, fraction, row_sums = ctx.saved_tensors
        sigmoid, route_norm, route_scale = ctx.settings
        if grad_weights is None:
            grad_weights = torch.zeros_like(weights)
        if grad_balance is None:
            grad_balance = torch.zeros((), dtype=scores.dtype)
        grad_logits = torch.ops.pilotrun_routing.route_backward(
            grad_weights, grad_balance, scores, indices, weights, fraction, row_sums, sigmoid, route_norm, route_scale)
        return grad_logits, None, None, None, None, None, None


class FusedCombine(torch.autograd.Function):
    """Weight the expert-sorted outputs by their gates and add them into their tokens' rows, in one pass each
    way (the reference: index_select of the gates, a multiply, zeros and index_add_, and their backward)."""

    @staticmethod
    def forward(ctx, routed, weights, order, token_of_slot, tokens):
        ctx.save_for_backward(routed, weights, order, token_of_slot)
        return torch.ops.pilotrun_routing.combine_forward(routed, weights, order, token_of_slot, tokens)

    @staticmethod
    def backward(ctx, grad_output):
        routed, weights, order, token_of_slot = ctx.saved_tensors
        grad_routed, grad_weights = torch.ops.pilotrun_routing.combine_backward(
            grad_output, routed, weights, order, token_of_slot)
        return grad_routed, grad_weights, None, None, None
