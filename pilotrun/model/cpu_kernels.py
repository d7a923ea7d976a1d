"""The compiled CPU kernels of the MoE layer: build, load, and wrap them as autograd functions.

moe_kernels.cpp holds both:
- the routing (biased top-k, gate normalization, balance term, statistics, sort by expert)
  and the gate-weighted combine, one pass each way (FusedRouting, FusedCombine).
- the routed experts of the `grouped` dispatch (gather, every expert's SwiGLU on its segment,
  combine) as one operator each way (FusedExperts).

On a CPU every small PyTorch operator costs ~5-20 us whatever its size, so at pilot microbatches the reference
path's ~100 operators per MoE layer cost as much as the expert matmuls (BENCHMARKS.md, bench_model). The kernels are
compiled on first use with torch's C++ extension builder (g++ and ninja; ~17 s on the 2-core machine; the Makefile's
set-up builds them once ahead). The build is named by a hash of the kernel source, the compiler flags, the torch
version and the interpreter (kernel_build_name) and kept inside the virtual environment (kernel_build_directory),
so two checkouts or two venvs never rebuild over each other's library, and a checkout never loads a library built
from another source. The operator namespaces (pilotrun_routing, pilotrun_experts) are registered by the library
itself, so one process holds at most one build: loading a second, different one is refused (the reference path
runs instead, with a warning). Where they cannot be built or do not
apply (CUDA tensors, autocast, torch.compile tracing, group-limited routing, `model.cpu_kernels: false`), MoE keeps
the reference path of moe.py, which defines the same quantities with PyTorch operators;
tests/model/test_cpu_kernels.py holds the two together.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path

import torch

KERNEL_SOURCE = Path(__file__).with_name("moe_kernels.cpp")
# -ffp-contract=off: no fused multiply-adds, so the combine's sums round as index_add_'s do.
KERNEL_CFLAGS = ("-O3", "-ffp-contract=off")
KERNEL_BUILD_PREFIX = "pilotrun_cpu_kernels_"


def kernel_build_name(source: bytes, torch_version: str, interpreter: str) -> str:
    """`pilotrun_cpu_kernels_<12 hex>`: a different source, torch or Python gives a different name, so a library
    is only ever loaded by the code it was compiled from."""
    digest = hashlib.sha256()
    for part in (source, " ".join(KERNEL_CFLAGS).encode(), torch_version.encode(), interpreter.encode()):
        digest.update(len(part).to_bytes(8, "little") + part)
    return KERNEL_BUILD_PREFIX + digest.hexdigest()[:12]


def current_interpreter() -> str:
    """What the compiled library depends on besides torch: the Python ABI and the machine."""
    return f"{sys.implementation.cache_tag} {sys.version} {platform.machine()}"


def kernel_build_directory(name: str) -> Path:
    """TORCH_EXTENSIONS_DIR/<name> when the user set it, else <venv>/torch_extensions/<name> (sys.prefix is the
    virtual environment): one folder per build, never shared with a checkout that has another source."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) / name if root else Path(sys.prefix) / "torch_extensions" / name


def loaded_kernel_libraries() -> list[str]:
    """The pilotrun kernel libraries this process has loaded (torch.ops keeps their paths)."""
    return sorted(path for path in torch.ops.loaded_libraries if Path(path).name.startswith(KERNEL_BUILD_PREFIX))


@functools.cache
def cpu_kernels_loaded() -> bool:
    """Build (once per venv, source, torch and Python) and load the kernels; False, with one warning, if that fails."""
    try:
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # the PyPI wheel's binary, when the virtual environment is not active
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

        name = kernel_build_name(KERNEL_SOURCE.read_bytes(), torch.__version__, current_interpreter())
        directory = kernel_build_directory(name)
        others = [path for path in loaded_kernel_libraries() if Path(path).parent != directory]
        if others:  # their operators already own the namespaces: a second build cannot register its own
            raise RuntimeError(f"another build of the kernels is already loaded in this process ({others[0]})")
        directory.mkdir(parents=True, exist_ok=True)
        load(name=name, sources=[str(KERNEL_SOURCE)], extra_cflags=list(KERNEL_CFLAGS), build_directory=str(directory),
             is_python_module=False, verbose=False)
        return hasattr(torch.ops.pilotrun_routing, "route_forward") and hasattr(torch.ops.pilotrun_experts,
                                                                                 "experts_forward")
    except Exception as error:  # no compiler, no ninja, a read-only cache: the reference path still works
        detail = str(error).strip().splitlines()[-1:] or [""]  # the compiler's full log can run to pages
        warnings.warn(f"pilotrun: the CPU MoE kernels could not be built ({type(error).__name__}: {detail[0]}); "
                      "using PyTorch operators for routing and experts (same results, slower on the CPU)",
                      stacklevel=2)
        return False


def fused_routing_applies(logits: torch.Tensor, n_groups: int) -> bool:
    """CPU fp32/fp64 logits, no group-limited routing, not being traced by torch.compile, and the kernel built."""
    return (logits.device.type == "cpu" and n_groups <= 1 and not torch.compiler.is_compiling()
            and logits.dtype in (torch.float32, torch.float64) and cpu_kernels_loaded())


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
        balance_value = sums[4].clone()  # ROUTER_STATISTICS order (moe.py), then the |logit| maximum
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


def fused_experts_apply(x: torch.Tensor, gate_weights: torch.Tensor, expert_weight: torch.Tensor) -> bool:
    """CPU fp32 tokens, gate weights and expert weights (the dtype whose grouped dispatch runs grouped_mm on the
    CPU, which this replaces; fp64 runs `sorted`, as without the kernels), no autocast (its bf16/fp16 matmuls stay
    with grouped_mm), not being traced by torch.compile, and the kernels built."""
    return (x.device.type == "cpu" and x.dtype == gate_weights.dtype == expert_weight.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling() and cpu_kernels_loaded())


class FusedExperts(torch.autograd.Function):
    """The routed experts of one layer: tokens x [N, d] and gate weights [N, K] -> sum_k w_{t,k} FFN_{e_{t,k}}(x_t)
    [N, d], with the expert weights w1, w3 [E, F, d] and w2 [E, d, F] and the routing's sorted layout. The same
    arithmetic as the grouped dispatch's grouped_mm, silu * mul and FusedCombine (tests: bit for bit on this
    machine's BLAS), in one operator each way. Saves the same activations that autograd saves there."""

    @staticmethod
    def forward(ctx, x, weights, w1, w2, w3, order, token_of_slot, counts):
        output, *activations = torch.ops.pilotrun_experts.experts_forward(x, weights, w1, w2, w3, order,
                                                                          token_of_slot, counts)
        ctx.save_for_backward(weights, w1, w2, w3, order, token_of_slot, counts, *activations)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grad_x, grad_weights, grad_w1, grad_w2, grad_w3 = torch.ops.pilotrun_experts.experts_backward(
            grad_output, *ctx.saved_tensors)
        return grad_x, grad_weights, grad_w1, grad_w2, grad_w3, None, None, None
