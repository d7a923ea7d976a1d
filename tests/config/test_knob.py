"""A knob carries its meaning, its single-key rules and what a resume may do with it; the rules give one line
naming the key."""

from dataclasses import dataclass, field

import pytest

from pilotrun.common.errors import ConfigError
from pilotrun.config.knob import bounds_phrase, check_knob, check_knobs, keys_on_resume, knob


@dataclass
class Inner:
    names: list[str] = knob(meaning="some names", factory=list, choices=("a", "b"), unique=True,
                            on_resume="machine")


@dataclass
class Outer:
    size: int = knob(1, "a size", at_least=1)
    rate: float = knob(0.5, "a rate", at_least=0, below=1, on_resume="free")
    width: int = knob(2, "a width", above=0, even=True)
    pair: list[float] = knob(meaning="a pair", factory=lambda: [0.1, 0.2], length=2, at_least=0)
    mode: str = knob("x", "a mode", choices=("x", "y"), check=lambda v: None if v != "y" else "may not be y")
    inner: Inner = field(default_factory=Inner)


def test_a_knob_keeps_its_meaning_and_rules_and_says_recipe_unless_told():
    fields = Outer.__dataclass_fields__
    assert fields["size"].metadata["meaning"] == "a size" and fields["size"].metadata["at_least"] == 1
    assert fields["size"].metadata["on_resume"] == "recipe"
    assert "choices" not in fields["size"].metadata and "even" not in fields["size"].metadata
    assert keys_on_resume(Outer(), ("machine",)) == ("inner.names",)
    assert keys_on_resume(Outer(), ("machine", "free")) == ("rate", "inner.names")
    assert keys_on_resume(Outer(), ("recipe",)) == ("size", "width", "pair", "mode")
    with pytest.raises(ValueError, match="on_resume"):
        knob(0, "x", on_resume="sometimes")


@pytest.mark.parametrize(("rules", "phrase"), [
    ({"at_least": 1}, ">= 1"), ({"above": 0}, "positive"), ({"above": 2}, "> 2"), ({"at_most": 3}, "<= 3"),
    ({"below": 1}, "< 1"), ({"at_least": 0, "below": 1}, "in [0, 1)"),
    ({"above": 0, "at_most": 1}, "in (0, 1]"),
    ({}, None),
])
def test_bounds_are_said_in_words(rules, phrase):
    assert bounds_phrase(rules) == phrase


@pytest.mark.parametrize(("change", "message"), [
    ({"size": 0}, "size must be >= 1, got 0"),
    ({"rate": 1.0}, "rate must be in [0, 1), got 1.0"),
    ({"width": 0}, "width must be positive, got 0"),
    ({"width": 3}, "width must be even, got 3"),
    ({"pair": [0.1]}, "pair must hold 2 items, got [0.1]"),
    ({"pair": [0.1, -1.0]}, "pair[1] must be >= 0, got -1.0"),
    ({"mode": "z"}, "mode must be one of ('x', 'y'), got 'z'"),
    ({"mode": "y"}, "mode may not be y, got 'y'"),
])
def test_a_value_outside_its_knob_is_one_line_naming_the_key(change, message):
    config = Outer(**change)
    with pytest.raises(ConfigError) as refused:
        check_knobs(config)
    assert str(refused.value) == message


def test_a_list_of_names_is_checked_by_item_and_for_repeats():
    with pytest.raises(ConfigError) as refused:
        check_knobs(Outer(inner=Inner(names=["a", "c"])))
    assert str(refused.value) == "inner.names: unknown name 'c' (known: a, b)"
    with pytest.raises(ConfigError) as refused:
        check_knobs(Outer(inner=Inner(names=["a", "a"])))
    assert str(refused.value) == "inner.names names a name twice: ['a', 'a']"
    check_knobs(Outer(inner=Inner(names=["b", "a"])))
    check_knob("free", 5, {})  # a knob without rules takes any value of its type
