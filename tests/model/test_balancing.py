"""Load balancing: the centered sign rule, the aux-free control loop on a toy
router (including the gamma-vs-score-spread regression), and the sequence-wise auxiliary loss."""

import statistics

import pytest
import torch

from pilotrun.config import ModelConfig
from pilotrun.model.balancing import balance_loss_terms, bias_update_delta, update_expert_bias
from pilotrun.model.diagnostics import collect_step_statistics, reset_step_statistics
from pilotrun.model.moe import Router
from pilotrun.model.transformer import build_model


def test_sign_rule_is_centered_and_lowers_overloaded_experts():
    counts = torch.tensor([10.0, 30.0, 20.0, 20.0])  # mean 20
    delta = bias_update_delta(counts, 0.01)
    raw = torch.tensor([0.01, -0.01, 0.0, 0.0])  # gamma * sign(mean - c)
    assert torch.allclose(delta, raw - raw.mean(), rtol=0, atol=1e-9)
    assert abs(float(delta.sum())) < 1e-9
    assert delta[1] < 0 < delta[0]
    # Per-layer rows are handled independently.
    both = bias_update_delta(torch.stack([counts, counts.flip(0)]), 0.01)
    assert torch.equal(both[0], delta) and torch.equal(both[1], bias_update_delta(counts.flip(0), 0.01))


def test_update_expert_bias_touches_only_layers_that_use_the_bias():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, n_layers=3, n_dense_layers=1, balance="aux_free+seq"))
    counts = torch.tensor([[5.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 5.0]])
    update_expert_bias(model, counts, 1e-3)
    biases = [moe.gate.expert_bias.clone() for moe in model.moe_layers()]
    assert torch.equal(biases[0], bias_update_delta(counts[0], 1e-3))
    assert torch.equal(biases[1], bias_update_delta(counts[1], 1e-3))
    with pytest.raises(ValueError, match="MoE layers"):
        update_expert_bias(model, counts[:1], 1e-3)
    seq_only = build_model(ModelConfig(vocab_size=64, balance="seq"))
    update_expert_bias(seq_only, counts[:1], 1e-3)
    assert torch.equal(seq_only.moe_layers()[0].gate.expert_bias, torch.zeros(4))


def test_counts_over_three_microbatches_equal_one_concatenated_batch():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64))
    tokens = torch.randint(0, 64, (6, 16), generator=torch.Generator().manual_seed(3))
    for part in tokens.split(2):
        model(part)
    accumulated = collect_step_statistics(model)[0]
    reset_step_statistics(model)
    model(tokens)
    assert torch.equal(accumulated, collect_step_statistics(model)[0])


def control_loop(
    router_std: float, speed: float, steps: int = 300, tokens: int = 4096, seed: int = 0
) -> tuple[list[float], float]:
    """Spec test 10: a standalone router (E=8, K=2, d=64) with frozen random weights, fresh random inputs each
    step and a fixed +2 added to expert 0's logit (through a constant 65th input feature). Each step routes,
    counts and applies the library's bias update. Returns the per-step MaxVio and the final b_0."""
    torch.manual_seed(seed)
    router = Router(65, 8, 2, "sigmoid", True, 1.4, 1, 1, use_bias=True)
    with torch.no_grad():
        router.weight.normal_(0, router_std)
        router.weight[:, 64] = 0.0
        router.weight[0, 64] = 2.0
    generator = torch.Generator().manual_seed(seed + 1)
    max_violations = []
    for _ in range(steps):
        x = torch.randn(tokens, 65, generator=generator)
        x[:, 64] = 1.0
        with torch.no_grad():
            indices = router(x)[0]
        counts = torch.bincount(indices.reshape(-1), minlength=8).float()
        max_violations.append(float(counts.max() / counts.mean() - 1))
        router.expert_bias += bias_update_delta(counts, speed)
    return max_violations, float(router.expert_bias[0])


def test_bias_control_loop_removes_a_strong_preference():
    without, _ = control_loop(0.1, 0.0, steps=20)
    assert min(without) > 2.5  # expert 0 takes nearly every token (MaxVio ~ 2.75)
    with_bias, bias_0 = control_loop(0.1, 1e-2)
    assert statistics.mean(with_bias[200:]) < 0.15
    assert bias_0 < 0


@pytest.mark.slow
def test_default_speed_converges_where_a_large_speed_oscillates_on_a_narrow_score_spread():
    # Router std 0.006 (the init) gives a score spread ~0.01 across experts: gamma = 1e-2 overshoots every
    # step and the load oscillates; the default gamma = 1e-3 settles.
    large, _ = control_loop(0.006, 1e-2)
    default, _ = control_loop(0.006, ModelConfig().bias_update_speed)
    assert statistics.mean(large[200:]) > 1.0
    assert statistics.mean(default[200:]) < 0.2
    assert max(default[250:]) < 0.4


def test_sequence_balance_term_invariants():
    generator = torch.Generator().manual_seed(0)
    experts, top_k, seq = 8, 2, 16
    scores = torch.sigmoid(torch.randn(3, seq, experts, generator=generator))
    # Perfectly balanced selection: each expert chosen by exactly K*T/E tokens of every sequence -> 1.
    balanced = torch.stack([torch.tensor([(2 * t) % experts, (2 * t + 1) % experts]) for t in range(seq)])
    term = balance_loss_terms(scores, balanced.expand(3, -1, -1), experts, top_k, "sigmoid")
    assert torch.allclose(term, torch.ones(3), rtol=0, atol=1e-6)
    # Collapse onto experts 0 and 1 with all normalized score mass on them -> E / K.
    concentrated = torch.zeros(3, seq, experts)
    concentrated[..., :2] = 0.5
    collapsed = torch.tensor([0, 1]).expand(3, seq, 2)
    term = balance_loss_terms(concentrated, collapsed, experts, top_k, "sigmoid")
    assert torch.allclose(term, torch.full((3,), experts / top_k), rtol=0, atol=1e-6)


def test_sequence_aux_loss_reaches_the_router_and_upstream_but_not_the_experts():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, balance="seq", seq_aux_alpha=1e-2))
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    output = model(tokens, tokens)
    output.aux_loss.backward()  # the LM loss excluded
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert grads["layers.1.ffn.gate.weight"].abs().sum() > 0
    assert grads["layers.0.attn.wq.weight"].abs().sum() > 0  # through u_t into earlier layers
    for name in (
        "layers.1.ffn.experts.w1",
        "layers.1.ffn.experts.w2",
        "layers.1.ffn.shared_experts.w1.weight",
        "layers.1.ffn.shared_experts.w2.weight",
        "head.weight",
    ):
        assert grads[name] is None or torch.equal(grads[name], torch.zeros_like(grads[name])), name
