"""The recipe's earlier flat names and the sections that own them now: one table, read wherever a key enters.

Recipe format 1 held every training key flat in `train` (`train.eval_every`); format 2 gives each component
its section (`train.eval.every`), which the component is built from. A YAML recipe, a `--set` or
`--allow-change` key, a lock's recipe, run.json's recorded recipe and a checkpoint's are read through this
table, so that every earlier recipe, run, checkpoint and lock loads, resumes and compares as the same recipe
in today's names. run.json and a lock say which format they hold (`recipe_format`; absent: 1).
"""

from __future__ import annotations

import copy
from typing import Any

from pilotrun.common.errors import ConfigError

RECIPE_FORMAT = 2
RECIPE_FORMAT_KEY = "recipe_format"

FLAT_NAMES = {
    "train.eval_every": "train.eval.every",
    "train.eval_batches": "train.eval.batches",
    "train.downstream_tasks": "train.downstream.tasks",
    "train.downstream_every": "train.downstream.every",
    "train.downstream_limit": "train.downstream.limit",
    "train.checkpoint_every": "train.checkpoint.every",
    "train.checkpoint_mode": "train.checkpoint.mode",
    "train.keep_checkpoints": "train.checkpoint.keep",
    "train.keep_every": "train.checkpoint.keep_every",
    "train.keep_steps": "train.checkpoint.keep_steps",
    "train.log_every": "train.log.every",
    "train.trackers": "train.log.trackers",
    "train.tensorboard": "train.log.tensorboard",
}

# Keys added after format 1, at the value every format-1 run used: a recipe recorded then reads as the one
# that ran, so a resume or a lock comparison finds no difference it never made.
IMPLIED_IN_FORMAT_1 = {"train.checkpoint.storage": "auto"}


def current_key(key: str) -> str:
    """A dotted key in today's name: `train.eval_every` -> `train.eval.every`; `recipe.` kept where given."""
    if key.startswith("recipe."):
        return "recipe." + current_key(key.removeprefix("recipe."))
    return FLAT_NAMES.get(key, key)


def current_recipe(recipe: Any) -> Any:
    """A nested recipe dict with every earlier flat key moved into its section (a copy where one moved).
    A recipe that gives a key under both names is refused: which one it means cannot be told."""
    if not isinstance(recipe, dict) or not isinstance(recipe.get("train"), dict):
        return recipe
    if not any(old.removeprefix("train.") in recipe["train"] for old in FLAT_NAMES):
        return recipe
    moved = copy.deepcopy(recipe)
    train = moved["train"]
    for old, new in FLAT_NAMES.items():
        name = old.removeprefix("train.")
        if name in train:
            move_key(train, train.pop(name), old, new)
    for key, value in IMPLIED_IN_FORMAT_1.items():
        _, section, name = key.split(".")
        if isinstance(train.get(section, {}), dict):
            train.setdefault(section, {}).setdefault(name, value)
    return moved


def move_key(train: dict[str, Any], value: Any, old: str, new: str) -> None:
    _, section, name = new.split(".")
    target = train.setdefault(section, {})
    if not isinstance(target, dict):
        raise ConfigError(
            f"config key '{old}' is the earlier name of '{new}', but train.{section} is not a section"
        )
    if name in target:
        raise ConfigError(
            f"config keys '{old}' and '{new}' are one key under its earlier and its current name: "
            "give it once"
        )
    target[name] = value


def recorded_value(recipe: Any, dotted: str) -> Any:
    """The value at today's dotted key of a recorded recipe of any format (run.json's, a lock's), or None
    where the record lacks it (never a default: a reader of a record judges what was recorded)."""
    node: Any = recipe
    if isinstance(recipe, dict) and isinstance(recipe.get("train"), dict):
        flat = {new: old for old, new in FLAT_NAMES.items()}.get(dotted)
        if flat is not None and flat.removeprefix("train.") in recipe["train"]:
            return recipe["train"][flat.removeprefix("train.")]
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node
