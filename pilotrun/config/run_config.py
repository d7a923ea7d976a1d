"""The whole recipe: a `RunConfig` of the model, optimizer and training sections, validated in one place, and
the keys a resume may change, read from the knobs themselves (a knob that says nothing is "recipe")."""

from __future__ import annotations

from dataclasses import dataclass, field

from pilotrun.config.knob import check_knobs, keys_on_resume, need
from pilotrun.config.model import ModelConfig, check_model_rules
from pilotrun.config.optim import OptimConfig, check_optim_rules
from pilotrun.config.train import TrainConfig, check_train_rules


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# Machine settings (on_resume="machine"): free on resume and outside a lock's comparison.
MACHINE_KEYS = keys_on_resume(RunConfig(), ("machine",))
# Keys that may change on resume without ceremony (the checkpoint compatibility check consults this).
RESUME_FREE_KEYS = keys_on_resume(RunConfig(), ("machine", "free"))


def validate_run_config(config: RunConfig) -> None:
    """Impossible geometry and out-of-range values, one clear error each: every key against its own knob,
    then the rules that relate two keys."""
    check_knobs(config)
    check_model_rules(config.model)
    check_optim_rules(config.optim)
    check_train_rules(config.train)
    t, m = config.train, config.model
    need(t.seq_len <= m.max_seq_len,
         f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}), the RoPE table's length")
