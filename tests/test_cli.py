"""The command line: every DESIGN.md command is listed, and bad input is one line with exit 2."""

import subprocess
import sys

from pilotrun.cli import build_parser, main


def test_help_lists_every_command(capsys):
    parser = build_parser()
    text = parser.format_help()
    for command in ("prepare", "data", "train", "inspect-batch", "summarize", "verdict", "pilot"):
        assert command in text


def test_python_dash_m_matches_console_script():
    result = subprocess.run([sys.executable, "-m", "pilotrun", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "summarize" in result.stdout


def test_bad_config_is_one_line_exit_2(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("train:\n  nonsense: 1\n")
    code = main(["train", "--config", str(config), "--data", str(tmp_path), "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("pilotrun: error: ")
    assert "Traceback" not in err
    assert "train.nonsense" in err
