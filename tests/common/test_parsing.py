"""The bounded readers: whatever bytes a file holds, a reader answers with its value or one PilotrunError
line; never a traceback of another type, never a long echo of the bad value."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotrun.common.errors import ConfigError, PilotrunError
from pilotrun.common.parsing import (
    MAX_DEPTH,
    nesting_depth,
    parse_json_text,
    parse_yaml_text,
    read_json_file,
    shown,
)
from pilotrun.config import load_run_config, parse_override

BILLION_LAUGHS = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"] +
                           [f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
                            f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]"
                            for i in range(8)])


def one_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message and len(message) < 400, message
    return message


@pytest.mark.parametrize("text, fragment", [
    ("[" * 200_000, "nested deeper"),
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "nested deeper than 100 levels"),
    ("1" * 10_000, "not valid JSON"),
    ('{"a": ', "not valid JSON"),
])
def test_json_that_no_reader_should_follow_is_one_line(text, fragment):
    with pytest.raises(PilotrunError) as refused:
        parse_json_text(text, "run.json")
    assert fragment in one_line(refused.value) and one_line(refused.value).startswith("run.json: ")


def test_json_files_bounded_in_size_and_encoding(tmp_path):
    path = tmp_path / "metadata.json"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(PilotrunError, match=r"not UTF-8 text \(byte 0xff at offset 7\)"):
        read_json_file(path)
    path.write_text(json.dumps({"x": "y" * 100}))
    with pytest.raises(PilotrunError, match="larger than 50 bytes"):
        read_json_file(path, max_bytes=50)
    with pytest.raises(PilotrunError, match="is a folder, not a file"):
        read_json_file(tmp_path)
    assert read_json_file(path) == {"x": "y" * 100}


def test_yaml_aliases_are_refused_before_anything_expands():
    with pytest.raises(ConfigError) as refused:
        parse_yaml_text(BILLION_LAUGHS, "recipe.yaml")
    assert "aliases (*name) are not accepted" in one_line(refused.value)


def test_deep_yaml_and_long_integers_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="nested deeper"):
        parse_yaml_text("[" * 100_000, "recipe.yaml")
    with pytest.raises(ConfigError) as refused:
        parse_override("train.max_steps=" + "9" * 10_000)
    assert one_line(refused.value).startswith("--set train.max_steps: ")
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(BILLION_LAUGHS.replace("a: &a", "train: {}\na: &a"))
    with pytest.raises(ConfigError, match="aliases"):
        load_run_config(recipe)


def test_a_refusal_shows_a_short_prefix_of_a_long_value():
    with pytest.raises(ConfigError) as refused:
        load_run_config(None, ["train.seq_len=" + "x" * 100_000])
    assert "more characters" in one_line(refused.value)
    assert shown("abc") == "abc" and shown("a" * 100, 10) == "aaaaaaaaaa... (90 more characters)"


def test_nesting_depth_counts_without_recursion():
    deep: list = []
    node = deep
    for _ in range(50_000):
        node.append([])
        node = node[0]
    assert nesting_depth(deep) == MAX_DEPTH + 1  # stopped just past the limit
    assert nesting_depth({"a": [1, {"b": 2}]}) == 3 and nesting_depth(7) == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_give_a_value_or_one_line_from_every_reader(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("p") / "file"
    path.write_bytes(raw)
    for read in (lambda: read_json_file(path),
                 lambda: parse_yaml_text(raw.decode("utf-8", errors="replace"), "f.yaml")):
        try:
            read()
        except PilotrunError as error:
            one_line(error)


def test_terminal_safe_escapes_what_a_terminal_would_act_on_and_keeps_lines_and_tabs():
    from pilotrun.common.parsing import terminal_safe

    assert terminal_safe("a\x1b[2Jb\nc\td\x07\x7f\x9b\u202e é") == "a\\x1b[2Jb\nc\td\\x07\\x7f\\x9b\\u202e é"


def test_one_line_escapes_newlines_and_tabs_as_well_as_what_a_terminal_acts_on():
    from pilotrun.common.parsing import one_line

    assert one_line("a\nb\tc\x1b[2J\x07") == "a\\nb\\tc\\x1b[2J\\x07"
    assert one_line("plain text") == "plain text"


def test_printable_lines_keeps_each_line_one_line():
    from pilotrun.common.parsing import printable_lines

    text = printable_lines(["run r: INVALID", "session s\nrun r: VALID\x1b[2J", "tab\there"])
    assert text.split("\n") == ["run r: INVALID", "session s\\nrun r: VALID\\x1b[2J", "tab\\there"]
