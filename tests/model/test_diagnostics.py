"""Per-step statistics: counted only in training forwards, summed over microbatches, reset on demand."""

import json
import math

import pytest
import torch

from pilotrun.config import ModelConfig
from pilotrun.model.diagnostics import (
    attention_diagnostics,
    block_output_rms,
    collect_step_statistics,
    expert_load_figures,
    moe_diagnostics,
    reset_step_statistics,
)
from pilotrun.model.moe import count_per_expert
from pilotrun.model.transformer import build_model

CFG = ModelConfig(vocab_size=256, n_layers=3, n_dense_layers=1)


def tokens(seed: int, b: int = 4, t: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def test_counters_only_in_training_mode_and_sum_over_microbatches():
    torch.manual_seed(0)
    model = build_model(CFG)
    counts, logits = collect_step_statistics(model)
    assert counts.shape == (2, 4) and torch.equal(counts, torch.zeros(2, 4))
    assert logits.shape == (3, 4) and torch.isinf(logits).all() and (logits < 0).all()

    model.eval()
    with torch.no_grad():
        model(tokens(1))
    counts, logits = collect_step_statistics(model)
    assert torch.equal(counts, torch.zeros(2, 4)) and torch.isinf(logits).all()

    model.train()
    per_batch = []
    for seed in (1, 2, 3):
        reset_step_statistics(model)
        model(tokens(seed))
        per_batch.append(collect_step_statistics(model))
    reset_step_statistics(model)
    for seed in (1, 2, 3):
        model(tokens(seed))
    counts, logits = collect_step_statistics(model)
    assert torch.equal(counts, per_batch[0][0] + per_batch[1][0] + per_batch[2][0])
    assert torch.equal(
        logits, torch.maximum(torch.maximum(per_batch[0][1], per_batch[1][1]), per_batch[2][1])
    )
    assert torch.equal(counts.sum(dim=1), torch.full((2,), 3 * 4 * 32 * 2.0))  # N tokens x K per layer

    # The counts equal an independent recomputation of the (biased) top-k selection of layer 1's router.
    moe = model.moe_layers()[0]
    captured = {}
    handle = moe.register_forward_pre_hook(lambda module, args: captured.setdefault("x", args[0].detach()))
    reset_step_statistics(model)
    model(tokens(5))
    handle.remove()
    x = captured["x"].reshape(-1, CFG.d_model)
    chosen = (torch.sigmoid(x @ moe.gate.weight.t()) + moe.gate.expert_bias).topk(2, dim=-1).indices
    assert torch.equal(
        collect_step_statistics(model)[0][0], torch.bincount(chosen.reshape(-1), minlength=4).float()
    )

    # collect returns copies: later forwards do not change what was collected.
    snapshot = collect_step_statistics(model)[0]
    frozen = snapshot.clone()
    model(tokens(6))
    assert torch.equal(snapshot, frozen)


def test_load_figures_match_their_definitions():
    figures = expert_load_figures(torch.tensor([6.0, 2.0, 0.0, 0.0]))
    assert figures["imbalance"] == 3.0 and figures["maxvio"] == 2.0 and figures["minvio"] == 1.0
    assert figures["dead"] == 2
    assert math.isclose(
        figures["load_entropy"], -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(4)
    )
    balanced = expert_load_figures(torch.full((4,), 5.0))
    assert (
        balanced["imbalance"] == 1.0 and balanced["cv"] == 0.0 and math.isclose(balanced["load_entropy"], 1.0)
    )
    assert balanced["would_drop_cf1"] == 0.0 and balanced["would_drop_cf1_25"] == 0.0
    # counts 10, 2, 4, 0: mean 4; capacity 4 drops 6 of 16 slots, capacity ceil(1.25 * 4) = 5 drops 5
    skewed = expert_load_figures(torch.tensor([10.0, 2.0, 4.0, 0.0]))
    assert skewed["would_drop_cf1"] == 6 / 16 and skewed["would_drop_cf1_25"] == 5 / 16


def test_block_output_rms_is_the_rms_of_each_blocks_output_over_the_microbatches():
    torch.manual_seed(0)
    model = build_model(CFG)
    outputs: dict[int, list[torch.Tensor]] = {}
    for index, block in enumerate(model.layers):
        block.register_forward_hook(lambda module, args, output, index=index:
                                    outputs.setdefault(index, []).append(output[0].detach().double()))
    assert block_output_rms(model) == [None] * CFG.n_layers  # nothing ran yet
    model.eval()
    model(tokens(0))
    assert block_output_rms(model) == [None] * CFG.n_layers  # evaluation forwards do not count
    outputs.clear()
    model.train()
    model(tokens(1))
    model(tokens(2, b=2))  # a second microbatch of another size: the RMS is over all elements
    for index, figure in enumerate(block_output_rms(model)):
        everything = torch.cat([o.flatten() for o in outputs[index]])
        assert figure == pytest.approx(float(everything.square().mean().sqrt()), rel=1e-12)
    reset_step_statistics(model)
    assert block_output_rms(model) == [None] * CFG.n_layers


def test_diagnostics_are_json_ready_and_reflect_the_bias():
    torch.manual_seed(0)
    model = build_model(CFG)
    model(tokens(1))
    counts, logits = collect_step_statistics(model)
    model.moe_layers()[1].gate.expert_bias.copy_(torch.tensor([0.5, -0.25, -0.25, 0.0]))
    moe = moe_diagnostics(model, counts)
    attention = attention_diagnostics(logits)
    json.dumps(moe, allow_nan=False)
    json.dumps(attention, allow_nan=False)
    assert moe["tokens_per_expert"] == counts.tolist()
    assert moe["bias_abs_max"] == 0.5 and moe["bias_min"] == [0.0, -0.25]
    assert moe["max_imbalance"] == max(moe["imbalance"]) >= 1.0
    assert all(0.9 < value <= 1.0 for value in moe["router_entropy"])  # near-uniform router at init
    assert attention["max_logit"] == [max(row) for row in logits.tolist()]
    reset_step_statistics(model)
    assert attention_diagnostics(collect_step_statistics(model)[1])["max_logit"] == [None, None, None]


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_router_figures_equal_their_definitions_over_two_microbatches(cpu_kernels):
    # The fused CPU kernel and the reference operators sum the statistics each their own way; both must equal
    # the definitions, recomputed here from the MoE layer's inputs through the reference router.
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=256, bias_update_speed=1e-3, cpu_kernels=cpu_kernels))
    moe = model.moe_layers()[0]
    bias = torch.tensor([0.004, -0.004, 0.002, 0.0])  # about the score spread at init: it moves some tokens
    moe.gate.expert_bias.copy_(bias)
    inputs = []
    handle = moe.register_forward_pre_hook(
        lambda module, args: inputs.append(args[0].detach().reshape(-1, 64))
    )
    for seed in (1, 2):
        model(tokens(seed))
    handle.remove()
    counts, _ = collect_step_statistics(model)
    figures = moe_diagnostics(model, counts)
    with torch.no_grad():
        captured = [moe.gate(flat) for flat in inputs]
    indices = torch.cat([c[0] for c in captured])
    assert torch.equal(counts[0], count_per_expert(indices, 4).float())
    scores = torch.cat([c[2] for c in captured]).double()
    logits = torch.cat([c[3] for c in captured]).double()
    normalized = scores / scores.sum(-1, keepdim=True)
    entropy = -(normalized * normalized.log()).sum(-1).mean() / math.log(4)
    spread = scores.std(-1, unbiased=False).mean()
    assert math.isclose(figures["router_entropy"][0], entropy.item(), rel_tol=1e-5)
    assert math.isclose(figures["score_spread"][0], spread.item(), rel_tol=1e-5)
    assert math.isclose(figures["speed_to_spread"][0], 1e-3 / spread.item(), rel_tol=1e-5)
    assert math.isclose(
        figures["topk_mass"][0], scores.gather(1, indices).sum(-1).mean().item(), rel_tol=1e-5
    )
    assert math.isclose(figures["router_logit_absmax"][0], logits.abs().max().item(), rel_tol=1e-6)
    best = (scores + bias.double()).topk(3, dim=-1).values  # top_k 2 of 4 experts: the 2nd against the 3rd
    assert math.isclose(figures["route_margin"][0], (best[:, 1] - best[:, 2]).mean().item(), rel_tol=1e-5)
    flipped = (
        (scores.topk(2, dim=-1).indices.sort(-1).values != indices.sort(-1).values).any(-1).double().mean()
    )
    assert 0 < flipped.item() < 1 and math.isclose(figures["bias_flip_rate"][0], flipped.item(), rel_tol=1e-9)
    assert 0.9 < figures["balance_term"][0] < 1.2


def test_a_model_without_moe_layers_reports_empty_statistics():
    from pilotrun.model.balancing import update_expert_bias

    model = build_model(ModelConfig(vocab_size=256, n_layers=2, n_dense_layers=2))
    model(tokens(1))
    counts, logits = collect_step_statistics(model)
    assert counts.shape == (0, 4) and logits.shape == (2, 4) and torch.isfinite(logits).all()
    figures = moe_diagnostics(model, counts)
    assert figures["imbalance"] == [] and figures["max_imbalance"] is None and figures["dead_experts"] == 0
    json.dumps(figures, allow_nan=False)
    update_expert_bias(model, counts, 1e-3)  # nothing to update, and no error
