"""Strict JSON for what pilotrun prints and its record: never a bare Infinity or NaN.

Python's json module writes a non-finite float as `Infinity`, `-Infinity` or `NaN`, which no strict JSON
parser reads (jq, JavaScript's JSON.parse, Go's encoding/json): a script reading `--json` output or a
record would fail on the very run that went wrong (a loss that overflowed, a mixture weight of 1e308).
Every `--json` output, the run record (run.json, metrics.jsonl) and the report's summary.json go through
`strict_dumps`: a non-finite float is said as the string "Infinity", "-Infinity" or "NaN" (the record's
readers turn them back, run/record.py `restore_nonfinite`), and `allow_nan=False` makes any value this
missed an error here rather than invalid JSON downstream.
"""

from __future__ import annotations

import json
import math
from typing import Any


def json_safe(value: Any) -> Any:
    """Recursively replace non-finite floats by strings and tuples by lists; everything else is kept.

    Finite floats are left as Python floats, whose JSON form (repr) round-trips exactly: the loss is
    written at full precision.
    """
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def strict_dumps(value: Any, **options: Any) -> str:
    """json.dumps of `value` with its non-finite floats as strings (`json_safe`), strict: `options` are
    json.dumps's own (indent, sort_keys, separators, default)."""
    return json.dumps(json_safe(value), allow_nan=False, **options)
