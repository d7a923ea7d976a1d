"""Router and MoE: gate weights, bias-only-selects, group-limited routing, dispatch
implementations against the dense reference and a per-token oracle."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pilotrun.model import moe as moe_module
from pilotrun.model.balancing import default_route_scale
from pilotrun.model.moe import MoE, Router


def make_router(n_experts=4, top_k=2, score_func="sigmoid", route_norm=True, route_scale=1.5, groups=1,
                limited=1, use_bias=True, d=16, std=0.5, seed=0) -> Router:
    torch.manual_seed(seed)
    router = Router(d, n_experts, top_k, score_func, route_norm, route_scale, groups, limited, use_bias)
    with torch.no_grad():
        router.weight.normal_(0, std)
    return router


def make_moe(dtype=torch.float64, impl="sorted", seed=0, **changes) -> MoE:
    torch.manual_seed(seed)
    settings = dict(d_model=16, moe_hidden=24, n_routed_experts=6, n_shared_experts=1, top_k=2, moe_impl=impl)
    settings.update(changes)
    moe = MoE(**settings)
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.normal_(0, 0.3)
    return moe.to(dtype)


def test_sigmoid_normalized_weights_sum_to_route_scale_and_come_from_unbiased_scores():
    router = make_router(route_scale=1.398)
    x = torch.randn(100, 16)
    indices, weights, scores, _ = router(x)
    assert torch.allclose(weights.sum(-1), torch.full((100,), 1.398), rtol=0, atol=1e-6)
    selected = scores.gather(1, indices)
    assert torch.allclose(weights, selected / selected.sum(-1, keepdim=True) * 1.398, rtol=0, atol=1e-7)
    assert weights.dtype == torch.float32 and scores.dtype == torch.float32


def test_softmax_router_without_normalization_uses_the_softmax_probabilities():
    router = make_router(score_func="softmax", route_norm=False, route_scale=1.0)
    x = torch.randn(50, 16)
    indices, weights, _, _ = router(x)
    probabilities = torch.softmax(x @ router.weight.t(), dim=-1)  # over all experts, before top-k
    assert torch.allclose(weights, probabilities.gather(1, indices), rtol=0, atol=1e-7)
    assert torch.equal(indices, probabilities.topk(2, dim=-1).indices)


def test_router_runs_in_fp32_under_bf16_autocast():
    router = make_router()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, weights, scores, logits = router(torch.randn(10, 16))
    assert weights.dtype == scores.dtype == logits.dtype == torch.float32


@pytest.mark.parametrize("expert", [0, 3])
def test_bias_changes_selection_only(expert):
    router = make_router(route_scale=1.398)
    x = torch.randn(200, 16)
    router.expert_bias[expert] = 10.0
    indices, weights, scores, _ = router(x)
    assert (indices == expert).any(dim=1).all()  # chosen by every token
    chosen_slot = (indices == expert).float().argmax(dim=1, keepdim=True)
    selected = scores.gather(1, indices)
    expected = scores[:, expert] / selected.sum(-1) * 1.398  # weight from the unbiased score
    assert torch.allclose(weights.gather(1, chosen_slot).squeeze(1), expected, rtol=0, atol=1e-6)
    router.expert_bias[expert] = -10.0
    indices, _, _, _ = router(x)
    assert not (indices == expert).any()
    # The bias is a buffer: no gradient ever reaches it.
    assert "expert_bias" not in dict(router.named_parameters())


def test_group_limited_routing_keeps_the_best_groups_by_top2_sum():
    router = make_router(n_experts=8, top_k=2, groups=4, limited=2, use_bias=True)
    router.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    x = torch.randn(300, 16)
    indices, _, scores, _ = router(x)
    choice = (scores + router.expert_bias).view(300, 4, 2)
    group_score = choice.sum(-1)  # top-2 sum of a 2-expert group = its sum
    best_groups = group_score.topk(2, dim=-1).indices
    allowed = torch.zeros(300, 8, dtype=torch.bool)
    for slot in range(2):
        for member in range(2):
            allowed.scatter_(1, (best_groups[:, slot] * 2 + member)[:, None], True)
    assert allowed.gather(1, indices).all()
    # And it matters: without the limit some tokens would pick an expert outside those groups.
    unlimited = make_router(n_experts=8, top_k=2, use_bias=True)
    unlimited.expert_bias.copy_(router.expert_bias)
    unlimited_indices, _, _, _ = unlimited(x)
    assert not allowed.gather(1, unlimited_indices).all()


def test_default_route_scale_reproduces_the_spec_and_moonlight_values():
    assert abs(default_route_scale(4, 2) - 1.398) < 0.005
    assert abs(default_route_scale(8, 2) - 1.409) < 0.005
    assert abs(default_route_scale(16, 4) - 1.991) < 0.005
    assert abs(default_route_scale(64, 6) - 2.446) < 0.005  # Moonlight App. C
    assert make_moe(route_scale=0.0).gate.route_scale == default_route_scale(6, 2)
    assert make_moe(route_scale=0.0, score_func="softmax", route_norm=False).gate.route_scale == 1.0


def per_token_oracle(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """y_t = shared(x_t) + sum_k w_{t,k} FFN_{S_t[k]}(x_t), one token and one expert at a time."""
    indices, weights, _, _ = moe.gate(x)
    rows = []
    for t in range(x.shape[0]):
        y = moe.shared_experts(x[t : t + 1])[0]
        for k in range(indices.shape[1]):
            e = int(indices[t, k])
            hidden = torch.nn.functional.silu(moe.experts.w1[e] @ x[t]) * (moe.experts.w3[e] @ x[t])
            y = y + weights[t, k] * (moe.experts.w2[e] @ hidden)
        rows.append(y)
    return torch.stack(rows)


def outputs_and_grads(moe: MoE, x: torch.Tensor):
    x = x.clone().requires_grad_(True)
    moe.zero_grad()
    output, _ = moe(x)
    output.pow(2).sum().backward()
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    return output.detach(), x.grad.clone(), grads


def test_dense_reference_equals_the_per_token_oracle_in_fp64():
    moe = make_moe(impl="dense_ref")
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    output, _ = moe(x)
    assert torch.allclose(
        output.reshape(18, 16), per_token_oracle(moe, x.reshape(18, 16)), rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("impl", ["grouped", "sorted", "loop"])
def test_dispatch_equals_dense_reference_in_fp64(impl):
    x = torch.randn(3, 17, 16, dtype=torch.float64)
    reference = outputs_and_grads(make_moe(impl="dense_ref"), x)
    candidate = outputs_and_grads(make_moe(impl=impl), x)
    assert torch.allclose(candidate[0], reference[0], rtol=0, atol=1e-10)
    assert torch.allclose(candidate[1], reference[1], rtol=0, atol=1e-9)
    for name in reference[2]:  # expert weights (stacked), shared experts, router
        assert torch.allclose(candidate[2][name], reference[2][name], rtol=0, atol=1e-9), name
    assert reference[2]["gate.weight"].abs().max() > 0


@pytest.mark.parametrize("impl", ["grouped", "sorted", "loop"])
def test_dispatch_equals_dense_reference_in_fp32_within_1e_6_relative(impl):
    x = torch.randn(4, 32, 16)
    reference = outputs_and_grads(make_moe(torch.float32, impl="dense_ref"), x)
    candidate = outputs_and_grads(make_moe(torch.float32, impl=impl), x)
    for ours, theirs in [(candidate[0], reference[0]), (candidate[1], reference[1])] + [
            (candidate[2][name], reference[2][name]) for name in reference[2]]:
        assert (ours - theirs).abs().max() <= 1e-6 * theirs.abs().max()


@pytest.mark.parametrize("impl", ["grouped", "sorted"])
def test_unrouted_experts_get_zero_gradients_not_none(impl):
    moe = make_moe(impl=impl)
    moe.gate.expert_bias[5] = -10.0  # expert 5 is never chosen
    output, _ = moe(torch.randn(2, 8, 16, dtype=torch.float64))
    output.sum().backward()
    for name in ("w1", "w2", "w3"):
        grad = getattr(moe.experts, name).grad
        assert grad is not None and torch.equal(grad[5], torch.zeros_like(grad[5]))
        assert grad[:5].abs().sum() > 0


def test_z_loss_enters_the_auxiliary_loss_when_enabled():
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    without = make_moe(balance="none", z_loss_beta=0.0)
    with_z = make_moe(balance="none", z_loss_beta=1e-3)
    _, aux_without = without(x)
    _, aux_with = with_z(x)
    logits = x.reshape(16, 16) @ with_z.gate.weight.t()
    expected = 1e-3 * torch.logsumexp(logits, dim=-1).pow(2).mean()
    assert aux_without.item() == 0.0
    assert math.isclose(aux_with.item(), expected.item(), rel_tol=1e-12)


def outputs_and_grads_under(moe: MoE, x: torch.Tensor, autocast_dtype=None):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        output, aux = moe(x)
    (output.float().pow(2).sum() + aux).backward()
    return [output, x.grad] + [parameter.grad for parameter in moe.parameters()]


@pytest.mark.skipif(not moe_module.grouped_matmul_works(torch.device("cpu"), torch.float32),
                    reason="this torch has no CPU grouped_mm")
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16, torch.float16])
def test_grouped_dispatch_equals_sorted_bit_for_bit_where_the_blas_layout_allows(autocast_dtype):
    # Same layout, same per-segment matmuls: the outputs agree exactly. In fp32 the backward's weight and
    # input gradients go through differently transposed BLAS calls, so they agree to rounding only; under
    # autocast (both sides cast each matmul input once per use) every gradient is bit-identical too.
    x = torch.randn(3, 21, 16)
    sorted_result = outputs_and_grads_under(make_moe(torch.float32, impl="sorted"), x, autocast_dtype)
    grouped_result = outputs_and_grads_under(make_moe(torch.float32, impl="grouped"), x, autocast_dtype)
    assert torch.equal(grouped_result[0], sorted_result[0])
    for ours, theirs in zip(grouped_result[1:], sorted_result[1:]):
        if autocast_dtype is None:
            assert (ours - theirs).abs().max() <= 1e-6 * theirs.abs().max()
        else:
            assert torch.equal(ours, theirs)


def test_grouped_dispatch_runs_the_segment_loop_where_grouped_mm_does_not_work(monkeypatch):
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    expected = outputs_and_grads(make_moe(impl="sorted"), x)

    def must_not_run(*args, **kwargs):
        raise AssertionError("grouped_mm called although the probe said it does not work")

    monkeypatch.setattr(moe_module, "grouped_matmul_works", lambda device, dtype: False)
    monkeypatch.setattr(moe_module, "GROUPED_MM", must_not_run)
    result = outputs_and_grads(make_moe(impl="grouped"), x)
    assert torch.equal(result[0], expected[0]) and torch.equal(result[1], expected[1])
    assert all(torch.equal(result[2][name], expected[2][name]) for name in expected[2])


def test_grouped_matmul_probe_rejects_a_missing_or_wrong_kernel(monkeypatch):
    try:
        monkeypatch.setattr(moe_module, "GROUPED_MM", None)
        moe_module.grouped_matmul_works.cache_clear()
        assert not moe_module.grouped_matmul_works(torch.device("cpu"), torch.float32)

        def ignores_the_offsets(rows, stacked, offs):  # every row through the first expert: wrong
            return rows @ stacked[0]

        monkeypatch.setattr(moe_module, "GROUPED_MM", ignores_the_offsets)
        moe_module.grouped_matmul_works.cache_clear()
        assert not moe_module.grouped_matmul_works(torch.device("cpu"), torch.float32)

        def unsupported(rows, stacked, offs):
            raise RuntimeError("grouped gemm is only supported on CUDA with bf16")

        monkeypatch.setattr(moe_module, "GROUPED_MM", unsupported)
        moe_module.grouped_matmul_works.cache_clear()
        assert not moe_module.grouped_matmul_works(torch.device("cpu"), torch.float32)
    finally:
        # the real kernel is probed afresh after monkeypatch undoes
        moe_module.grouped_matmul_works.cache_clear()


def test_a_routing_kernel_that_cannot_be_built_warns_and_leaves_the_reference_routing(monkeypatch):
    import torch.utils.cpp_extension

    from pilotrun.model import cpu_kernels

    def no_compiler(*args, **kwargs):
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    cpu_kernels.cpu_kernels_loaded.cache_clear()
    try:
        with pytest.warns(UserWarning, match="could not be built .*No such file"):
            assert not cpu_kernels.cpu_kernels_loaded()
        moe = make_moe(cpu_kernels=True)
        x = torch.randn(2, 8, 16, dtype=torch.float64)
        assert not moe.route(x.reshape(16, 16), 2).fused
        output, _ = moe(x)
        assert torch.equal(output, make_moe(cpu_kernels=False)(x)[0])
    finally:
        cpu_kernels.cpu_kernels_loaded.cache_clear()  # the real build is loaded afresh after the test


def test_force_balanced_routing_gives_every_expert_the_same_load_and_scores_as_weights():
    moe = make_moe(torch.float32, impl="grouped", force_balanced_routing=True)
    moe.train()
    x = torch.randn(2, 12, 16)  # 24 tokens x top-2 = 48 slots over 6 experts: 8 each
    output, _ = moe(x)
    assert moe.tokens_per_expert.tolist() == [8.0] * 6
    routing = moe.route(x.reshape(24, 16), 2)
    assert not routing.fused  # the debug switch routes with the reference operators
    expected = torch.arange(48).view(24, 2) % 6
    assert torch.equal(routing.indices, expected)
    selected = torch.sigmoid(x.reshape(24, 16) @ moe.gate.weight.t()).gather(1, expected)
    assert torch.allclose(routing.weights, selected / selected.sum(-1, keepdim=True) * moe.gate.route_scale,
                          rtol=1e-6, atol=0)
    # The dispatch is the usual one: the oracle, fed the same forced choice, gives the same output.
    reference = moe.experts.forward_dense_reference(x.reshape(24, 16), routing.indices, routing.weights)
    assert torch.allclose(output.reshape(24, 16), reference + moe.shared_experts(x.reshape(24, 16)),
                          rtol=1e-5, atol=1e-6)


class MatmulShapes(TorchDispatchMode):
    """The (rows, inner, columns) of every non-empty matmul the CPU runs: mm/addmm/bmm as called, and
    grouped_mm as the one mm per group its CPU implementation runs (rows grouped forward and for the input
    gradient, the inner dimension grouped for the weight gradient). Empty products compute nothing and reach
    no BLAS."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def add(self, shape):
        if 0 not in shape:
            self.shapes.add(shape)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if "grouped_mm" in name:
            a, b, offsets = args[0], args[1], kwargs.get("offs", args[2] if len(args) > 2 else None)
            ends = [0, *offsets.tolist()]
            for start, end in zip(ends, ends[1:]):
                self.add((end - start, a.shape[1], b.shape[-1]) if b.dim() == 3
                         else (a.shape[0], end - start, b.shape[1]))
        elif name in ("mm", "addmm", "bmm"):
            first, second = args[-2], args[-1]
            self.add((*first.shape[:-1], first.shape[-1], second.shape[-1]))
        return func(*args, **kwargs)


def distinct_matmul_shapes_over_routings(impl: str, dtype: torch.dtype, routings: int = 40) -> int:
    """Forward and backward of one MoE layer under CPU autocast over `routings` inputs that route 128 tokens
    differently each time (a random skew toward some experts), counting the distinct matmul shapes."""
    moe = make_moe(torch.float32, impl=impl, cpu_kernels=False)
    # its one-off probe is not the layer's matmuls
    moe_module.grouped_matmul_works(torch.device("cpu"), dtype)
    generator = torch.Generator().manual_seed(1)
    counter = MatmulShapes()
    for _ in range(routings):
        skew = torch.randn(16, generator=generator) * torch.rand((), generator=generator) * 2
        x = torch.randn(2, 64, 16, generator=generator) + skew
        with counter:
            with torch.autocast("cpu", dtype=dtype):
                output, aux = moe(x)
            (output.float().pow(2).sum() + aux).backward()
    return len(counter.shapes)


@pytest.mark.parametrize("impl", ["grouped", "sorted", "loop"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_experts_issue_few_matmul_shapes_however_the_routing_varies(impl, dtype, monkeypatch):
    # Where the CPU multiplies bf16/fp16 with oneDNN, every new matmul shape builds and keeps a kernel: one
    # shape per segment length grew resident memory for tens of updates. With bucketed segments
    # (segment_buckets.py) the 40 routings of 128 tokens over 6 experts issue at most 16 row counts (8..128) x
    # 4 matmul shapes (d -> F, F -> d, and the two weight gradients'), plus the router's fixed ones (64 here);
    # exact segments issue 385.
    padded = distinct_matmul_shapes_over_routings(impl, dtype)
    assert padded <= 16 * 4 + 4
    monkeypatch.setattr(moe_module, "pads_segments", lambda device, compute_dtype: False)
    assert distinct_matmul_shapes_over_routings(impl, dtype) > 4 * padded  # what the bound catches


@pytest.mark.parametrize("impl", ["grouped", "sorted", "loop"])
def test_padded_low_precision_experts_are_deterministic_and_match_exact_segments_to_rounding(
    impl, monkeypatch
):
    x = torch.randn(2, 50, 16)
    first = outputs_and_grads_under(make_moe(torch.float32, impl=impl, cpu_kernels=False), x, torch.bfloat16)
    again = outputs_and_grads_under(make_moe(torch.float32, impl=impl, cpu_kernels=False), x, torch.bfloat16)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(first, again))  # bit for bit: resume-exact
    monkeypatch.setattr(moe_module, "pads_segments", lambda device, compute_dtype: False)
    exact = outputs_and_grads_under(make_moe(torch.float32, impl=impl, cpu_kernels=False), x, torch.bfloat16)
    # zero rows change no sum; a BLAS may block other lengths otherwise
    for ours, theirs in zip(first, exact):
        assert (ours.float() - theirs.float()).abs().max() <= 1e-2 * theirs.float().abs().max()


@pytest.mark.parametrize("impl", ["grouped", "sorted", "loop"])
def test_fp32_experts_never_pad(impl, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("fp32 experts padded")

    x = torch.randn(2, 21, 16)
    expected = outputs_and_grads_under(make_moe(torch.float32, impl=impl, cpu_kernels=False), x)
    monkeypatch.setattr(moe_module, "PaddedSegments", must_not_run)
    monkeypatch.setattr(moe_module, "bucket_rows", must_not_run)
    result = outputs_and_grads_under(make_moe(torch.float32, impl=impl, cpu_kernels=False), x)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(result, expected))
