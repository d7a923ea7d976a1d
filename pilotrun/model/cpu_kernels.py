"""The compiled CPU kernels of the MoE layer: build, load, and wrap them as autograd operators.

moe_kernels.cpp holds both:
- the routing (biased top-k, gate normalization, balance term, statistics, sort by expert) and the
  gate-weighted combine, one pass each way (FusedRouting, FusedCombine); and what the layer runs, FusedRouter:
  the router's matmul, that routing, the step's statistics and the scaled balance loss.
- the routed experts of the `grouped` dispatch (gather, every expert's SwiGLU on its segment, combine) and the
  layer's shared experts as one operator each way (FusedExperts). FusedRouter and FusedExperts are C++
  operators with their backward registered as C++ autograd nodes, so neither direction of the layer's routing
  and experts runs Python; FusedRouting and FusedCombine are Python autograd functions over their kernels (the
  pieces the reference dispatches combine with PyTorch operators).

On a CPU every small PyTorch operator has a fixed cost whatever its size, so at pilot microbatches the
reference path's ~100 operators per MoE layer cost as much as the expert matmuls (BENCHMARKS.md, bench_model).
The kernels are compiled on first use with torch's C++ extension builder (g++ and ninja; a build takes a
while, so the Makefile's set-up builds them once ahead). The build is named by a hash of the kernel source,
the compiler flags, the torch version and the interpreter (kernel_build_name) and kept inside the virtual
environment (kernel_build_directory), so two checkouts or two venvs never rebuild over each other's library,
and a checkout never loads a library built from another source. The operator namespaces (pilotrun_routing,
pilotrun_experts) are registered by the library itself, so one process holds at most one build: loading a
second, different one is refused (the reference path runs instead, with a warning). Where they cannot be built
or do not apply (CUDA tensors, autocast, torch.compile tracing, a Python dispatch mode such as torch's FLOP
counter, group-limited routing, `model.cpu_kernels: false`), MoE keeps the reference path of moe.py, which
defines the same quantities with PyTorch operators; tests/model/test_cpu_kernels.py holds the two together.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

KERNEL_SOURCE = Path(__file__).with_name("moe_kernels.cpp")
# -ffp-contract=off: no fused multiply-adds, so the combine's sums round as index_add_'s do.
KERNEL_CFLAGS = ("-O3", "-ffp-contract=off")
KERNEL_BUILD_PREFIX = "pilotrun_cpu_kernels_"


def kernel_build_name(source: bytes, torch_version: str, interpreter: str) -> str:
    """`pilotrun_cpu_kernels_<12 hex>`: a different source, torch or Python gives a different name, so a
    library is only ever loaded by the code it was compiled from."""
    digest = hashlib.sha256()
    for part in (source, " ".join(KERNEL_CFLAGS).encode(), torch_version.encode(), interpreter.encode()):
        digest.update(len(part).to_bytes(8, "little") + part)
    return KERNEL_BUILD_PREFIX + digest.hexdigest()[:12]


def current_interpreter() -> str:
    """What the compiled library depends on besides torch: the Python ABI and the machine."""
    return f"{sys.implementation.cache_tag} {sys.version} {platform.machine()}"


def kernel_build_directory(name: str) -> Path:
    """TORCH_EXTENSIONS_DIR/<name> when the user set it, else <venv>/torch_extensions/<name> (sys.prefix is
    the virtual environment): one folder per build, never shared with a checkout that has another source."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) / name if root else Path(sys.prefix) / "torch_extensions" / name


def pinned_ninja_path(path: str) -> str:
    """PATH with the ninja of the `ninja` package (a dependency, installed in the venv) first. A different
    ninja found first (a system /usr/bin/ninja when the venv is not activated) writes its build log in another
    version, and each then takes the other's output as stale and rebuilds it: the key of a build must not
    depend on which shell started the process."""
    import ninja

    return os.pathsep.join([ninja.BIN_DIR, *(p for p in path.split(os.pathsep) if p and p != ninja.BIN_DIR)])


def kernel_source_in(directory: Path) -> Path:
    """The build's own copy of the kernel source, which the build compiles. The build is named by the source's
    content, not its path, so two checkouts of the same source share one build; compiled from each checkout's
    own path, ninja would see a changed command and each would rebuild the library over the other's. The copy
    is written only when absent or different (temp + rename), so its time stamp does not trigger a rebuild."""
    copy = directory / KERNEL_SOURCE.name
    source = KERNEL_SOURCE.read_bytes()
    if not copy.is_file() or copy.read_bytes() != source:
        temp = copy.with_name(f".{copy.name}.{os.getpid()}.tmp")
        temp.write_bytes(source)
        os.replace(temp, copy)
    return copy


def kernel_library_present(directory: Path, name: str) -> bool:
    """Whether this build's library is already compiled (a build would then only check it, in a moment)."""
    return (directory / f"{name}.so").is_file()


def loaded_kernel_libraries() -> list[str]:
    """The pilotrun kernel libraries this process has loaded (torch.ops keeps their paths)."""
    return sorted(
        path for path in torch.ops.loaded_libraries if Path(path).name.startswith(KERNEL_BUILD_PREFIX)
    )


@functools.cache
def cpu_kernels_loaded() -> bool:
    """Build (once per venv, source, torch and Python) and load the kernels; False, with one warning, if that
    fails."""
    try:
        from torch.utils.cpp_extension import load

        os.environ["PATH"] = pinned_ninja_path(os.environ.get("PATH", ""))
        name = kernel_build_name(KERNEL_SOURCE.read_bytes(), torch.__version__, current_interpreter())
        directory = kernel_build_directory(name)
        others = [path for path in loaded_kernel_libraries() if Path(path).parent != directory]
        if others:  # their operators already own the namespaces: a second build cannot register its own
            raise RuntimeError(
                f"another build of the kernels is already loaded in this process ({others[0]})"
            )
        directory.mkdir(parents=True, exist_ok=True)
        if not kernel_library_present(directory, name):  # a compile takes a minute on 2 cores: say so once
            print(
                f"pilotrun: building the CPU MoE kernels into {directory} (once per venv and source, about a "
                "minute)",
                file=sys.stderr,
                flush=True,
            )
        load(name=name, sources=[str(kernel_source_in(directory))], extra_cflags=list(KERNEL_CFLAGS),
             build_directory=str(directory), is_python_module=False, verbose=False)
        return hasattr(torch.ops.pilotrun_routing, "router") and hasattr(
            torch.ops.pilotrun_experts, "experts"
        )
    except Exception as error:  # no compiler, no ninja, a read-only cache: the reference path still works
        detail = str(error).strip().splitlines()[-1:] or [""]  # the compiler's full log can run to pages
        warnings.warn(
            f"pilotrun: the CPU MoE kernels could not be built ({type(error).__name__}: {detail[0]}); "
            "using PyTorch operators for routing and experts (same results, slower on the CPU)",
            stacklevel=2,
        )
        return False


def no_tracing_or_dispatch_mode() -> bool:
    """Whether the compiled operators may run here: not while torch.compile traces, and not under a Python
    dispatch mode (torch's FLOP counter, fake tensors), which sees an operator but not the matmuls inside it
    (the kernels call the BLAS directly) and cannot hand them fake tensors; there the reference operators
    run."""
    return not torch.compiler.is_compiling() and not is_in_torch_dispatch_mode()


def fused_routing_applies(logits: torch.Tensor, n_groups: int, dtype: torch.dtype | None = None) -> bool:
    """CPU fp32/fp64 logits (or CPU router input whose logits have `dtype`), no group-limited routing, neither
    torch.compile tracing nor a dispatch mode (no_tracing_or_dispatch_mode), and the kernel built."""
    return (logits.device.type == "cpu" and n_groups <= 1 and no_tracing_or_dispatch_mode()
            and (dtype or logits.dtype) in (torch.float32, torch.float64) and cpu_kernels_loaded())


class FusedRouting(torch.autograd.Function):
    """logits [N, E] -> gate weights [N, K] and the balance value, both differentiable; the rest is routing
    bookkeeping without gradient (indices, sort order, counts, statistics)."""

    @staticmethod
    def forward(ctx, logits, bias, top_k, sigmoid, route_norm, route_scale, groups):
        # The score function by PyTorch's vectorized operator (the reference's, bit for bit), the rest in one
        # pass.
        scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
        (indices, weights, order, token_of_slot, counts, fraction, row_sums, sums) = (
            torch.ops.pilotrun_routing.route_forward(
                logits, scores, bias, top_k, sigmoid, route_norm, route_scale, groups
            )
        )
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
            grad_weights,
            grad_balance,
            scores,
            indices,
            weights,
            fraction,
            row_sums,
            sigmoid,
            route_norm,
            route_scale,
        )
        return grad_logits, None, None, None, None, None, None


class FusedRouter:
    """What the layer's routing runs: FusedRouting with the router's matmul in front, the balance loss scaled
    and the step's statistics recorded, as one compiled operator whose backward is an autograd node in C++
    (`torch.ops.pilotrun_routing.router`; neither direction goes through Python). Tokens x [N, d] and the
    router weight [E, d] -> (logits [N, E], gate weights [N, K], balance value, balance_weight * balance value
    (zeros when the weight is 0), indices, order, token_of_slot, counts, sums); the first four are
    differentiable (the z-loss reads the logits). With `record`, adds the counts and sums to the MoE layer's
    tokens_per_expert, router_statistics and router_logit_absmax as MoE.record_statistics does."""

    @staticmethod
    def apply(x, router_weight, bias, top_k, sigmoid, route_norm, route_scale, groups, balance_weight, record,
              tokens_per_expert, router_statistics, router_logit_absmax):
        return torch.ops.pilotrun_routing.router(
            x,
            router_weight,
            bias,
            top_k,
            sigmoid,
            route_norm,
            route_scale,
            groups,
            balance_weight,
            record,
            tokens_per_expert,
            router_statistics,
            router_logit_absmax,
        )


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
    """CPU fp32 tokens, gate weights and expert weights (the dtype whose grouped dispatch runs grouped_mm on
    the CPU, which this replaces; fp64 runs `sorted`, as without the kernels), no autocast (its bf16/fp16
    matmuls stay with grouped_mm), neither torch.compile tracing nor a dispatch mode
    (no_tracing_or_dispatch_mode), and the kernels built."""
    return (
        x.device.type == "cpu"
        and x.dtype == gate_weights.dtype == expert_weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and no_tracing_or_dispatch_mode()
        and cpu_kernels_loaded()
    )


class FusedExperts:
    """The routed experts of one layer, and optionally its shared experts: tokens x [N, d] and gate weights
    [N, K] -> sum_k w_{t,k} FFN_{e_{t,k}}(x_t) (+ the shared SwiGLU of x_t) [N, d], with the expert weights
    w1, w3 [E, F, d] and w2 [E, d, F], the routing's sorted layout and, after it, the shared experts' w1, w3
    [Fs, d] and w2 [d, Fs] (none: routed experts only). The same arithmetic as the grouped dispatch's
    grouped_mm, silu
    * mul, FusedCombine and the add of the shared SwiGLU (tests: bit for bit on this machine's BLAS), as one
      compiled operator whose backward is an autograd node in C++ (`torch.ops.pilotrun_experts.experts`).
      Saves the activations that autograd saves there."""

    @staticmethod
    def apply(x, weights, w1, w2, w3, order, token_of_slot, counts, *shared):
        shared_weights = shared if shared else (x.new_empty(0),) * 3
        return torch.ops.pilotrun_experts.experts(x, weights, w1, w2, w3, order, token_of_slot, counts,
                                                  *shared_weights)
