"""A knob: one config field that carries its meaning, its single-key checks and what a resume may do with it.

`knob(default, meaning, choices=..., at_least=..., on_resume=...)` is a dataclass field whose metadata the
rest of the config reads: `pilotrun config` prints the meaning, `check_knobs` refuses a value outside the
knob's own bounds with one line naming the key, and `keys_on_resume` lists the keys a resume may change.
Rules that relate two keys (top_k against n_routed_experts) stay with the section's cross-key rules.

`on_resume` says what a resume may do with the key:
- "recipe" (the default, the safe side): part of the recipe; a change on resume is refused unless named with
  --allow-change, and a frozen lock compares it;
- "free": may change on resume without ceremony (cadence, a longer max_steps), yet the lock compares it;
- "machine": a setting of the machine or of who watches, never of what an update computes: free on resume
  and outside a lock's comparison.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from pilotrun.common.errors import ConfigError

ON_RESUME = ("recipe", "free", "machine")
RULE_NAMES = ("choices", "at_least", "above", "at_most", "below", "even", "length", "unique", "check")


def knob(default: Any = dataclasses.MISSING, meaning: str = "", *, factory: Any = dataclasses.MISSING,
         choices: tuple[str, ...] | None = None, at_least: float | None = None, above: float | None = None,
         at_most: float | None = None, below: float | None = None, even: bool = False,
         length: int | None = None, unique: bool = False, check: Callable[[Any], str | None] | None = None,
         on_resume: str = "recipe") -> Any:
    """A config field with its one-line meaning and its single-key rules kept beside it.

    The bounds and `choices` apply to each item of a list; `length` and `unique` to the list itself; `check`
    takes the value and returns what is wrong with it (a phrase after the key), or None."""
    if on_resume not in ON_RESUME:
        raise ValueError(f"on_resume must be one of {ON_RESUME}, got {on_resume!r}")
    given = dict(choices=choices, at_least=at_least, above=above, at_most=at_most, below=below, even=even,
                 length=length, unique=unique, check=check)
    rules = {name: value for name, value in given.items() if value is not None and value is not False}
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={"meaning": meaning, "on_resume": on_resume, **rules})


def bounds_phrase(rules: dict[str, Any]) -> str | None:
    """'>= 1', 'positive', 'in [0, 1)' for a knob's bounds; None when it has none."""
    low = ("[", rules["at_least"]) if "at_least" in rules else ("(", rules.get("above"))
    high = ("]", rules["at_most"]) if "at_most" in rules else (")", rules.get("below"))
    low, high = (low if low[1] is not None else None), (high if high[1] is not None else None)
    if low and high:
        return f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low:
        return "positive" if low == ("(", 0) else f"{'>=' if low[0] == '[' else '>'} {low[1]}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {high[1]}"
    return None


def within_bounds(value: Any, rules: dict[str, Any]) -> bool:
    return (value >= rules.get("at_least", value) and value <= rules.get("at_most", value)
            and ("above" not in rules or value > rules["above"])
            and ("below" not in rules or value < rules["below"]))


def check_value(key: str, value: Any, rules: dict[str, Any]) -> None:
    """One scalar (or one item of a list knob) against the knob's choices, bounds and evenness."""
    choices = rules.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key} must be one of {choices}, got '{value}'")
    phrase = bounds_phrase(rules)
    if phrase is not None and not within_bounds(value, rules):
        raise ConfigError(f"{key} must be {phrase}, got {value}")
    if rules.get("even") and value % 2 != 0:
        raise ConfigError(f"{key} must be even, got {value}")


def check_list(key: str, value: list[Any], rules: dict[str, Any]) -> None:
    """A list knob: its length and uniqueness, then each item; a list of names is named by its noun."""
    noun = key.rsplit(".", 1)[-1].removesuffix("s")
    if "length" in rules and len(value) != rules["length"]:
        raise ConfigError(f"{key} must hold {rules['length']} items, got {value}")
    if rules.get("unique") and len(set(map(str, value))) != len(value):
        raise ConfigError(f"{key} names a {noun} twice: {value}")
    choices = rules.get("choices")
    for index, item in enumerate(value):
        if choices is not None and item not in choices:
            raise ConfigError(f"{key}: unknown {noun} '{item}' (known: {', '.join(choices)})")
        check_value(f"{key}[{index}]", item, rules)


def check_knob(key: str, value: Any, rules: dict[str, Any]) -> None:
    """`value` of the config key `key` against its knob's rules (the field's metadata)."""
    if isinstance(value, list):
        check_list(key, value, rules)
    else:
        check_value(key, value, rules)
    problem = rules["check"](value) if "check" in rules else None
    if problem is not None:
        raise ConfigError(f"{key} {problem}, got {value if isinstance(value, list) else repr(value)}")


def knob_fields(config: Any, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field]]:
    """(dotted key, value, field) of every leaf of a config dataclass, nested sections walked, in order."""
    for f in dataclasses.fields(config):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            yield from knob_fields(value, key)
        else:
            yield key, value, f


def check_knobs(config: Any, prefix: str = "") -> None:
    """Every leaf of `config` against its own knob's rules; the first value outside them: one ConfigError."""
    for key, value, f in knob_fields(config, prefix):
        check_knob(key, value, {name: f.metadata[name] for name in RULE_NAMES if name in f.metadata})


def need(condition: bool, message: str) -> None:
    """A cross-key rule: `message` as one ConfigError where `condition` fails."""
    if not condition:
        raise ConfigError(message)


def keys_on_resume(config: Any, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The dotted keys whose knob says `on_resume` is one of `kinds` (a knob that says nothing: "recipe")."""
    return tuple(key for key, _, f in knob_fields(config) if f.metadata.get("on_resume", "recipe") in kinds)
