"""The command line: every documented command is listed, and bad input is one line with exit 2."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from pilotrun.commands.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_command(capsys):
    parser = build_parser()
    text = parser.format_help()
    for command in ("prepare", "data", "train", "inspect-batch", "summarize", "verdict", "pilot"):
        assert command in text


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
        result = subprocess.run([*launcher, "train", "--config", str(smoke), "--data", str(builtin_data_dir),
                                 "--run-dir", str(run_dir), "--set", "train.num_threads=1", "--set", "train.max_steps=3"],
                                capture_output=True, text=True)
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


def test_output_cut_short_by_its_reader_ends_quietly(tmp_path):
    """`pilotrun config | head -1`: the closed pipe is the reader's choice, not an error of pilotrun's."""
    import subprocess
    import sys

    done = subprocess.run(f"'{sys.executable}' -m pilotrun config --config stability | head -1; "
                          "echo \"rc=${PIPESTATUS[0]}\" >&2", shell=True, executable="/bin/bash",
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.stdout.count("\n") == 1
    assert done.stderr.strip() == "rc=0", done.stderr
