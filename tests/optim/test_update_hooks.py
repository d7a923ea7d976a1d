"""The after-update hooks do exactly what the direct calls do, report their window once, and keep their
state."""

from __future__ import annotations

import copy

import torch

from pilotrun.config import RunConfig, apply_overrides, config_from_dict, config_to_dict
from pilotrun.model.balancing import update_expert_bias
from pilotrun.model.diagnostics import collect_step_statistics, reset_step_statistics
from pilotrun.model.transformer import build_model
from pilotrun.optim.qk_clip import apply_qk_clip
from pilotrun.optim.update_hooks import ExpertBiasHook, QKClipHook, StepStatistics, build_update_hooks


def _config(*overrides: str) -> RunConfig:
    base = ["model.vocab_size=256", "model.init_std=0.1", "model.attn_impl=eager", *overrides]
    return config_from_dict(apply_overrides(config_to_dict(RunConfig()), base))


def _model_and_statistics(config: RunConfig):
    torch.manual_seed(0)
    model = build_model(config.model)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    reset_step_statistics(model)
    with torch.no_grad():
        model(tokens, tokens)
    return model, StepStatistics(*(t.clone() for t in collect_step_statistics(model)))


def _weights(model):
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def test_qk_clip_hook_equals_the_direct_call_and_reports_each_window_once():
    config = _config()
    model, statistics = _model_and_statistics(config)
    tau = float(statistics.qk_max_logit.median())  # some heads above, some below
    direct = copy.deepcopy(model)
    result = apply_qk_clip(direct, statistics.qk_max_logit, tau)
    hook = QKClipHook(model, config.model.n_heads, enabled=True, tau=tau)
    events = hook.after_update(0, statistics)
    assert result.n_heads_clipped > 0 and len(events) == result.n_heads_clipped  # every head is new
    after, expected = _weights(model), _weights(direct)
    assert all(torch.equal(after[k], expected[k]) for k in expected)
    metrics = hook.window_metrics()
    assert metrics["heads_clipped"] == result.n_heads_clipped and metrics["updates_with_clip"] == 1
    assert len(metrics["first_clipped"]) == result.n_heads_clipped
    assert hook.window_metrics()["heads_clipped"] == 0  # the window starts again; the run counters stay
    restored = QKClipHook(copy.deepcopy(model), config.model.n_heads, enabled=True, tau=tau)
    restored.load_state_dict(hook.state_dict())
    assert restored.state_dict() == hook.state_dict()


def test_disabled_qk_clip_hook_touches_nothing_but_still_reports_zeros():
    config = _config()
    model, statistics = _model_and_statistics(config)
    before = _weights(model)
    hook = QKClipHook(model, config.model.n_heads, enabled=False, tau=1e-6)
    assert hook.after_update(0, statistics) == []
    assert all(torch.equal(before[k], v) for k, v in _weights(model).items())
    assert hook.window_metrics() == {
        "heads_clipped": 0,
        "min_gamma": 1.0,
        "first_clipped": [],
        "updates_with_clip": 0,
        "cumulative_interventions": 0,
        "nonfinite_layer_skips": 0,
    }


def test_expert_bias_hook_equals_the_direct_update_and_reports_the_speed_of_its_last_update():
    config = _config("model.bias_update_speed=0.01")
    model, statistics = _model_and_statistics(config)
    direct = copy.deepcopy(model)
    update_expert_bias(direct, statistics.tokens_per_expert, 0.01)
    hook = ExpertBiasHook(model, config)
    assert hook.window_metrics() == {}  # no applied update in the window: no speed to report
    hook.after_update(0, statistics)
    after, expected = _weights(model), _weights(direct)
    assert any("expert_bias" in k for k in expected)
    assert all(torch.equal(after[k], expected[k]) for k in expected)
    assert hook.window_metrics() == {"bias_update_speed": 0.01} and hook.window_metrics() == {}
    assert hook.state_dict() is None  # the bias itself is a model buffer, saved with the weights


def test_build_update_hooks_runs_qk_clip_before_the_expert_bias():
    config = _config()
    model, _ = _model_and_statistics(config)
    assert [hook.name for hook in build_update_hooks(model, config)] == ["qk_clip", "moe"]
