"""A recipe between its two forms: the typed dataclasses and the nested JSON-ready dict that YAML, run.json,
a checkpoint and a lock hold. `config_to_dict` gives the canonical form; `config_from_dict` reads it back
(unknown keys and wrong types each one ConfigError naming the key), so a restored recipe is exactly the one
that ran."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from pilotrun.common.errors import ConfigError
from pilotrun.common.parsing import shown
from pilotrun.config.renames import current_recipe
from pilotrun.config.run_config import RunConfig


def config_to_dict(config: Any) -> dict[str, Any]:
    """Canonical nested dict (JSON-ready) of a config dataclass."""
    return dataclasses.asdict(config)


def config_from_dict(data: dict[str, Any], cls: type = RunConfig, where: str = "") -> Any:
    """Build a config dataclass from a nested dict; unknown keys and wrong types raise ConfigError. A recipe
    under its earlier flat names (config/renames.py) is read in today's."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    if cls is RunConfig:  # a recipe of any format (a record's, a lock's) is read in today's names
        data = current_recipe(data)
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted((k for k in data if k not in known), key=str)  # YAML keys may be numbers too
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(f"unknown config key '{shown(key)}'{nearest_hint(str(unknown[0]), known)} (known "
                          f"here: {', '.join(sorted(known))})")
    values = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        values[name] = coerce(value, hints[name], key)
    return cls(**values)


def coerce(value: Any, hint: Any, key: str) -> Any:
    """`value` as the type `hint` the field declares, or one ConfigError naming `key`."""
    if dataclasses.is_dataclass(hint):
        return config_from_dict(value, hint, key)
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"config key '{key}' must be a list, got {shown(value)}")
        (item_hint,) = typing.get_args(hint)[:1]
        return [coerce(v, item_hint, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"internal: unsupported union type for '{key}'")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint in (int, float):
        number = coerce_number(value, hint, key)
        if number is not None:
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be str, got {shown(value)} (YAML reads "
                              "yes/no/on/off/true/false as booleans: quote the word, e.g. '\"off\"')")
    else:
        raise ConfigError(f"internal: unsupported type {hint!r} for '{key}'")
    raise ConfigError(f"config key '{key}' must be {hint.__name__}, got {shown(value)}")


def coerce_number(value: Any, hint: type, key: str) -> int | float | None:
    """An int or float knob's value, or None where it is not one (the caller names the type)."""
    if isinstance(value, str):  # YAML 1.1 reads `1e6` (no dot) as a string: accept it as a number
        try:
            value = float(value)
        except ValueError:
            return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    if not math.isfinite(value):  # YAML's .inf / .nan: a range check like `lr >= 0` would let inf pass
        raise ConfigError(f"config key '{key}' must be a finite number, got {shown(value)}")
    if hint is float:
        return float(value)
    return int(value) if float(value).is_integer() else None


def nearest_hint(name: str, known: Any) -> str:
    """"; did you mean 'x'?" for the closest known name (a typo's most likely target), or nothing."""
    import difflib

    close = difflib.get_close_matches(name, [str(k) for k in known], n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'seq_len': 32}} -> {'train.seq_len': 32}: the form compatibility checks compare."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out
