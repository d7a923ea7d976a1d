"""What the record's readers accept as a number: shared by the schema (record.py) and the event kinds
(events.py), which record.py builds on, so that both judge a value alike."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def is_finite_number(value: Any) -> bool:
    """A number a figure can be computed from: no bool, no NaN or infinity, and no integer beyond a float's
    range (math.isfinite would raise OverflowError on one: a forged record is judged, never a traceback)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def first_field(value: Any, matches: Callable[[Any], bool], where: str = "") -> str | None:
    """The dotted name (under `where`; a list's items by index) of the first value inside `value`, itself
    included, that `matches`, or None: how the record's and the lock's checks name the figure they refuse."""
    if matches(value):
        return where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = first_field(item, matches, f"{where}.{key}" if where else str(key))
        if found is not None:
            return found
    return None
