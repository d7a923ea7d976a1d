"""A recipe between the typed dataclasses and the nested dict a record holds: a round trip is exact, numbers
are read as their knob's type, and the flattened form names every leaf."""

import pytest

from pilotrun.common.errors import ConfigError
from pilotrun.config import RunConfig, config_from_dict, config_to_dict, flatten, validate_run_config


def test_defaults_validate_and_round_trip():
    config = RunConfig()
    validate_run_config(config)
    assert config_from_dict(config_to_dict(config)) == config


def test_flatten_gives_dotted_keys():
    flat = flatten(config_to_dict(RunConfig()))
    assert flat["train.seq_len"] == 32
    assert flat["optim.muon.lr"] == 3e-3
    assert "optim.schedule.horizon" in flat




@pytest.mark.parametrize(("value", "read"), [(7, 7), (7.0, 7), ("1e3", 1000)])
def test_an_int_knob_takes_a_whole_number_in_any_spelling(value, read):
    config = config_from_dict({"train": {"max_steps": value}})
    assert config.train.max_steps == read and type(config.train.max_steps) is int


@pytest.mark.parametrize(("value", "fragment"), [(7.5, "'train.max_steps' must be int, got 7.5"),
                                                 (float("inf"), "must be a finite number"),
                                                 (True, "'train.max_steps' must be int")])
def test_a_value_that_is_no_whole_number_is_refused(value, fragment):
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"train": {"max_steps": value}})
    assert fragment in str(refused.value)
