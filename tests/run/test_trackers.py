"""pilotrun/run/trackers.py: every registered tracker, each registered whole (its own module, its packages, a
description and an opener), in agreement with config.TRACKER_NAMES; and the package check, the dispatch and
the command line's choices all reading the one table, so a tracker added there is reached everywhere."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pilotrun import config
from pilotrun.common.errors import ConfigError
from pilotrun.run import sinks, trackers
from pilotrun.run.trackers import TRACKERS, Tracker

RUN_FOLDER = Path(trackers.__file__).parent


def half_registrations() -> list[str]:
    """What a tracker's registration lacks: a module of its own, the packages its extra installs, a one-line
    description, an opener; and any disagreement with the names config validates `train.trackers` against."""
    found = []
    for name, tracker in trackers.TRACKERS.items():
        if tracker.name != name:
            found.append(f"{name}: registered under another name ({tracker.name})")
        if not (RUN_FOLDER / f"tracker_{name}.py").is_file():
            found.append(f"{name}: no module run/tracker_{name}.py")
        if not tracker.packages or not all(isinstance(p, str) and p for p in tracker.packages):
            found.append(f"{name}: no packages named for its extra")
        description = tracker.description
        if not isinstance(description, str) or not description.strip() or "\n" in description:
            found.append(f"{name}: no one-line description")
        if not callable(tracker.open):
            found.append(f"{name}: no opener")
    if tuple(trackers.TRACKERS) != tuple(config.TRACKER_NAMES):
        found.append(f"the registry {tuple(trackers.TRACKERS)} and config.TRACKER_NAMES "
                     f"{config.TRACKER_NAMES} differ")
    return found


def test_every_tracker_is_registered_whole():
    assert tuple(TRACKERS) == ("tensorboard", "wandb", "mlflow", "trackio")
    assert [t.packages for t in TRACKERS.values()] == [("tensorboard",), ("wandb",),
                                                       ("mlflow", "sqlalchemy", "alembic"), ("trackio",)]
    assert half_registrations() == []


def test_a_half_registered_tracker_is_named(monkeypatch):
    planted = {**TRACKERS, "neptune": Tracker("neptune", (), "", None)}
    monkeypatch.setattr(trackers, "TRACKERS", planted)
    problems = half_registrations()
    assert "neptune: no module run/tracker_neptune.py" in problems
    assert "neptune: no packages named for its extra" in problems
    assert "neptune: no one-line description" in problems and "neptune: no opener" in problems
    assert any("config.TRACKER_NAMES" in p for p in problems)


def test_an_unknown_tracker_is_one_line_naming_the_registered_ones():
    known = r"\(known: tensorboard, wandb, mlflow, trackio\)$"
    with pytest.raises(ConfigError, match=r"^train\.trackers: unknown tracker 'neptune' " + known):
        sinks.check_trackers_available(["neptune"])
    with pytest.raises(ConfigError, match=r"^unknown tracker 'neptune' " + known):
        sinks.open_tracker("neptune", "run")


def test_a_registered_tracker_is_reached_by_the_check_the_dispatch_and_the_command_line(monkeypatch, tmp_path,
                                                                                       capsys):
    opened = []
    planted = dataclasses.replace(TRACKERS["wandb"], name="plain", packages=("json",),
                                  description="a test mirror",
                                  open=lambda run_dir, log_dir: opened.append((run_dir, log_dir)) or "mirror")
    monkeypatch.setattr(trackers, "TRACKERS", {**TRACKERS, "plain": planted})
    sinks.check_trackers_available(["plain"])  # its package (json) is there
    assert sinks.open_tracker("plain", tmp_path) == "mirror" and opened == [(tmp_path, None)]
    from pilotrun.commands.cli import build_parser, main

    assert build_parser().parse_args(["export-metrics", "r", "--to", "plain"]).to == ["plain"]
    assert main(["export-metrics", "--help"]) == 0
    assert "plain (a test mirror)" in " ".join(capsys.readouterr().out.split())
