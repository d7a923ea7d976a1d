"""The model's section: each key's own bounds from its knob, the rules between two keys beside the section."""

import pytest

from pilotrun.common.errors import ConfigError
from pilotrun.config import RunConfig, validate_run_config


@pytest.mark.parametrize(("change", "message"), [
    ({"d_model": 0}, "model.d_model must be positive, got 0"),
    ({"vocab_size": -1}, "model.vocab_size must be >= 0, got -1"),
    ({"qk_rope_head_dim": 7}, "model.qk_rope_head_dim must be even, got 7"),
    ({"balance": "fair"},
     "model.balance must be one of ('aux_free+seq', 'aux_free', 'seq', 'batch', 'none'), got 'fair'"),
    ({"init_std": 0.0}, "model.init_std must be positive, got 0.0"),
    ({"n_dense_layers": 3}, "model.n_dense_layers (3) must be between 0 and model.n_layers (2)"),
    ({"top_k": 5}, "model.top_k (5) must be between 1 and model.n_routed_experts (4)"),
    ({"n_expert_groups": 3}, "model.n_routed_experts (4) must be divisible by model.n_expert_groups (3)"),
    ({"n_expert_groups": 2, "n_limited_groups": 1, "top_k": 3},
     "model.top_k exceeds the experts reachable in model.n_limited_groups groups"),
])
def test_a_bad_model_key_is_one_line(change, message):
    config = RunConfig()
    for key, value in change.items():
        setattr(config.model, key, value)
    with pytest.raises(ConfigError) as refused:
        validate_run_config(config)
    assert str(refused.value) == message


def test_routing_rules_apply_only_where_a_moe_layer_exists():
    config = RunConfig()
    config.model.n_dense_layers = config.model.n_layers
    config.model.n_routed_experts = config.model.top_k = 0
    validate_run_config(config)
