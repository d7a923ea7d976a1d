"""The training section: each key's own bounds from its knob, the spike window against its history."""

import pytest

from pilotrun.common.errors import ConfigError
from pilotrun.config import RunConfig, validate_run_config


def refusal(change) -> str:
    config = RunConfig()
    change(config.train)
    with pytest.raises(ConfigError) as refused:
        validate_run_config(config)
    return str(refused.value)


def test_a_bad_train_key_is_one_line():
    assert refusal(lambda t: setattr(t, "device", "tpu")) == \
        "train.device must be auto, cpu or cuda[:N], got 'tpu'"
    assert refusal(lambda t: setattr(t, "skip_data", [[0, 0]])) == \
        "train.skip_data entries are [first_batch >= 0, batches >= 1], got [[0, 0]]"
    assert refusal(lambda t: setattr(t.checkpoint, "keep_steps", [10, -1])) == \
        "train.checkpoint.keep_steps[1] must be >= 0, got -1"
    assert refusal(lambda t: setattr(t.log, "trackers", ["neptune"])) == \
        "train.log.trackers: unknown tracker 'neptune' (known: tensorboard, wandb, mlflow, trackio)"
    assert refusal(lambda t: setattr(t, "loss_scale_init", 0.0)) == \
        "train.loss_scale_init must be positive, got 0.0"
    assert refusal(lambda t: setattr(t, "seq_len", 5000)) == \
        "train.seq_len (5000) exceeds model.max_seq_len (4096), the RoPE table's length"


@pytest.mark.parametrize(("key", "value", "message"), [
    ("window", 2, "train.spike.window must be >= 3, got 2"),
    ("factor", 0.0, "train.spike.factor must be positive, got 0.0"),
    ("min_history", 60, "train.spike.min_history (60) must be <= train.spike.window (50)"),
    ("policy", "ignore", "train.spike.policy must be one of ('record', 'skip', 'rollback'), got 'ignore'"),
])
def test_a_bad_spike_key_is_one_line(key, value, message):
    assert refusal(lambda t: setattr(t.spike, key, value)) == message
