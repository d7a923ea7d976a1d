"""The optimizer's section: each key's own bounds from its knob; the horizon against the warm-up."""

import pytest

from pilotrun.common.errors import ConfigError
from pilotrun.config import RunConfig, validate_run_config


@pytest.mark.parametrize(("section", "key", "value", "message"), [
    ("muon", "momentum", 1.0, "optim.muon.momentum must be in [0, 1), got 1.0"),
    ("muon", "ns_steps", 0, "optim.muon.ns_steps must be >= 1, got 0"),
    ("muon", "granularity", "row", "optim.muon.granularity must be one of ('param', 'per_head'), got 'row'"),
    ("adamw", "betas", [0.9], "optim.adamw.betas must hold 2 items, got [0.9]"),
    ("adamw", "betas", [0.9, 1.0], "optim.adamw.betas[1] must be in [0, 1), got 1.0"),
    ("adamw", "lr", -1.0, "optim.adamw.lr must be >= 0, got -1.0"),
    ("qk_clip", "tau", 0.0, "optim.qk_clip.tau must be positive, got 0.0"),
    ("schedule", "decay_fraction", 0.0, "optim.schedule.decay_fraction must be in (0, 1], got 0.0"),
    ("schedule", "warmup_steps", 2000,
     "optim.schedule.horizon (1000) must be >= 1 and >= warmup_steps (2000)"),
])
def test_a_bad_optim_key_is_one_line(section, key, value, message):
    config = RunConfig()
    setattr(getattr(config.optim, section), key, value)
    with pytest.raises(ConfigError) as refused:
        validate_run_config(config)
    assert str(refused.value) == message


def test_a_negative_grad_clip_is_refused():
    config = RunConfig()
    config.optim.grad_clip = -0.5
    with pytest.raises(ConfigError, match=r"optim.grad_clip must be >= 0, got -0.5"):
        validate_run_config(config)
