"""Named model sizes: each one is a valid recipe, builds, and matches the geometry presets.py documents."""

import dataclasses

import pytest

from pilotrun.common.errors import ConfigError
from pilotrun.config import RunConfig, TrainConfig, validate_run_config
from pilotrun.model.accounting import count_parameters
from pilotrun.model.presets import MODEL_PRESETS, model_preset


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_every_preset_is_a_valid_recipe_with_the_vocabulary_left_to_the_data(name):
    cfg = model_preset(name)
    assert cfg.vocab_size == 0
    validate_run_config(RunConfig(model=cfg, train=TrainConfig(seq_len=64)))


def test_cpu_preset_is_a_few_million_parameters_with_a_small_bpe_vocabulary():
    total, active = count_parameters(model_preset("cpu", vocab_size=4096))
    assert 2_000_000 < total < 5_000_000
    assert active < total


def test_changes_apply_and_unknown_names_are_a_config_error():
    cfg = model_preset("tiny", vocab_size=100, attn_impl="sdpa")
    assert (cfg.vocab_size, cfg.attn_impl, cfg.d_model) == (100, "sdpa", 64)
    assert dataclasses.replace(cfg, vocab_size=0) == model_preset("tiny", attn_impl="sdpa")
    with pytest.raises(ConfigError, match="unknown model preset 'huge'"):
        model_preset("huge")
