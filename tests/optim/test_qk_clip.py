"""QK-Clip on the real MLA model: exactness, which weights move, robustness, counters."""

from __future__ import annotations

import pytest
import torch

from pilotrun.common.errors import CheckpointError
from pilotrun.config import ModelConfig
from pilotrun.model.diagnostics import collect_step_statistics, reset_step_statistics
from pilotrun.model.transformer import build_model
from pilotrun.optim.qk_clip import QKClipCounters, apply_qk_clip


def _model(q_lora_rank: int):
    torch.manual_seed(0)
    # init_std 0.1 gives max logits around 1-2, so a tau between them splits the heads.
    return build_model(ModelConfig(vocab_size=256, q_lora_rank=q_lora_rank, init_std=0.1, attn_impl="eager"))


def _max_logits(model, tokens):
    reset_step_statistics(model)
    model.train()
    with torch.no_grad():
        model(tokens, tokens)
    return collect_step_statistics(model)[1].clone()


def _weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_clipped_heads_hit_tau_and_the_rest_is_untouched(q_lora_rank, layer):
    # Clip one layer at a time: clipping layer 0 changes what layer 1 sees, so only the clipped layer (and the
    # layers below it) have a prediction for the rerun; the other rows are set below tau.
    model = _model(q_lora_rank)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    measured = _max_logits(model, tokens)
    tau = float(measured[layer].median())  # some heads of this layer above, some at or below
    before_logits = torch.zeros_like(measured)
    before_logits[layer] = measured[layer]
    before = _weights(model)
    result = apply_qk_clip(model, before_logits, tau)

    expected_mask = before_logits > tau
    assert torch.equal(result.clipped, expected_mask)
    assert 0 < result.n_heads_clipped < measured.size(1)
    assert result.min_gamma == pytest.approx(float((tau / before_logits[expected_mask]).min()))
    assert result.skipped_nonfinite_layers == []

    after_logits = _max_logits(model, tokens)
    gamma = tau / before_logits.clamp(min=tau)
    # The rerun's max logit of a clipped head is exactly gamma * S (every logit of the head scales by gamma).
    torch.testing.assert_close(
        after_logits[expected_mask], (gamma * measured)[expected_mask], rtol=1e-5, atol=0
    )
    assert (after_logits[expected_mask] <= tau * (1 + 1e-5)).all()
    unclipped = ~expected_mask
    unclipped[layer + 1:] = False
    torch.testing.assert_close(after_logits[unclipped], measured[unclipped], rtol=1e-6, atol=0)

    after = _weights(model)
    for layer_index, attn in enumerate(model.attention_layers()):
        prefix = f"layers.{layer_index}.attn."
        n_heads, d_n, d_r, d_v = attn.n_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
        query_name = prefix + ("wq_b.weight" if q_lora_rank else "wq.weight")
        q_before = before[query_name].view(n_heads, d_n + d_r, -1)
        q_after = after[query_name].view(n_heads, d_n + d_r, -1)
        kv_before = before[prefix + "wkv_b.weight"].view(n_heads, d_n + d_v, -1)
        kv_after = after[prefix + "wkv_b.weight"].view(n_heads, d_n + d_v, -1)
        for head in range(n_heads):
            g = float(gamma[layer_index, head])
            assert torch.equal(kv_after[head, d_n:], kv_before[head, d_n:])  # value rows never move
            if expected_mask[layer_index, head]:
                root = g**0.5
                torch.testing.assert_close(
                    q_after[head, :d_n], q_before[head, :d_n] * root, rtol=1e-6, atol=0
                )
                torch.testing.assert_close(q_after[head, d_n:], q_before[head, d_n:] * g, rtol=1e-6, atol=0)
                torch.testing.assert_close(
                    kv_after[head, :d_n], kv_before[head, :d_n] * root, rtol=1e-6, atol=0
                )
            else:
                assert torch.equal(q_after[head], q_before[head])
                assert torch.equal(kv_after[head], kv_before[head])
    touched = {
        f"layers.{layer}.attn.{n}" for n in (("wq_b.weight" if q_lora_rank else "wq.weight"), "wkv_b.weight")
    }
    for name in before:
        if name not in touched:  # wkv_a (incl. the shared rotary key), wq_a, norms, wo, FFN, embed, head
            assert torch.equal(after[name], before[name]), name


def test_negative_and_nonfinite_logits_never_produce_nan():
    model = _model(0)
    n_layers, n_heads = len(model.attention_layers()), model.attention_layers()[0].n_heads
    before = _weights(model)
    logits = torch.full((n_layers, n_heads), 0.5)
    logits[0, 0] = -3.0                 # negative max: gamma must be 1, not a NaN square root
    logits[0, 1] = 8.0                  # clipped
    logits[0, 2] = float("-inf")        # nothing measured: left alone
    logits[1, 0] = float("nan")         # layer 1 is skipped entirely, even though head 3 is large
    logits[1, 3] = 50.0
    result = apply_qk_clip(model, logits, tau=2.0)
    assert result.skipped_nonfinite_layers == [1]
    assert result.clipped.tolist() == [[False, True, False, False], [False, False, False, False]]
    assert result.gamma[0, 1] == pytest.approx(0.25) and result.min_gamma == pytest.approx(0.25)
    assert result.gamma[0, 0] == 1.0 and result.gamma[0, 2] == 1.0
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        if name.startswith("layers.1."):
            assert torch.equal(param, before[name]), name
    logits[1, 0] = float("inf")
    assert apply_qk_clip(model, logits, tau=2.0).skipped_nonfinite_layers == [1]


def test_nothing_above_tau_changes_nothing():
    model = _model(16)
    before = _weights(model)
    result = apply_qk_clip(model, torch.full((2, 4), 1.0), tau=100.0)
    assert result.n_heads_clipped == 0 and result.min_gamma == 1.0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_bad_shapes_and_tau_are_rejected():
    model = _model(0)
    with pytest.raises(ValueError, match="expected \\[2, n_heads\\]"):
        apply_qk_clip(model, torch.zeros(3, 4), tau=1.0)
    with pytest.raises(ValueError, match="tau"):
        apply_qk_clip(model, torch.zeros(2, 4), tau=0.0)


def test_counters_accumulate_and_round_trip():
    model = _model(0)
    counters = QKClipCounters(2, 4)
    logits = torch.tensor([[5.0, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1]])
    first = counters.update(apply_qk_clip(model, logits, tau=1.0))
    assert first == [(0, 0)]
    logits[1, 2] = float("nan")
    logits[0, 3] = 7.0
    second = counters.update(apply_qk_clip(model, logits, tau=1.0))
    assert second == [(0, 3)]
    counters.update(apply_qk_clip(model, torch.zeros(2, 4), tau=1.0))  # a quiet update
    assert counters.cumulative.tolist() == [[2, 0, 0, 1], [0, 0, 0, 0]]
    assert counters.updates_with_clip == 2 and counters.total_interventions() == 3
    assert counters.nonfinite_layer_skips == 1

    restored = QKClipCounters(2, 4)
    restored.load_state_dict(counters.state_dict())
    assert torch.equal(restored.cumulative, counters.cumulative)
    assert restored.state_dict() == counters.state_dict()
    with pytest.raises(CheckpointError, match="QK-Clip counters"):
        QKClipCounters(3, 4).load_state_dict(counters.state_dict())


def test_event_fields_for_first_time_and_hard_clips():
    from pilotrun.config import QK_CLIP_HARD_GAMMA
    from pilotrun.optim.qk_clip import HARD_CLIP_GAMMA, qk_clip_events

    assert HARD_CLIP_GAMMA == QK_CLIP_HARD_GAMMA  # the reader's copy of the writer's rule
    model = _model(0)
    counters = QKClipCounters(2, 4)
    logits = torch.tensor([[1.5, 0.1, 0.1, 0.1], [0.1, 0.1, 3.0, 0.1]])
    result = apply_qk_clip(model, logits, tau=1.0)
    events = qk_clip_events(result, logits, counters.update(result))
    assert events == [  # both heads are new; (1, 2) is also hard: gamma = 1/3
        {
            "layer": 0,
            "head": 0,
            "max_logit": 1.5,
            "gamma": pytest.approx(1 / 1.5, rel=1e-7),
            "first_time": True,
            "hard": False,
        },
        {
            "layer": 1,
            "head": 2,
            "max_logit": 3.0,
            "gamma": pytest.approx(1 / 3, rel=1e-7),
            "first_time": True,
            "hard": True,
        },
    ]
    # Clipped again: only the hard one is logged again, and a new mild clip is logged once.
    logits[0, 3] = 1.2
    result = apply_qk_clip(model, logits, tau=1.0)
    events = qk_clip_events(result, logits, counters.update(result))
    assert [(e["layer"], e["head"], e["first_time"], e["hard"]) for e in events] == [(0, 3, True, False),
                                                                                     (1, 2, False, True)]
