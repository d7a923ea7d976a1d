"""Parameter counts against the built model and the spec's table; FLOPs against torch's own counter."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pilotrun.model.accounting import count_parameters, flops_per_token
from pilotrun.model.presets import model_preset
from pilotrun.model.transformer import build_model

# the presets' documented sizes: (geometry, vocab, q_lora_rank, total, active), both in millions
PRESET_SIZES = [
    ("tiny", 256, 0, 0.17, 0.14),
    ("cpu", 512, 64, 1.86, 0.98),  # the spec's tiny-smoke geometry
    ("gpu-100m", 32768, 0, 104.7, 55.1),
]


def active_parameters_from_the_model(model) -> int:
    """Every parameter, except the routed-expert slices a token does not use (E - K of E)."""
    total = 0
    for name, parameter in model.named_parameters():
        if ".experts." in name:
            moe = model.layers[int(name.split(".")[1])].ffn
            total += parameter.numel() * moe.top_k // moe.n_routed_experts
        else:
            total += parameter.numel()
    return total


@pytest.mark.parametrize("preset,q_lora_rank", [("tiny", 0), ("tiny", 16), ("cpu", 64), ("cpu", 0)])
def test_counts_equal_the_built_models_tensors(preset, q_lora_rank):
    cfg = model_preset(preset, vocab_size=300, q_lora_rank=q_lora_rank)
    model = build_model(cfg)
    total, active = count_parameters(cfg)
    assert total == sum(p.numel() for p in model.parameters())
    assert active == active_parameters_from_the_model(model)


@pytest.mark.parametrize("preset,vocab,q_lora_rank,total_m,active_m", PRESET_SIZES)
def test_counts_match_the_spec_table(preset, vocab, q_lora_rank, total_m, active_m):
    total, active = count_parameters(model_preset(preset, vocab_size=vocab, q_lora_rank=q_lora_rank))
    assert abs(total / 1e6 - total_m) <= 0.005 * total_m + 0.005  # table values are rounded to 0.01M / 0.1M
    assert abs(active / 1e6 - active_m) <= 0.005 * active_m + 0.005


def test_gpu_100m_non_embedding_and_gpt2_vocab_figures_from_the_spec():
    total, active = count_parameters(model_preset("gpu-100m", vocab_size=32768))
    # "71.1M non-embedding": total less embed and head
    assert abs((total - 2 * 32768 * 512) / 1e6 - 71.1) < 0.1
    total_gpt2, _ = count_parameters(model_preset("gpu-100m", vocab_size=50257))
    assert abs(total_gpt2 / 1e6 - 122.6) < 0.1


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_flops_per_token_equals_torchs_flop_counter_for_a_training_step(q_lora_rank):
    # Eager attention computes the full T x T products (the mask is applied after), so the non-causal count is
    # what a FLOP counter sees; sorted dispatch runs exactly K routed experts per token.
    cfg = model_preset("tiny", vocab_size=256, q_lora_rank=q_lora_rank, attn_impl="eager", moe_impl="sorted")
    torch.manual_seed(0)
    model = build_model(cfg)
    batch, seq = 2, 16
    tokens = torch.randint(0, 256, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens).loss.backward()
    assert counter.get_total_flops() == flops_per_token(cfg, seq, causal=False) * batch * seq


def test_causal_count_is_the_average_number_of_attended_keys():
    cfg = model_preset("gpu-100m", vocab_size=32768)
    seq = 2048
    attention_difference = flops_per_token(cfg, seq, causal=False) - flops_per_token(cfg, seq, causal=True)
    per_key = 6 * cfg.n_layers * cfg.n_heads * (96 + 64)
    assert attention_difference == per_key * (seq - (seq + 1) / 2)
    _, active = count_parameters(cfg)
    assert flops_per_token(cfg, seq) > 6 * (active - 32768 * 512) - 6 * 10 * 1024  # matmul part dominates


@pytest.mark.parametrize("changes", [dict(n_shared_experts=0), dict(n_dense_layers=2), dict(n_dense_layers=0),
                                     dict(n_shared_experts=2, top_k=3, n_routed_experts=6)])
def test_counts_equal_the_model_for_edge_geometries(changes):
    cfg = model_preset("tiny", vocab_size=50, **changes)
    model = build_model(cfg)
    total, active = count_parameters(cfg)
    assert total == sum(p.numel() for p in model.parameters())
    assert active == active_parameters_from_the_model(model)
