"""The compiled CPU kernels against the reference PyTorch operators of moe.py. Routing and combine
(moe_kernels.cpp): the same choices, sort, gate weights and layer output bit for bit; balance term, statistics
and gradients to rounding (they sum in other orders). The router operator: torch's linear and the routing
kernel's outputs bit for bit, gradients to rounding, gradcheck in fp64. Routed and shared experts: the grouped
dispatch's output (plus the shared SwiGLU) bit for bit, gradients to rounding, gradcheck in fp64, on the
exported BLAS and on the at::mm path. Inference mode, dispatch modes and a missing build keep working."""

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from pilotrun.model import cpu_kernels
from pilotrun.model import moe as moe_module
from pilotrun.model.cpu_kernels import (
    FusedCombine,
    FusedExperts,
    FusedRouter,
    FusedRouting,
    cpu_kernels_loaded,
)
from pilotrun.model.moe import GroupedExperts, MoE, sorted_layout

# ninja is a project dependency (the loader finds the wheel's binary), so only a missing compiler excuses a
# skip.
COMPILER = shutil.which("c++")
pytestmark = pytest.mark.skipif(not COMPILER, reason="no C++ compiler: the reference routing runs")


def test_the_kernel_builds_and_loads_where_a_compiler_is_available():
    assert cpu_kernels_loaded()


def test_the_build_is_named_by_source_torch_and_interpreter_and_kept_apart(monkeypatch, tmp_path):
    names = {cpu_kernels.kernel_build_name(source, version, interpreter)
             for source in (b"int f();", b"int g();") for version in ("2.13.0+cpu", "2.12.0")
             for interpreter in ("cpython-311 3.11.7", "cpython-312 3.12.1")}
    assert len(names) == 8 and all(name.startswith("pilotrun_cpu_kernels_") for name in names)
    assert cpu_kernels.kernel_build_name(b"int f();", "2.13.0", "x") == cpu_kernels.kernel_build_name(
        b"int f();", "2.13.0", "x")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folders = {cpu_kernels.kernel_build_directory(name) for name in names}
    assert len(folders) == 8 and all(folder.parent == tmp_path for folder in folders)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert cpu_kernels.kernel_build_directory("n") == Path(sys.prefix) / "torch_extensions" / "n"


def test_the_loaded_library_is_the_one_built_from_this_source_in_its_own_folder():
    assert cpu_kernels_loaded()
    name = cpu_kernels.kernel_build_name(cpu_kernels.KERNEL_SOURCE.read_bytes(), torch.__version__,
                                         cpu_kernels.current_interpreter())
    [library] = cpu_kernels.loaded_kernel_libraries()
    assert Path(library).parent == cpu_kernels.kernel_build_directory(name)
    assert Path(library).name.startswith(name)


def test_a_second_different_build_is_refused_in_a_process_that_loaded_one(monkeypatch):
    other = "/elsewhere/pilotrun_cpu_kernels_000000000000/pilotrun_cpu_kernels_000000000000.so"
    monkeypatch.setattr(torch.ops, "loaded_libraries", set(torch.ops.loaded_libraries) | {other})
    cpu_kernels_loaded.cache_clear()
    try:
        with pytest.warns(UserWarning, match="another build of the kernels is already loaded"):
            assert not cpu_kernels_loaded()
    finally:
        cpu_kernels_loaded.cache_clear()


def make_moe(fused: bool, dtype=torch.float64, seed=0, **changes) -> MoE:
    torch.manual_seed(seed)
    settings = dict(
        d_model=16,
        moe_hidden=24,
        n_routed_experts=6,
        n_shared_experts=1,
        top_k=2,
        seq_aux_alpha=0.5,
        cpu_kernels=fused,
    )
    settings.update(changes)
    moe = MoE(**settings)
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.normal_(0, 0.3)
        moe.gate.expert_bias.normal_(0, 0.05)  # used only where the balance mode has a bias
    return moe.to(dtype)


def forward_backward(moe: MoE, x: torch.Tensor):
    x = x.clone().requires_grad_(True)
    moe.train()
    routing = moe.route(x.reshape(-1, x.shape[-1]), x.shape[0])
    output, aux = moe(x)
    (output.pow(2).sum() + 10 * aux).backward()
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    return routing, output.detach(), aux.detach(), x.grad, grads


@pytest.mark.slow
@pytest.mark.parametrize("score_func,route_norm", [("sigmoid", True), ("sigmoid", False), ("softmax", False),
                                                   ("softmax", True)])
@pytest.mark.parametrize("balance", ["aux_free+seq", "seq", "batch", "aux_free", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_routing_equals_the_reference(score_func, route_norm, balance, dtype):
    x = torch.randn(3, 11, 16, dtype=dtype)
    settings = dict(
        score_func=score_func, route_norm=route_norm, balance=balance, route_scale=1.7, z_loss_beta=1e-2
    )
    fused = forward_backward(make_moe(True, dtype, **settings), x)
    reference = forward_backward(make_moe(False, dtype, **settings), x)
    # the gradients: the routing's summation orders differ
    tolerance = 1e-7 if dtype == torch.float64 else 1e-4
    assert fused[0].fused and not reference[0].fused
    assert torch.equal(fused[0].indices, reference[0].indices)
    # the kernel's counting sort is argsort(stable=True)'s order
    layout = sorted_layout(reference[0].indices, 6)
    assert all(torch.equal(a, b) for a, b in zip(fused[0].layout, layout, strict=True))
    assert torch.equal(fused[0].weights, reference[0].weights)  # same scores, same arithmetic
    # The reference counts the balance fractions in fp32 (balancing.balance_loss_terms), hence 1e-7 in fp64.
    assert torch.allclose(fused[0].balance_value, reference[0].balance_value, rtol=tolerance, atol=0)
    assert torch.equal(fused[1], reference[1])  # so the layer's output is the reference's, bit for bit
    assert torch.allclose(fused[2], reference[2], rtol=tolerance, atol=1e-12)
    input_tolerance = 1e-10 if dtype == torch.float64 else 1e-5  # relative to the largest input gradient
    assert torch.allclose(
        fused[3], reference[3], rtol=0, atol=input_tolerance * reference[3].abs().max().item()
    )
    for name, grad in reference[4].items():
        assert torch.allclose(
            fused[4][name], grad, rtol=0, atol=tolerance * max(grad.abs().max().item(), 1.0)
        ), name
    assert reference[4]["gate.weight"].abs().max() > 0


@pytest.mark.parametrize("sigmoid,route_norm", [(True, True), (True, False), (False, False)])
def test_fused_routing_gradients_pass_gradcheck(sigmoid, route_norm):
    cpu_kernels_loaded()
    logits = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64) * 0.1

    def differentiable_outputs(z):
        weights, balance, *_ = FusedRouting.apply(z, bias, 2, sigmoid, route_norm, 1.3, 3)
        return weights, balance

    assert torch.autograd.gradcheck(differentiable_outputs, (logits,))


def test_fused_combine_forward_and_routed_gradient_equal_the_reference_bit_for_bit():
    cpu_kernels_loaded()
    generator = torch.Generator().manual_seed(3)
    indices = torch.rand(40, 8, generator=generator).topk(2, dim=-1).indices
    layout = sorted_layout(indices, 8)
    routed = torch.randn(80, 32, generator=generator, requires_grad=True)
    weights = torch.rand(40, 2, generator=generator, requires_grad=True)
    upstream = torch.randn(40, 32, generator=generator)
    expected = GroupedExperts.weight_and_combine(routed, weights, layout, 40, fused=False)
    result = GroupedExperts.weight_and_combine(routed, weights, layout, 40, fused=True)
    assert torch.equal(result, expected)
    expected_grads = torch.autograd.grad(expected, (routed, weights), upstream)
    result_grads = torch.autograd.grad(result, (routed, weights), upstream)
    assert torch.equal(result_grads[0], expected_grads[0])
    assert torch.allclose(result_grads[1], expected_grads[1], rtol=1e-5, atol=1e-6)

    routed64, weights64 = (
        routed.detach().double().requires_grad_(),
        weights.detach().double().requires_grad_(),
    )
    assert torch.autograd.gradcheck(
        lambda r, w: FusedCombine.apply(r, w, layout.order, layout.token_of_slot, 40), (routed64, weights64))


def test_fused_statistics_equal_the_reference_ones():
    x = torch.randn(2, 24, 16)
    fused, reference = make_moe(True, torch.float32), make_moe(False, torch.float32)
    for moe in (fused, reference):
        moe.train()
        moe(x)
        moe(x * 0.5)  # two microbatches accumulate
    assert torch.equal(fused.tokens_per_expert, reference.tokens_per_expert)
    assert torch.allclose(fused.router_statistics, reference.router_statistics, rtol=1e-5, atol=0)
    assert fused.router_statistics[-1] == 2  # microbatches
    assert torch.equal(fused.router_logit_absmax, reference.router_logit_absmax)


def test_nan_logits_still_give_distinct_experts_per_token():
    cpu_kernels_loaded()
    logits = torch.full((4, 6), float("nan"))
    _, _, indices, *_ = FusedRouting.apply(logits, logits.new_zeros(0), 3, True, True, 1.0, 1)
    assert all(len(set(row)) == 3 for row in indices.tolist())


def test_group_limited_routing_and_the_switch_keep_the_reference_path():
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    grouped = make_moe(True, n_routed_experts=6, n_expert_groups=3, n_limited_groups=2)
    assert not grouped.route(x.reshape(-1, 16), 2).fused
    assert not make_moe(False).route(x.reshape(-1, 16), 2).fused
    assert make_moe(True).route(x.reshape(-1, 16), 2).fused


@pytest.fixture(params=[True, False], ids=["exported_blas", "at_mm"])
def blas_path(request):
    """Both matmul paths of the experts kernel: the BLAS torch exports (MKL here) and at::mm on views (what a
    torch build without that export gets)."""
    cpu_kernels_loaded()
    uses_blas = torch.ops.pilotrun_experts.use_exported_blas(request.param)
    assert uses_blas == request.param  # this machine's torch exports sgemm_/dgemm_
    yield request.param
    torch.ops.pilotrun_experts.use_exported_blas(True)


def experts_outputs_and_grads(moe: MoE, x: torch.Tensor, fused: bool):
    """The routed experts alone (forward_fused or the PyTorch grouped dispatch) on the kernel's routing, and
    the gradients of x, the gate weights and the expert weights."""
    x = x.clone().requires_grad_(True)
    moe.zero_grad(set_to_none=True)
    routing = moe.route(x, 3)
    assert routing.fused
    if fused:
        output = moe.experts.forward_fused(x, routing.weights, routing.layout)
    else:
        output = moe.experts.forward_grouped(x, routing.indices, routing.weights, routing.layout, True)
    upstream = torch.randn(output.shape, generator=torch.Generator().manual_seed(7), dtype=output.dtype)
    grads = torch.autograd.grad(output, [x, routing.weights, moe.experts.w1, moe.experts.w2, moe.experts.w3],
                                upstream)
    return output.detach(), grads, routing.layout.counts


@pytest.mark.skipif(not moe_module.grouped_matmul_works(torch.device("cpu"), torch.float32),
                    reason="this torch has no CPU grouped_mm to compare with")
@pytest.mark.parametrize("d_model,hidden,tokens", [(16, 24, 33), (128, 128, 513)])
def test_fused_experts_equal_the_grouped_dispatch(blas_path, d_model, hidden, tokens):
    moe = make_moe(True, torch.float32, d_model=d_model, moe_hidden=hidden)
    with torch.no_grad():
        moe.gate.expert_bias[4] = -1e3  # expert 4 gets no token: its weight gradients must be exact zeros
    x = torch.randn(tokens, d_model, generator=torch.Generator().manual_seed(5))
    fused_output, fused_grads, counts = experts_outputs_and_grads(moe, x, fused=True)
    output, grads, _ = experts_outputs_and_grads(moe, x, fused=False)
    assert counts[4] == 0 and (counts > 0).sum() == 5
    assert torch.equal(fused_output, output)  # the same matmul calls, silu, products and combine
    for name, ours, theirs in zip(["x", "gate weights", "w1", "w2", "w3"], fused_grads, grads, strict=True):
        # The input gradient sums its two matmuls inside one BLAS call (beta = 1) instead of with an add.
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * theirs.abs().max().item()), name
    for grad in fused_grads[2:]:
        assert torch.equal(grad[4], torch.zeros_like(grad[4])) and grad.abs().sum() > 0


def test_fused_experts_pass_gradcheck(blas_path):
    generator = torch.Generator().manual_seed(11)
    tokens, top_k, experts, width, hidden = 7, 2, 4, 5, 6
    indices = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=-1).indices
    indices[:, 0] = torch.where(indices[:, 0] == 3, 0, indices[:, 0])  # expert 3: at most a few rows
    layout = sorted_layout(indices, experts)
    inputs = [torch.randn(tokens, width, generator=generator, dtype=torch.float64),
              torch.rand(tokens, top_k, generator=generator, dtype=torch.float64),
              torch.randn(experts, hidden, width, generator=generator, dtype=torch.float64),
              torch.randn(experts, width, hidden, generator=generator, dtype=torch.float64),
              torch.randn(experts, hidden, width, generator=generator, dtype=torch.float64)]
    inputs = [tensor.requires_grad_() for tensor in inputs]
    assert torch.autograd.gradcheck(
        lambda x, w, w1, w2, w3: FusedExperts.apply(x, w, w1, w2, w3, *layout), inputs)


def test_the_layer_uses_the_fused_experts_only_where_they_apply(monkeypatch):
    calls = []
    original = GroupedExperts.forward_fused
    monkeypatch.setattr(
        GroupedExperts, "forward_fused", lambda self, *args: calls.append(1) or original(self, *args)
    )
    x = torch.randn(2, 8, 16)
    make_moe(True, torch.float32)(x)
    assert len(calls) == 1
    make_moe(False, torch.float32)(x)  # model.cpu_kernels: false
    make_moe(True, torch.float64)(x.double())  # fp64 runs `sorted`, as without the kernels
    make_moe(True, torch.float32, moe_impl="sorted")(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 matmuls stay with grouped_mm
        make_moe(True, torch.float32)(x)
    assert len(calls) == 1


def reference_router(x, weight, bias, top_k, sigmoid, route_norm, route_scale, groups):
    """The router operator's definition from the pieces it fuses: torch's linear, then FusedRouting."""
    logits = torch.nn.functional.linear(x, weight)
    return logits, FusedRouting.apply(logits, bias, top_k, sigmoid, route_norm, route_scale, groups)


@pytest.mark.parametrize("sigmoid,route_norm", [(True, True), (True, False), (False, False), (False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_router_operator_equals_the_linear_and_the_routing_kernel(sigmoid, route_norm, dtype):
    cpu_kernels_loaded()
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(3 * 17, 16, generator=generator, dtype=dtype, requires_grad=True)
    weight = (torch.randn(6, 16, generator=generator, dtype=dtype) * 0.4).requires_grad_()
    bias = torch.randn(6, generator=generator, dtype=dtype) * 0.05
    buffers = [torch.zeros(6), torch.zeros(8), torch.zeros(())]
    logits, weights, balance, balance_loss, *routing = FusedRouter.apply(
        x, weight, bias, 2, sigmoid, route_norm, 1.7, 3, 0.5, False, *buffers
    )
    expected_logits, (expected_weights, expected_balance, *expected_routing) = reference_router(
        x, weight, bias, 2, sigmoid, route_norm, 1.7, 3)
    assert torch.equal(logits, expected_logits)  # the BLAS call torch's linear makes
    assert torch.equal(weights, expected_weights)
    assert torch.equal(balance, expected_balance) and torch.equal(balance_loss, 0.5 * expected_balance)
    assert all(torch.equal(a, b) for a, b in zip(routing, expected_routing, strict=True))
    assert all(buffer.count_nonzero() == 0 for buffer in buffers)  # record=False leaves the statistics alone
    upstream = torch.randn(weights.shape, generator=generator, dtype=dtype)
    z_upstream = torch.randn(logits.shape, generator=generator, dtype=dtype)

    def loss(logit_values, gate_weights, balance_value, scaled_balance):
        return (
            (logit_values * z_upstream).sum()
            + (gate_weights * upstream).sum()
            + 3 * balance_value
            + scaled_balance
        )

    ours = torch.autograd.grad(loss(logits, weights, balance, balance_loss), (x, weight))
    theirs = torch.autograd.grad(
        loss(expected_logits, expected_weights, expected_balance, 0.5 * expected_balance), (x, weight)
    )
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=tolerance * b.abs().max().item())


@pytest.mark.parametrize("sigmoid,route_norm", [(True, True), (False, False)])
def test_the_router_operator_passes_gradcheck(sigmoid, route_norm):
    cpu_kernels_loaded()
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(12, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, generator=generator, dtype=torch.float64) * 0.1
    buffers = [torch.zeros(4), torch.zeros(8), torch.zeros(())]

    def differentiable_outputs(tokens, router_weight):
        return FusedRouter.apply(tokens, router_weight, bias, 2, sigmoid, route_norm, 1.3, 3, 0.25, False,
                                 *buffers)[:4]

    assert torch.autograd.gradcheck(differentiable_outputs, (x, weight))


@pytest.mark.parametrize("balance", ["aux_free+seq", "aux_free", "none"])
def test_statistics_recorded_by_the_router_operator_equal_the_reference_in_fp64(balance):
    x = torch.randn(2, 24, 16, dtype=torch.float64)
    fused = make_moe(True, torch.float64, balance=balance)
    reference = make_moe(False, torch.float64, balance=balance)
    for moe in (fused, reference):
        moe.train()
        moe(x)
        moe(x * 0.5)
    assert fused.router_statistics.dtype == torch.float64
    assert torch.equal(fused.tokens_per_expert, reference.tokens_per_expert)
    assert torch.allclose(fused.router_statistics, reference.router_statistics, rtol=1e-9, atol=0)
    assert torch.equal(fused.router_logit_absmax, reference.router_logit_absmax)


@pytest.mark.skipif(not moe_module.grouped_matmul_works(torch.device("cpu"), torch.float32),
                    reason="this torch has no CPU grouped_mm to compare with")
@pytest.mark.parametrize(
    "d_model,hidden,shared,tokens", [(16, 24, 1, 33), (16, 24, 2, 40), (128, 128, 1, 513)]
)
def test_shared_experts_inside_the_operator_equal_the_grouped_dispatch_plus_the_swiglu(
    blas_path, d_model, hidden, shared, tokens
):
    moe = make_moe(True, torch.float32, d_model=d_model, moe_hidden=hidden, n_shared_experts=shared)
    x = torch.randn(tokens, d_model, generator=torch.Generator().manual_seed(6))
    results = []
    for fused in (True, False):
        inputs = x.clone().requires_grad_(True)
        moe.zero_grad(set_to_none=True)
        routing = moe.route(inputs, 1)
        if fused:
            output = moe.experts.forward_fused(inputs, routing.weights, routing.layout, moe.shared_experts)
        else:
            output = moe.experts.forward_grouped(
                inputs, routing.indices, routing.weights, routing.layout, True
            ) + moe.shared_experts(inputs)
        upstream = torch.randn(output.shape, generator=torch.Generator().manual_seed(7))
        parameters = [moe.experts.w1, moe.experts.w2, moe.experts.w3, *moe.shared_experts.parameters(),
                      moe.gate.weight]
        results.append((output.detach(), torch.autograd.grad(output, [inputs, *parameters], upstream)))
    (output, grads), (expected, expected_grads) = results
    assert torch.equal(output, expected)  # the routed sums first, then + shared, as the layer adds them
    for ours, theirs in zip(grads, expected_grads, strict=True):
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())


def test_fused_experts_with_shared_experts_pass_gradcheck(blas_path):
    generator = torch.Generator().manual_seed(12)
    tokens, top_k, experts, width, hidden, shared_hidden = 6, 2, 4, 5, 6, 7
    layout = sorted_layout(
        torch.rand(tokens, experts, generator=generator).topk(top_k, dim=-1).indices, experts
    )
    shapes = [
        (tokens, width),
        (tokens, top_k),
        (experts, hidden, width),
        (experts, width, hidden),
        (experts, hidden, width),
        (shared_hidden, width),
        (width, shared_hidden),
        (shared_hidden, width),
    ]
    inputs = [
        torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_() for shape in shapes
    ]
    assert torch.autograd.gradcheck(
        lambda x, w, w1, w2, w3, s1, s2, s3: FusedExperts.apply(x, w, w1, w2, w3, *layout, s1, s2, s3), inputs
    )


@pytest.mark.parametrize("shared", [0, 1, 2])
def test_the_default_layer_equals_the_pytorch_layer_bit_for_bit_in_fp32(shared):
    x = torch.randn(3, 20, 16)
    outputs = []
    for fused in (True, False):
        moe = make_moe(fused, torch.float32, n_shared_experts=shared)
        moe.train()
        outputs.append(forward_backward(moe, x))
    (
        (routing, output, aux, input_grad, grads),
        (_, expected, expected_aux, expected_input_grad, expected_grads),
    ) = outputs
    assert routing.fused and torch.equal(output, expected)
    assert torch.allclose(aux, expected_aux, rtol=1e-5, atol=0)
    assert torch.allclose(
        input_grad, expected_input_grad, rtol=0, atol=1e-5 * expected_input_grad.abs().max().item()
    )
    for name, grad in expected_grads.items():
        assert torch.allclose(grads[name], grad, rtol=0, atol=1e-5 * max(grad.abs().max().item(), 1.0)), name


def test_inference_mode_runs_the_operators_without_autograd():
    x = torch.randn(2, 12, 16)
    moe = make_moe(True, torch.float32)
    moe.eval()
    with torch.no_grad():
        expected, expected_aux = moe(x)
    with torch.inference_mode():
        output, aux = moe(x)
    assert torch.equal(output, expected) and torch.equal(aux, expected_aux)


def test_under_a_dispatch_mode_the_layer_runs_the_reference_operators_that_it_can_see():
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(2, 12, 16)
    fused, reference = make_moe(True, torch.float32), make_moe(False, torch.float32)
    counts = []
    for moe in (fused, reference):
        with FlopCounterMode(display=False) as counter:
            assert not moe.route(x.reshape(24, 16), 2).fused
            moe(x)[0].sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


def test_without_the_kernels_the_fp32_default_layer_is_the_pytorch_one(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "cpu_kernels_loaded", lambda: False)
    x = torch.randn(2, 8, 16)
    fused = make_moe(True, torch.float32)
    assert not fused.route(x.reshape(16, 16), 2).fused
    assert torch.equal(fused(x)[0], make_moe(False, torch.float32)(x)[0])


def test_the_build_uses_the_packaged_ninja_whichever_comes_first_on_path():
    import ninja

    from pilotrun.model.cpu_kernels import pinned_ninja_path

    system_first = os.pathsep.join(["/usr/bin", ninja.BIN_DIR, "/bin"])
    assert pinned_ninja_path(system_first).split(os.pathsep) == [ninja.BIN_DIR, "/usr/bin", "/bin"]
    assert pinned_ninja_path(pinned_ninja_path(system_first)) == pinned_ninja_path(system_first)


@pytest.mark.slow
def test_an_activated_and_a_plain_shell_load_the_same_build_without_rebuilding_it(tmp_path):
    """`make` runs without the venv on PATH (a system ninja first), a user's shell with it: both must find the
    one build, neither recompile it (its library's bytes and modification time stay as they are)."""
    import subprocess
    import sys

    from pilotrun.model.cpu_kernels import (
        current_interpreter,
        kernel_build_directory,
        kernel_build_name,
        kernel_library_present,
    )

    if not cpu_kernels_loaded():
        pytest.skip("the CPU kernels cannot be built on this machine (no compiler)")
    name = kernel_build_name(cpu_kernels.KERNEL_SOURCE.read_bytes(), torch.__version__, current_interpreter())
    directory = kernel_build_directory(name)
    assert kernel_library_present(directory, name)
    library = directory / f"{name}.so"
    before = (library.stat().st_mtime_ns, library.read_bytes())
    probe = "from pilotrun.model.cpu_kernels import cpu_kernels_loaded as c; print(c())"
    venv_bin = str(Path(sys.executable).parent)
    for path in ("/usr/local/bin:/usr/bin:/bin", f"{venv_bin}:/usr/local/bin:/usr/bin:/bin"):
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PATH": path})
        assert done.stdout.strip() == "True", done.stderr
        assert "building the CPU MoE kernels" not in done.stderr
    assert (library.stat().st_mtime_ns, library.read_bytes()) == before


def test_the_build_compiles_its_own_copy_of_the_source_written_only_when_it_differs(tmp_path, monkeypatch):
    from pilotrun.model.cpu_kernels import kernel_source_in

    source = tmp_path / "checkout" / "moe_kernels.cpp"
    source.parent.mkdir()
    source.write_text("int f() { return 1; }\n")
    monkeypatch.setattr(cpu_kernels, "KERNEL_SOURCE", source)
    build = tmp_path / "build"
    build.mkdir()
    copy = kernel_source_in(build)
    assert copy == build / "moe_kernels.cpp" and copy.read_bytes() == source.read_bytes()
    os.utime(copy, ns=(1, 1))  # an old time stamp: a rewrite would show as a newer one
    assert kernel_source_in(build) == copy and copy.stat().st_mtime_ns == 1  # same bytes: left untouched
    source.write_text("int f() { return 2; }\n")
    assert kernel_source_in(build).read_bytes() == source.read_bytes()  # other bytes: replaced
    assert sorted(p.name for p in build.iterdir()) == ["moe_kernels.cpp"]  # no temp file left behind


@pytest.mark.slow
def test_a_second_checkout_of_the_same_source_loads_the_build_without_rebuilding_it(tmp_path):
    """Two checkouts sharing one virtual environment (a git worktree beside the main one) name the same build;
    compiling each checkout's own path made ninja rebuild the library for whichever loaded it last."""
    import shutil
    import subprocess
    import sys

    from pilotrun.model.cpu_kernels import current_interpreter, kernel_build_directory, kernel_build_name

    if not cpu_kernels_loaded():
        pytest.skip("the CPU kernels cannot be built on this machine (no compiler)")
    name = kernel_build_name(cpu_kernels.KERNEL_SOURCE.read_bytes(), torch.__version__, current_interpreter())
    library = kernel_build_directory(name) / f"{name}.so"
    before = (library.stat().st_mtime_ns, library.read_bytes())
    checkout = tmp_path / "other-checkout"
    shutil.copytree(Path(cpu_kernels.__file__).parents[1], checkout / "pilotrun")
    probe = "import pilotrun.model.cpu_kernels as k; print(k.__file__); print(k.cpu_kernels_loaded())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(checkout)}, cwd=tmp_path)
    assert done.stdout.split() == [str(checkout / "pilotrun" / "model" / "cpu_kernels.py"), "True"], (
        done.stderr
    )
    assert "building the CPU MoE kernels" not in done.stderr
    assert (library.stat().st_mtime_ns, library.read_bytes()) == before
    assert str(checkout) not in (library.parent / "build.ninja").read_text()
