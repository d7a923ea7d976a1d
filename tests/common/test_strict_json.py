"""common/strict_json.py: non-finite floats as strings, everything else as json.dumps writes it."""

import json
import math

import pytest

from pilotrun.common.strict_json import json_safe, strict_dumps


@pytest.mark.parametrize(("value", "said"),
                         [(math.inf, "Infinity"), (-math.inf, "-Infinity"), (math.nan, "NaN")])
def test_a_non_finite_float_is_a_string_at_any_depth(value, said):
    text = strict_dumps({"a": [value, (1.5, value)], 3: {"b": value}}, sort_keys=True)
    assert json.loads(text, parse_constant=pytest.fail) == {"a": [said, [1.5, said]], "3": {"b": said}}


def test_finite_values_are_written_as_json_dumps_writes_them():
    value = {"loss": 0.1 + 0.2, "tiny": 5e-324, "n": 10**20, "s": "Infinity", "none": None, "t": True}
    assert strict_dumps(value, indent=1) == json.dumps(value, indent=1)
    assert json_safe(value) == value

