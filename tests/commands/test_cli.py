"""The command line: every documented command is listed, and bad input is one line with exit 2."""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pilotrun.commands.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_command(capsys):
    parser = build_parser()
    text = parser.format_help()
    for command in ("prepare", "data", "train", "inspect-batch", "summarize", "verdict", "pilot"):
        assert command in text


@pytest.mark.slow
def test_python_dash_m_matches_console_script(builtin_data_dir, tmp_path):
    """The same short training run through `python -m pilotrun` and through the installed `pilotrun` script:
    the same exit code, recipe and losses, bit for bit."""
    script = Path(sys.executable).with_name("pilotrun")
    if not script.is_file():
        script = Path(shutil.which("pilotrun") or "")
    assert script.is_file(), "the console script is installed beside the interpreter (pip install -e .)"
    smoke = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
    runs = {}
    for name, launcher in (("module", [sys.executable, "-m", "pilotrun"]), ("script", [str(script)])):
        run_dir = tmp_path / name
        result = subprocess.run(
            [
                *launcher,
                "train",
                "--config",
                str(smoke),
                "--data",
                str(builtin_data_dir),
                "--run-dir",
                str(run_dir),
                "--set",
                "train.num_threads=1",
                "--set",
                "train.max_steps=3",
            ],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        recipe = json.loads((run_dir / "run.json").read_text())["recipe"]
        runs[name] = (recipe, [(e["step"], e["loss"]) for e in events if e["event"] in ("train", "val")])
    assert runs["module"] == runs["script"]
    assert len(runs["module"][1]) >= 3


def test_bad_config_is_one_line_exit_2(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("train:\n  nonsense: 1\n")
    code = main(["train", "--config", str(config), "--data", str(tmp_path), "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("pilotrun: error: ")
    assert "Traceback" not in err
    assert "train.nonsense" in err


def test_config_says_what_train_would_say_about_the_schedule(capsys):
    assert main(["config", "--config", "stability", "--set", "train.max_steps=10"]) == 0
    err = capsys.readouterr().err
    assert "pilotrun config: warning: train.max_steps=10 < optim.schedule.horizon=240" in err


@pytest.mark.slow
def test_output_cut_short_by_its_reader_ends_quietly(tmp_path):
    """`pilotrun config | head -1`: the closed pipe is the reader's choice, not an error of pilotrun's."""
    import subprocess
    import sys

    done = subprocess.run(f"'{sys.executable}' -m pilotrun config --config stability | head -1; "
                          "echo \"rc=${PIPESTATUS[0]}\" >&2", shell=True, executable="/bin/bash",
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.stdout.count("\n") == 1
    assert done.stderr.strip() == "rc=0", done.stderr


# `python -m pilotrun ARGS` in a child where importing torch (or numpy) fails: the help of every command is
# argument parsing alone, which a machine without the training stack (or a shell completing a command) can
# afford.
WITHOUT_HEAVY_IMPORTS = """
import runpy, sys
BLOCKED = ("torch", "numpy")
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{name} imported while printing help")
assert not [name for name in sys.modules if name.partition(".")[0] in BLOCKED]
sys.meta_path.insert(0, Refuse())
sys.argv = ["pilotrun", *sys.argv[1:]]
runpy.run_module("pilotrun", run_name="__main__", alter_sys=True)
"""


def _commands(parser) -> list[list[str]]:
    """Every command and subcommand as the words that name it, read from the parser itself."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append([name])
                found += [[name, *rest] for rest in _commands(sub)]
    return found


COMMANDS = _commands(build_parser())


def test_every_command_is_found_for_the_help_test():
    assert {"train", "pilot", "verdict", "watch", "export", "config"} <= {words[0] for words in COMMANDS}
    assert ["data", "verify"] in COMMANDS and ["data", "merge"] in COMMANDS


@pytest.mark.slow
@pytest.mark.parametrize("words", [[], *COMMANDS], ids=lambda words: " ".join(words) or "pilotrun")
def test_help_needs_neither_torch_nor_numpy(words):
    result = subprocess.run([sys.executable, "-c", WITHOUT_HEAVY_IMPORTS, *words, "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"usage: {' '.join(['pilotrun', *words])} "), result.stdout[:300]
    assert result.stderr == ""
