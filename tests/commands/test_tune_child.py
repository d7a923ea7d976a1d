"""The checks' shared branch process (commands/tune_child.py): each command line run in turn with its own log
and its own exit code, a crash ending only its own branch, as processes of their own would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pilotrun.commands import cli, tune_child


def _plan(tmp_path: Path, commands: dict[str, list[str]]) -> Path:
    plan = tmp_path / "shared.json"
    branches = [{"name": name, "words": words, "log": str(tmp_path / f"{name}.log")}
                for name, words in commands.items()]
    plan.write_text(json.dumps({"codes": str(tmp_path / "codes.json"), "branches": branches}))
    return plan


@pytest.mark.slow
def test_each_command_runs_in_turn_in_one_process_with_its_own_log_and_exit_code(tmp_path):
    plan = _plan(tmp_path, {"first": ["summarize", str(tmp_path / "no-such-run")], "second": ["--version"]})
    done = subprocess.run([sys.executable, "-m", "pilotrun.commands.tune_child", str(plan)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""
    assert json.loads((tmp_path / "codes.json").read_text()) == {"first": 2, "second": 0}
    assert "pilotrun: error:" in (tmp_path / "first.log").read_text()
    second = (tmp_path / "second.log").read_text()
    assert second.strip() and "pilotrun: error:" not in second


def test_a_command_that_raises_ends_only_its_own_branch(tmp_path, monkeypatch):
    def main(words):
        if words == ["crash"]:
            raise RuntimeError("a crash in the branch")
        print("trained")
        return 0

    monkeypatch.setattr(cli, "main", main)
    assert tune_child.run_plan(_plan(tmp_path, {"a": ["crash"], "b": ["train"]})) == 0
    assert json.loads((tmp_path / "codes.json").read_text()) == {"a": 1, "b": 0}
    crashed = (tmp_path / "a.log").read_text()
    assert "Traceback (most recent call last)" in crashed and "RuntimeError: a crash in the branch" in crashed
    assert (tmp_path / "b.log").read_text() == "trained\n"
