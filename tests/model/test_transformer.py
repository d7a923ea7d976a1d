"""The decoder end to end: names and shapes, causality, determinism, loss composition, precision."""

import dataclasses

import pytest
import torch
import torch.utils.checkpoint

from pilotrun.config import ModelConfig
from pilotrun.model.transformer import build_model, compile_blocks_and_output

TINY = ModelConfig(vocab_size=256)  # the tiny preset: d 64, 2 layers (1 dense), 4 heads, E 4 / shared 1 / K 2


def tiny(**changes) -> ModelConfig:
    return dataclasses.replace(TINY, **changes)


def batch(vocab: int = 256, b: int = 4, t: int = 32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, t + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, written out independently of the model code."""
    d, h = cfg.d_model, cfg.n_heads
    d_qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    shapes = {"embed.weight": (cfg.vocab_size, d), "norm.weight": (d,), "head.weight": (cfg.vocab_size, d)}
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        shapes[p + "attn_norm.weight"] = (d,)
        shapes[p + "ffn_norm.weight"] = (d,)
        if cfg.q_lora_rank == 0:
            shapes[p + "attn.wq.weight"] = (h * d_qk, d)
        else:
            shapes[p + "attn.wq_a.weight"] = (cfg.q_lora_rank, d)
            shapes[p + "attn.q_norm.weight"] = (cfg.q_lora_rank,)
            shapes[p + "attn.wq_b.weight"] = (h * d_qk, cfg.q_lora_rank)
        shapes[p + "attn.wkv_a.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d)
        shapes[p + "attn.kv_norm.weight"] = (cfg.kv_lora_rank,)
        shapes[p + "attn.wkv_b.weight"] = (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        shapes[p + "attn.wo.weight"] = (d, h * cfg.v_head_dim)
        if layer < cfg.n_dense_layers:
            shapes[p + "ffn.w1.weight"] = (cfg.dense_hidden, d)
            shapes[p + "ffn.w2.weight"] = (d, cfg.dense_hidden)
            shapes[p + "ffn.w3.weight"] = (cfg.dense_hidden, d)
        else:
            e, f, s = cfg.n_routed_experts, cfg.moe_hidden, cfg.n_shared_experts * cfg.moe_hidden
            shapes[p + "ffn.gate.weight"] = (e, d)
            shapes[p + "ffn.experts.w1"] = (e, f, d)
            shapes[p + "ffn.experts.w2"] = (e, d, f)
            shapes[p + "ffn.experts.w3"] = (e, f, d)
            shapes[p + "ffn.shared_experts.w1.weight"] = (s, d)
            shapes[p + "ffn.shared_experts.w2.weight"] = (d, s)
            shapes[p + "ffn.shared_experts.w3.weight"] = (s, d)
    return shapes


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_parameter_names_and_shapes_follow_the_spec_table(q_lora_rank):
    cfg = tiny(q_lora_rank=q_lora_rank)
    model = build_model(cfg)
    actual = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert actual == expected_shapes(cfg)
    state = model.state_dict()
    assert state["layers.1.ffn.gate.expert_bias"].dtype == torch.float32
    assert "layers.1.ffn.gate.expert_bias" not in actual  # a buffer, never a parameter
    # Per-step counters and the RoPE table are not part of a checkpoint.
    assert not any(key.endswith(("tokens_per_expert", "qk_max_logit", "rope_cos")) for key in state)


def test_initialization_follows_decision_d7():
    torch.manual_seed(0)
    model = build_model(tiny(d_model=128, dense_hidden=512, vocab_size=512))
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(parameter, torch.ones_like(parameter)), name
        else:
            standard_error = 0.006 / parameter.numel() ** 0.5  # of the sample mean; 5 sigma bounds below
            assert abs(parameter.std().item() - 0.006) < 5 * standard_error, name
            assert abs(parameter.mean().item()) < 5 * standard_error, name
    assert torch.equal(model.layers[1].ffn.gate.expert_bias, torch.zeros(4))


def test_build_and_forward_are_bit_identical_for_the_same_seed():
    inputs, targets = batch()
    results = []
    for _ in range(2):
        torch.manual_seed(123)
        model = build_model(TINY)
        output = model(inputs, targets)
        output.loss.backward()
        results.append((output.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1].keys() == results[1][1].keys()
    for name in results[0][1]:
        assert torch.equal(results[0][1][name], results[1][1][name]), name
    torch.manual_seed(124)
    other = build_model(TINY)
    assert not torch.equal(other.embed.weight, build_model_with_seed(123).embed.weight)


def build_model_with_seed(seed: int):
    torch.manual_seed(seed)
    return build_model(TINY)


def logits_before_and_after_changing_later_tokens(cfg: ModelConfig, cut: int = 11):
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    inputs, _ = batch(b=2, t=24)
    changed = inputs.clone()
    changed[:, cut + 1:] = (changed[:, cut + 1:] + 17) % 256
    with torch.no_grad():
        before = model(inputs).logits
        after = model(changed).logits
    assert not torch.allclose(before[:, cut + 1:], after[:, cut + 1:])  # the change did reach later positions
    return before[:, : cut + 1], after[:, : cut + 1]


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("n_dense_layers", [1, 2])
def test_changing_later_tokens_leaves_earlier_logits_bit_identical(attn_impl, n_dense_layers):
    # dense_ref runs every expert on every token, so each token's arithmetic is independent of the others.
    before, after = logits_before_and_after_changing_later_tokens(
        tiny(attn_impl=attn_impl, moe_impl="dense_ref", n_dense_layers=n_dense_layers, init_std=0.05))
    assert torch.equal(before, after)


@pytest.mark.parametrize("moe_impl", ["grouped", "sorted", "loop"])
def test_routed_dispatch_is_causal_up_to_matmul_blocking(moe_impl):
    # With routed dispatch an earlier token's expert runs in a segment whose row count depends on which later
    # tokens chose the same expert; the CPU BLAS takes a different kernel for 1-2 rows than for more, so the
    # last bits may differ (measured: 2.7e-7 on these logits). Information still never flows backwards.
    before, after = logits_before_and_after_changing_later_tokens(tiny(moe_impl=moe_impl, init_std=0.05))
    assert torch.allclose(before, after, rtol=0, atol=1e-6)


def test_loss_is_cross_entropy_plus_aux_and_aux_follows_the_mode():
    torch.manual_seed(0)
    inputs, targets = batch()
    model = build_model(tiny(balance="aux_free+seq", seq_aux_alpha=0.5))
    output = model(inputs, targets)
    reference = torch.nn.functional.cross_entropy(output.logits.reshape(-1, 256), targets.reshape(-1))
    assert output.ce_loss.item() == reference.item()
    assert output.aux_loss.item() > 0.4  # alpha * (sum f P ~ 1)
    assert output.loss.item() == (output.ce_loss + output.aux_loss).item()
    model_off = build_model(tiny(balance="aux_free"))
    assert model_off(inputs, targets).aux_loss.item() == 0.0
    no_targets = model(inputs)
    assert no_targets.loss is None and no_targets.ce_loss is None


@pytest.mark.parametrize("cpu_kernels", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_runs_and_stays_close_to_fp32_at_init(dtype, cpu_kernels):
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(TINY, cpu_kernels=cpu_kernels))
    inputs, targets = batch()
    fp32_loss = model(inputs, targets).ce_loss.item()
    captured = {}
    moe = model.layers[1].ffn
    route = moe.route

    def recording_route(*args):
        captured["routing"] = route(*args)
        return captured["routing"]

    moe.route = recording_route
    with torch.autocast("cpu", dtype=dtype):
        output = model(inputs, targets)
    del moe.route
    output.loss.backward()
    assert output.logits.dtype == dtype  # the matmuls ran in the autocast dtype
    assert output.ce_loss.dtype == torch.float32 and output.aux_loss.dtype == torch.float32
    routing = captured["routing"]
    assert routing.fused == cpu_kernels
    assert all(t.dtype == torch.float32 for t in (routing.weights, routing.logits, routing.balance_value))
    assert abs(output.ce_loss.item() - fp32_loss) < 2e-2
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
               for p in model.parameters())
    assert model.layers[0].attn.qk_max_logit.dtype == torch.float32


def test_sequence_longer_than_the_rope_table_is_refused():
    model = build_model(tiny(max_seq_len=16))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.slow
@pytest.mark.parametrize("moe_impl", ["sorted", "grouped"])
def test_torch_compile_traces_the_model_and_matches_eager_bit_for_bit(moe_impl):
    # backend="eager" runs Dynamo's tracing (graph capture, guards, graph breaks) without code generation, so
    # the test checks that the model is compilable and that compiled training forwards still count, in seconds
    # rather than the minutes inductor's C++ build takes on 2 cores. Traced in fp32, `grouped` runs the sorted
    # segment loop (grouped_mm traces in bf16 only): same forward bit for bit, fp32 gradients to rounding.
    # Without the CPU kernels (with them the MoE layers run eagerly: the next test), so that the MoE is
    # traced.
    import torch._dynamo

    inputs, targets = batch(b=2, t=16)
    cfg = dataclasses.replace(TINY, moe_impl=moe_impl, cpu_kernels=False)
    torch.manual_seed(0)
    eager_model = build_model(cfg)
    torch.manual_seed(0)
    compiled_model = build_model(cfg)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, backend="eager")
    eager_output = eager_model(inputs, targets)
    compiled_output = compiled(inputs, targets)
    eager_output.loss.backward()
    compiled_output.loss.backward()
    assert torch.equal(eager_output.logits, compiled_output.logits)
    for (name, p), (_, q) in zip(eager_model.named_parameters(), compiled_model.named_parameters()):
        if moe_impl == "grouped":  # rounding reaches every gradient upstream of the first MoE layer
            assert (p.grad - q.grad).abs().max() <= 1e-6 * p.grad.abs().max(), name
        else:
            assert torch.equal(p.grad, q.grad), name
    assert torch.equal(
        eager_model.layers[1].ffn.tokens_per_expert, compiled_model.layers[1].ffn.tokens_per_expert
    )
    assert torch.equal(eager_model.layers[0].attn.qk_max_logit, compiled_model.layers[0].attn.qk_max_logit)
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_model_keeps_the_cpu_kernels_bit_for_bit(monkeypatch):
    # Under torch.compile the MoE layers run eagerly with their kernels (the rest is traced): with the
    # tracing-only backend the compiled model computes exactly what the eager one does, kernels included.
    import torch._dynamo

    from pilotrun.model import cpu_kernels

    if not cpu_kernels.cpu_kernels_loaded():
        pytest.skip("the CPU kernels cannot be built on this machine (no compiler)")
    calls = []
    kernel = cpu_kernels.FusedExperts.apply
    monkeypatch.setattr(
        cpu_kernels.FusedExperts, "apply", staticmethod(lambda *a: calls.append(1) or kernel(*a))
    )
    inputs, targets = batch(b=2, t=16)
    cfg = dataclasses.replace(TINY, moe_impl="grouped", cpu_kernels=True)
    models = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg)
        torch._dynamo.reset()
        output = (torch.compile(model, backend="eager") if compiled else model)(inputs, targets)
        output.loss.backward()
        models.append((model, output))
    (eager_model, eager_output), (compiled_model, compiled_output) = models
    moe_layers = len(eager_model.moe_layers())
    assert len(calls) == 2 * moe_layers  # the experts kernel ran in every MoE layer, compiled or not
    assert torch.equal(eager_output.logits, compiled_output.logits)
    assert torch.equal(eager_output.loss, compiled_output.loss)
    for (name, p), (_, q) in zip(eager_model.named_parameters(), compiled_model.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    for eager_moe, compiled_moe in zip(eager_model.moe_layers(), compiled_model.moe_layers()):
        assert torch.equal(eager_moe.tokens_per_expert, compiled_moe.tokens_per_expert)
        assert torch.equal(eager_moe.router_statistics, compiled_moe.router_statistics)
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiling_blocks_and_output_traces_the_loss_and_keeps_the_step_bit_for_bit():
    # train.compile's compile_blocks_and_output compiles each block and the final norm, head and cross-entropy
    # as one more graph. A recording tracing-only backend (no code generation, so the same arithmetic as
    # eager) sees which graphs Dynamo captured: one of them must hold the cross-entropy, or the loss was left
    # eager. Without the CPU kernels, so that the whole step is traced and comparable bit for bit.
    import torch._dynamo

    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    inputs, targets = batch(b=2, t=16)
    cfg = dataclasses.replace(TINY, moe_impl="sorted", cpu_kernels=False)
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg)
        if compiled:
            compile_blocks_and_output(model, recording_backend)
        output = model(inputs, targets)
        output.loss.backward()
        runs.append((model, output, model(inputs).logits))
    (eager_model, eager_output, eager_logits), (compiled_model, compiled_output, compiled_logits) = runs
    assert any("cross_entropy" in graph for graph in graphs)
    assert torch.equal(eager_output.logits, compiled_output.logits)
    assert torch.equal(eager_output.ce_loss, compiled_output.ce_loss)
    assert torch.equal(eager_output.loss, compiled_output.loss)
    assert torch.equal(eager_logits, compiled_logits) and compiled_model(inputs).ce_loss is None
    for (name, p), (_, q) in zip(eager_model.named_parameters(), compiled_model.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    torch._dynamo.reset()


def run_and_collect(model, tokens, targets, microbatches: int = 2):
    """Two microbatches of forward + backward, as the trainer accumulates them: the losses, every gradient,
    and the per-step statistics the forwards recorded (expert counts, router sums, max attention logits)."""
    model.train()
    model.zero_grad(set_to_none=True)
    saved_bytes = []

    def pack(tensor):
        saved_bytes.append(tensor.untyped_storage().nbytes())
        return tensor

    losses = []
    for index in range(microbatches):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = model((tokens + index) % model.cfg.vocab_size, targets)
        output.loss.backward()
        losses.append(output.loss.detach())
    grads = {name: parameter.grad for name, parameter in model.named_parameters()}
    statistics = [buffer.clone() for moe in model.moe_layers()
                  for buffer in (moe.tokens_per_expert, moe.router_statistics, moe.router_logit_absmax)]
    statistics += [attention.qk_max_logit.clone() for attention in model.attention_layers()]
    statistics += [buffer.clone() for block in model.layers for buffer in (block.output_square_sum,
                                                                            block.output_elements)]
    return losses, grads, statistics, sum(saved_bytes)


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("cpu_kernels", [True, False])
@pytest.mark.parametrize("early_stop", [True, False])
def test_activation_checkpointing_gives_the_same_step_bit_for_bit_and_counts_once(attn_impl, cpu_kernels,
                                                                                 early_stop):
    # early_stop False: torch recomputes each block's whole forward, statistics included (by default it stops
    # once the saved tensors backward needs are back, which happens to come before the MoE's counting).
    tokens, targets = batch(t=24)
    results = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        model = build_model(
            tiny(activation_checkpointing=recompute, attn_impl=attn_impl, cpu_kernels=cpu_kernels, n_layers=3)
        )
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            results[recompute] = run_and_collect(model, tokens, targets)
    plain, recomputed = results[False], results[True]
    assert all(torch.equal(a, b) for a, b in zip(plain[0], recomputed[0], strict=True))
    for name, grad in plain[1].items():
        assert torch.equal(recomputed[1][name], grad), name
    # The recomputed forwards ran (backward needed them) but did not count: the statistics equal a plain
    # step's.
    for ours, theirs in zip(recomputed[2], plain[2], strict=True):
        assert torch.equal(ours, theirs)
    # two microbatches of 4 x 24 tokens, top-2: counted once
    assert plain[2][0].sum() == 2 * 4 * 24 * TINY.top_k
    # And it is checkpointing: autograd keeps far fewer bytes for backward.
    assert recomputed[3] < 0.5 * plain[3], (recomputed[3], plain[3])


def test_activation_checkpointing_is_off_in_eval_and_without_grad():
    torch.manual_seed(0)
    model = build_model(tiny(activation_checkpointing=True))
    tokens, targets = batch()
    calls = []
    import pilotrun.model.transformer as transformer_module

    original = transformer_module.checkpointed_call
    transformer_module.checkpointed_call = lambda *args: calls.append(1) or original(*args)
    try:
        model.eval()
        model(tokens, targets)
        model.train()
        with torch.no_grad():
            model(tokens, targets)
        assert calls == []
        model(tokens, targets).loss.backward()
        assert len(calls) == TINY.n_layers
    finally:
        transformer_module.checkpointed_call = original
