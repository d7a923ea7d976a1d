"""Every command pilotrun prints for the user to run next runs as printed and continues the same recipe."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import threading
import time
from pathlib import Path

import pytest

from pilotrun.commands.cli import build_parser, main
from pilotrun.commands.next_commands import long_run_commands, resume_command
from pilotrun.run.record import read_metrics_tolerant, read_run_json

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "configs" / "smoke.yaml")


def printed_commands(text: str) -> list[list[str]]:
    """Each `pilotrun ...` quoted in backticks, as the words a shell would pass."""
    return [shlex.split(found) for found in re.findall(r"`(pilotrun [^`]*)`", text)]


def run_printed(words: list[str]) -> int:
    assert words[0] == "pilotrun", words
    return main(words[1:])


def test_a_resume_command_repeats_the_recipe_flags_and_drops_what_was_for_one_session():
    args = build_parser().parse_args(
        [
            "train",
            "--config",
            "my recipe.yaml",
            "--data",
            "d",
            "--run-dir",
            "r",
            "--set",
            "train.max_steps=80",
            "--set",
            "optim.schedule.horizon=80",
            "--allow-change",
            "optim.muon.lr",
            "--from-step",
            "3",
            "--stop-by",
            "2h",
        ]
    )
    words = shlex.split(resume_command(args))
    assert words == [
        "pilotrun",
        "train",
        "--config",
        "my recipe.yaml",
        "--data",
        "d",
        "--run-dir",
        "r",
        "--set",
        "train.max_steps=80",
        "--set",
        "optim.schedule.horizon=80",
        "--stop-by",
        "2h",
        "--resume",
    ]
    frozen = build_parser().parse_args(
        [
            "train",
            "--frozen",
            "l.json",
            "--data",
            "d",
            "--run-dir",
            "r",
            "--set",
            "train.max_steps=9",
            "--allow-change",
            "train.max_steps",
            "--resume",
            "auto",
        ]
    )
    assert shlex.split(resume_command(frozen))[3:] == [
        "l.json",
        "--data",
        "d",
        "--run-dir",
        "r",
        "--set",
        "train.max_steps=9",
        "--allow-change",
        "train.max_steps",
        "--resume",
        "auto",
    ]
    train, watch = long_run_commands("a lock.json", "data/edu", "runs/long")
    assert shlex.split(train) == [
        "pilotrun",
        "train",
        "--frozen",
        "a lock.json",
        "--data",
        "data/edu",
        "--run-dir",
        "runs/long",
        "--resume",
        "auto",
    ]
    assert shlex.split(watch) == ["pilotrun", "watch", "runs/long", "--against", "a lock.json", "--follow"]


def _stop_after_first_checkpoint(run_dir: Path) -> threading.Thread:
    """SIGTERM to this process once the run has committed a checkpoint (the train command's handler stops it
    after the update in flight, with a checkpoint, exit 143)."""
    def watch() -> None:
        deadline = time.monotonic() + 300  # a hang guard, not a timing assertion
        while time.monotonic() < deadline:
            if (run_dir / "metrics.jsonl").is_file() and any(
                    e.get("event") == "checkpoint" for e in read_metrics_tolerant(run_dir).events):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_the_printed_resume_freeze_long_run_and_watch_commands_run_as_printed(
    builtin_data_dir, tmp_path, capsys
):
    run_dir = tmp_path / "my run"
    recipe = [
        "--set",
        "train.num_threads=1",
        "--set",
        "train.max_steps=60",
        "--set",
        "optim.schedule.horizon=60",
        "--set",
        "train.checkpoint_every=2",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.log_every=2",
    ]
    thread = _stop_after_first_checkpoint(run_dir)
    code = main(
        ["train", "--config", SMOKE, "--data", str(builtin_data_dir), "--run-dir", str(run_dir), *recipe]
    )
    thread.join()
    err = capsys.readouterr().err
    assert code == 143, err[-2000:]
    (resume,) = printed_commands(err.splitlines()[-1])
    assert all(word in resume for word in recipe)  # every --set the run was started with
    assert run_printed(resume) == 0, capsys.readouterr().err[-2000:]  # not refused: the same recipe continues
    run = read_run_json(run_dir)
    assert run["recipe"]["optim"]["schedule"]["horizon"] == 60 and not run.get("allowed_changes")
    assert [e["reason"] for e in read_metrics_tolerant(run_dir).events if e["event"] == "session_end"] == \
        ["interrupted", "completed"]

    capsys.readouterr()
    lock = tmp_path / "lock.json"
    assert main(["freeze", str(run_dir), "--out", str(lock), "--despite-no-go"]) == 0
    long_run, watch = printed_commands(capsys.readouterr().out)
    long_dir = Path(long_run[long_run.index("--run-dir") + 1])
    # runs/long, here inside the test's folder
    long_run[long_run.index("--run-dir") + 1] = str(tmp_path / "long")
    watch[2] = str(tmp_path / "long")
    assert long_dir == Path("runs/long") and long_run[long_run.index("--data") + 1] == str(builtin_data_dir)
    assert run_printed(long_run) == 0
    assert run_printed(long_run) == 0  # the same line again: the run is complete, nothing to do
    # it watched: healthy, or an alert (this tiny recipe clips every update)
    assert run_printed(watch) in (0, 1)
    assert "error" not in capsys.readouterr().err

    # A frozen run resumed with the command that started it says nothing about an --allow-change that only the
    # lock's comparison uses.
    frozen = [
        "train",
        "--frozen",
        str(lock),
        "--data",
        str(builtin_data_dir),
        "--run-dir",
        str(tmp_path / "f"),
        "--set",
        "train.max_steps=62",
        "--allow-change",
        "train.max_steps",
        "--set",
        "train.num_threads=1",
    ]
    assert main(frozen) == 0
    capsys.readouterr()
    assert main([*frozen, "--resume", "auto"]) == 0
    assert main([*frozen, "--set", "train.max_steps=64", "--resume"]) == 0
    assert "no such difference" not in capsys.readouterr().err
    assert json.loads((tmp_path / "f" / "run.json").read_text())["recipe"]["train"]["max_steps"] == 64


def test_the_long_run_command_has_the_projected_length_and_the_horizon_where_the_recipe_ties_them():
    def lock(target, steps, horizon):
        return {"projection": {"target_steps": target},
                "recipe": {"train": {"max_steps": steps}, "optim": {"schedule": {"horizon": horizon}}}}

    train, _ = long_run_commands("l.json", "d", "runs/long", lock_content=lock(2000, 200, 200))
    assert shlex.split(train)[8:] == ["--set", "train.max_steps=2000", "--set", "optim.schedule.horizon=2000",
                                      "--allow-change", "train.max_steps", "--allow-change",
                                      "optim.schedule.horizon", "--resume", "auto"]
    train, _ = long_run_commands("l.json", "d", "runs/long", lock_content=lock(2000, 200, 5000))
    assert shlex.split(train)[8:] == ["--set", "train.max_steps=2000", "--allow-change", "train.max_steps",
                                      "--resume", "auto"]  # an untied horizon past N is the recipe's own
    train, _ = long_run_commands("l.json", "d", "runs/long", lock_content=lock(2000, 200, 1000))
    assert "optim.schedule.horizon=2000" in shlex.split(train)  # one that would end before the run does not
    for same in (lock(200, 200, 200), {"recipe": {"train": {"max_steps": 200}}}):
        assert shlex.split(long_run_commands("l.json", "d", lock_content=same)[0])[8:] == ["--resume", "auto"]
