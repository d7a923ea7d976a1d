"""The typed recipe: the model, optimizer and training sections of a YAML config, each knob describing itself.

knob.py (a field's meaning, single-key rules and what a resume may do with it), model.py, optim.py, train.py
(the sections by component), run_config.py (the whole recipe, its validation, the resume lists read from the
knobs), typed.py (dataclasses <-> the nested dict a record holds), renames.py (the earlier flat names),
recipe.py (YAML, --set, packaged recipes), describe.py (`pilotrun config`). The names below are the ones the
rest of the package imports.
"""

from pilotrun.config.knob import knob
from pilotrun.config.model import ATTN_IMPLS, BALANCE_MODES, MOE_IMPLS, SCORE_FUNCS, ModelConfig
from pilotrun.config.optim import (
    MUON_GRANULARITIES,
    MUON_NS_VARIANTS,
    MUON_SCALE_MODES,
    QK_CLIP_HARD_GAMMA,
    ROUTER_OPTIMIZERS,
    SCHEDULE_KINDS,
    AdamWConfig,
    MuonConfig,
    OptimConfig,
    QKClipConfig,
    ScheduleConfig,
)
from pilotrun.config.recipe import (
    apply_overrides,
    check_override_keys,
    load_run_config,
    load_yaml,
    loaded_recipe,
    loaded_recipe_from,
    packaged_configs_dir,
    parse_override,
    resolve_recipe_path,
)
from pilotrun.config.renames import (
    FLAT_NAMES,
    RECIPE_FORMAT,
    RECIPE_FORMAT_KEY,
    current_key,
    current_recipe,
    recorded_value,
)
from pilotrun.config.run_config import MACHINE_KEYS, RESUME_FREE_KEYS, RunConfig, validate_run_config
from pilotrun.config.train import (
    CHECKPOINT_MODES,
    COMPILE_MODES,
    DATA_MODES,
    PARALLELISMS,
    PRECISIONS,
    SPIKE_POLICIES,
    TRACKER_NAMES,
    CheckpointConfig,
    DownstreamConfig,
    EvalConfig,
    LogConfig,
    ProfileConfig,
    SpikeConfig,
    TrainConfig,
)
from pilotrun.config.typed import config_from_dict, config_to_dict, flatten, nearest_hint

__all__ = [
    "FLAT_NAMES",
    "RECIPE_FORMAT",
    "RECIPE_FORMAT_KEY",
    "CheckpointConfig",
    "DownstreamConfig",
    "EvalConfig",
    "LogConfig",
    "current_key",
    "current_recipe",
    "recorded_value",
    "ATTN_IMPLS",
    "BALANCE_MODES",
    "CHECKPOINT_MODES",
    "COMPILE_MODES",
    "DATA_MODES",
    "MACHINE_KEYS",
    "MOE_IMPLS",
    "MUON_GRANULARITIES",
    "MUON_NS_VARIANTS",
    "MUON_SCALE_MODES",
    "PARALLELISMS",
    "PRECISIONS",
    "QK_CLIP_HARD_GAMMA",
    "RESUME_FREE_KEYS",
    "ROUTER_OPTIMIZERS",
    "SCHEDULE_KINDS",
    "SCORE_FUNCS",
    "SPIKE_POLICIES",
    "TRACKER_NAMES",
    "AdamWConfig",
    "ModelConfig",
    "MuonConfig",
    "OptimConfig",
    "ProfileConfig",
    "QKClipConfig",
    "RunConfig",
    "ScheduleConfig",
    "SpikeConfig",
    "TrainConfig",
    "apply_overrides",
    "check_override_keys",
    "config_from_dict",
    "config_to_dict",
    "flatten",
    "knob",
    "load_run_config",
    "load_yaml",
    "loaded_recipe",
    "loaded_recipe_from",
    "nearest_hint",
    "packaged_configs_dir",
    "parse_override",
    "resolve_recipe_path",
    "validate_run_config",
]
