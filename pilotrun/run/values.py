"""What the record's readers accept as a number: shared by the schema (record.py) and the event kinds
(events.py), which record.py builds on, so that both judge a value alike."""

from __future__ import annotations

import math
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
