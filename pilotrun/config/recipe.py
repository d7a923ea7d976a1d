"""A recipe as a command is given it: a YAML file (or a packaged recipe by name) merged over the defaults,
then `--set key=value` overrides, then built and validated (`loaded_recipe`); each bad input one ConfigError
that names the key and, where it came from a flag or a file, that flag or file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pilotrun.common.errors import ConfigError
from pilotrun.common.files import not_regular
from pilotrun.common.parsing import parse_yaml_text, read_text_bounded, shown
from pilotrun.config.renames import current_key, current_recipe
from pilotrun.config.run_config import RunConfig, validate_run_config
from pilotrun.config.typed import config_from_dict, config_to_dict, flatten, nearest_hint


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.max_steps=200` -> (['train', 'max_steps'], 200); the value is parsed as YAML. A key under its
    earlier flat name is read as today's (`train.eval_every` -> ['train', 'eval', 'every'])."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got '{shown(text)}'")
    key, raw = text.split("=", 1)
    path = current_key(key.strip()).split(".")
    if not all(path):
        raise ConfigError(f"--set has an empty key part in '{shown(text)}'")
    value = parse_yaml_text(raw, f"--set {shown(key)}")
    return path, value


def check_override_keys(overrides: list[str]) -> None:
    """Each `--set` key names a config key: a typo is blamed on the flag, with the nearest known key, before
    it could be mistaken for a fault of the recipe file."""
    leaves = set(flatten(config_to_dict(RunConfig())))
    for text in overrides:
        path, _ = parse_override(text)
        key = ".".join(path)
        if key in leaves:
            continue
        # The first part of the key that names nothing: 'nosection' of nosection.x, all of train.bogus.
        for depth in range(1, len(path) + 1):
            prefix = ".".join(path[:depth])
            if prefix not in leaves and not any(leaf.startswith(prefix + ".") for leaf in leaves):
                raise ConfigError(f"--set {shown(key)}: unknown config key '{shown(prefix)}'"
                                  f"{nearest_hint(key, sorted(leaves))} (`pilotrun config` lists every key)")


# What `--allow-change` may name besides a config key: the data's identity, a mixture's weights and seed, the
# training geometry, the optimizers' partition (training/checkpoint/compatibility.py) and the code identity a
# lock records (run/recipe_lock.py).
ALLOWABLE_BEYOND_THE_RECIPE = ("data.metadata_sha256", "data.mixture.weights", "data.mixture.seed",
                               "world_size", "optimizer.partition", "code")


def check_allow_change_keys(keys: list[str] | tuple[str, ...]) -> None:
    """Each `--allow-change` key names something a resume or a lock compares: a typo is refused with the
    nearest known key, where it would otherwise be read as 'no such difference' or leave the difference
    refused."""
    leaves = set(flatten(config_to_dict(RunConfig())))
    known = leaves | set(ALLOWABLE_BEYOND_THE_RECIPE)
    for key in keys:
        name = current_key(key.removeprefix("recipe."))
        if name not in known:
            raise ConfigError(
                f"--allow-change {shown(key)}: no such key{nearest_hint(name, sorted(known))} (a config key "
                f"of `pilotrun config`, or {', '.join(ALLOWABLE_BEYOND_THE_RECIPE)})"
            )


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted `key=value` overrides to a nested dict (a copy); section names must exist."""
    import copy

    merged = copy.deepcopy(current_recipe(data))
    for text in overrides:
        path, value = parse_override(text)
        node = merged
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {'.'.join(path)}: '{part}' is not a section")
        node[path[-1]] = value
    return merged


def packaged_configs_dir() -> Path:
    """The recipes shipped inside the package (pilotrun/configs/); the repository's configs/ links here."""
    return Path(__file__).resolve().parents[1] / "configs"


def resolve_recipe_path(path: str | Path) -> Path:
    """An existing file as given, else a packaged recipe by name: `stability`, `stability.yaml`, `gpu/h100`
    or `configs/stability.yaml` (so README commands work from any folder and after a wheel install)."""
    given = Path(path)
    if given.is_file():
        return given
    name = given.as_posix().removeprefix("configs/")
    candidate = packaged_configs_dir() / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if not given.is_absolute() and candidate.is_file():
        return candidate
    odd = not_regular(given)
    if odd is not None:
        raise ConfigError(f"config file {path} is {odd}")
    shipped = sorted(p.relative_to(packaged_configs_dir()).with_suffix("").as_posix()
                     for p in packaged_configs_dir().rglob("*.yaml"))
    raise ConfigError(f"config file not found: {path} (packaged recipes by name: {', '.join(shipped)})")


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = resolve_recipe_path(path)
    data = parse_yaml_text(read_text_bounded(path, error=ConfigError), str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        return current_recipe(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def load_run_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults <- YAML file <- `--set` overrides, then validated."""
    check_override_keys(overrides or [])
    data = load_yaml(path) if path is not None else {}
    return loaded_recipe_from(apply_overrides(data, overrides or []), overrides or [], path)


def loaded_recipe_from(data: dict[str, Any], overrides: list[str], source: Any) -> RunConfig:
    """loaded_recipe, its error naming where the bad value came from (the line is all the user sees): the
    `--set` flag whose key the error names, else `source` (the recipe file, a lock; None: nothing to add)."""
    try:
        return loaded_recipe(data)
    except ConfigError as exc:
        flag = next((t for t in overrides if names_key(str(exc), t.split("=", 1)[0].strip())), None)
        if flag is None and source is None:
            raise
        raise ConfigError(f"--set {shown(flag)}: {exc}" if flag else f"{source}: {exc}") from None


def names_key(message: str, key: str) -> bool:
    """Whether an error message names `key` (under its earlier or its current name) as a whole key."""
    return any(
        re.search(rf"(?<![\w.]){re.escape(name)}(?![\w.])", message) for name in (key, current_key(key))
    )


def loaded_recipe(data: dict[str, Any]) -> RunConfig:
    """The recipe a command was given (a YAML, a lock's, an API caller's; after --set), built and validated,
    with the alias `train.log.tensorboard: true` folded into `train.log.trackers`, so that the trainer reads
    one list."""
    # Only a recipe loaded for a session is folded, never one read back from a record (run.json, a checkpoint,
    # a lock), which keeps its sha256; both keys are machine keys, free on resume and outside a lock's
    # comparison, so the folded form continues any run or lock that said true.
    config = config_from_dict(data)
    log = config.train.log
    if log.tensorboard:
        log.trackers = log.trackers if "tensorboard" in log.trackers else ["tensorboard", *log.trackers]
        log.tensorboard = False
    validate_run_config(config)
    return config
