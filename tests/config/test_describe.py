"""`pilotrun config`: every key described from the dataclass fields, validated, and recipes found by name."""

import argparse
import json
import os

import pytest

from pilotrun.commands import cli
from pilotrun.common.errors import ConfigError
from pilotrun.config import RunConfig, packaged_configs_dir, resolve_recipe_path
from pilotrun.config.describe import describe_config


def test_every_config_key_has_a_meaning_and_a_type():
    rows = describe_config(RunConfig())
    assert len(rows) > 60
    assert [r["key"] for r in rows if not r["meaning"].strip()] == []
    assert {r["type"] for r in rows} <= {
        "int",
        "float",
        "str",
        "bool",
        "list[float]",
        "list[int]",
        "list[str]",
        "list[list[int]]",
    }
    assert len({r["key"] for r in rows}) == len(rows)


def test_config_command_json_shows_value_and_default(capsys):
    code = cli.main(["config", "--config", "stability", "--set", "train.max_steps=7", "--json"])
    assert code == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["train.max_steps"]["value"] == 7
    assert rows["train.max_steps"]["default"] == 100
    assert rows["train.max_steps"]["type"] == "int"
    assert rows["optim.schedule.horizon"]["meaning"]


@pytest.mark.parametrize(
    "argv",
    [
        ["config", "--set", "train.max_steps=x"],
        ["config", "--set", "train.nope=1"],
        ["config", "--config", "no-such-recipe"],
        ["config", "--set", "train.seq_len=0"],
    ],
)
def test_config_command_refuses_bad_input_with_one_line(argv, capsys):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1


def test_packaged_recipes_resolve_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stability = packaged_configs_dir() / "stability.yaml"
    assert resolve_recipe_path("stability") == stability
    assert resolve_recipe_path("stability.yaml") == stability
    assert resolve_recipe_path("configs/stability.yaml") == stability
    assert resolve_recipe_path("gpu/stability") == packaged_configs_dir() / "gpu" / "stability.yaml"
    own = tmp_path / "stability"
    own.write_text("train: {max_steps: 3}\n")
    # a real file always wins over a packaged name
    assert resolve_recipe_path("stability").resolve() == own.resolve()
    with pytest.raises(ConfigError, match="packaged recipes by name"):
        resolve_recipe_path(os.path.join("missing", "x.yaml"))


def test_every_option_with_a_default_shows_it_in_help():
    parser = cli.build_parser()
    formatter = cli._DefaultsHelpFormatter("pilotrun")
    checked = 0
    stack = [parser]
    while stack:
        current = stack.pop()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
            elif (
                action.option_strings
                and not any(action.default is v for v in (None, argparse.SUPPRESS, False))
                and action.default != []
            ):
                assert "%(default)" in formatter._get_help_string(action), action.option_strings
                checked += 1
    assert checked >= 10
