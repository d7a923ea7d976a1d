"""The earlier flat names: one table, read wherever a key enters, so that a recipe of format 1 (a YAML, a
`--set` key, a record's recipe) loads as the same recipe in today's names."""

import pytest

from pilotrun.common.errors import ConfigError
from pilotrun.config import (
    FLAT_NAMES,
    RunConfig,
    config_from_dict,
    config_to_dict,
    current_key,
    current_recipe,
    flatten,
    load_run_config,
    recorded_value,
)

# A recipe as recipe format 1 recorded it (run.json, a checkpoint, a lock on main before the sections): every
# training key flat.
FORMAT_1_TRAIN = {
    "log_every": 2,
    "eval_every": 7,
    "eval_batches": 3,
    "downstream_tasks": ["t.jsonl"],
    "downstream_every": 5,
    "downstream_limit": 9,
    "checkpoint_every": 11,
    "checkpoint_mode": "sync",
    "keep_checkpoints": 4,
    "keep_every": 20,
    "keep_steps": [6],
    "trackers": ["wandb"],
    "tensorboard": False,
}


def format_1_recipe() -> dict:
    recipe = config_to_dict(RunConfig())
    for section in ("log", "eval", "downstream", "checkpoint"):
        del recipe["train"][section]
    recipe["train"].update(FORMAT_1_TRAIN)
    return recipe


def test_every_earlier_name_moves_into_its_section():
    recipe = format_1_recipe()
    moved = current_recipe(recipe)
    assert moved is not recipe and "eval_every" in recipe["train"]  # a copy: the record itself is untouched
    config = config_from_dict(recipe)
    t = config.train
    assert (t.log.every, t.eval.every, t.eval.batches) == (2, 7, 3)
    assert (t.downstream.tasks, t.downstream.every, t.downstream.limit) == (["t.jsonl"], 5, 9)
    assert (t.checkpoint.every, t.checkpoint.mode, t.checkpoint.keep) == (11, "sync", 4)
    assert (t.checkpoint.keep_every, t.checkpoint.keep_steps) == (20, [6])
    assert (t.log.trackers, t.log.tensorboard) == (["wandb"], False)
    assert flatten(config_to_dict(config)) == flatten(moved)  # nothing lost, nothing added
    assert {flatten(recipe)[old] == flatten(moved)[new] for old, new in FLAT_NAMES.items()} == {True}
    assert current_recipe(moved) is moved  # today's recipe is read as it is


def test_keys_and_values_of_either_format():
    assert current_key("train.eval_every") == "train.eval.every"
    assert current_key("recipe.train.keep_checkpoints") == "recipe.train.checkpoint.keep"
    assert current_key("train.seq_len") == "train.seq_len" and current_key("world_size") == "world_size"
    assert recorded_value(format_1_recipe(), "train.checkpoint.every") == 11
    assert recorded_value(config_to_dict(RunConfig()), "train.checkpoint.every") == 50
    assert recorded_value({}, "train.eval.every") is None and recorded_value(None, "train.seq_len") is None


def test_a_yaml_and_a_set_of_the_earlier_names_load_as_today(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("train:\n  eval_every: 6\n  keep_checkpoints: 5\n  tensorboard: true\n")
    config = load_run_config(path, ["train.log_every=4", "train.eval.batches=2", "train.checkpoint_every=8"])
    t = config.train
    assert (t.eval.every, t.checkpoint.keep, t.log.every, t.eval.batches, t.checkpoint.every) == (
        6,
        5,
        4,
        2,
        8,
    )
    assert (t.log.trackers, t.log.tensorboard) == (["tensorboard"], False)
    # The newer name given after the older one wins, as any later --set does.
    assert load_run_config(path, ["train.eval.every=9"]).train.eval.every == 9


def test_a_key_under_both_names_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("train:\n  eval_every: 6\n  eval: {every: 7}\n")
    with pytest.raises(ConfigError) as refused:
        load_run_config(path)
    assert str(refused.value) == (
        f"{path}: config keys 'train.eval_every' and 'train.eval.every' are one key "
        "under its earlier and its current name: give it once"
    )


def test_a_bad_value_under_an_earlier_name_is_blamed_on_its_flag():
    with pytest.raises(ConfigError) as refused:
        load_run_config(None, ["train.eval_every=-1"])
    assert str(refused.value) == "--set train.eval_every=-1: train.eval.every must be >= 0, got -1"
