"""The tracker commands through the command line: a finished run into TensorBoard by either command, one
summary line each, and refusals before anything is written."""

from __future__ import annotations

import pytest

from pilotrun.commands.cli import main
from tests.report.synthetic import crashed_and_resumed

pytest.importorskip("tensorboard")


def test_tensorboard_and_export_metrics_write_the_same_kept_scalars(tmp_path, capsys):
    from tests.run.test_tracker_tensorboard import scalars

    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    assert main(["tensorboard", str(tmp_path / "r"), "--out", str(tmp_path / "a")]) == 0
    assert (
        main(["export-metrics", str(tmp_path / "r"), "--to", "tensorboard", "--out", str(tmp_path / "b")])
        == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("tensorboard: ") and " scalars" in out[-1]
    a, b = scalars(tmp_path / "a"), scalars(tmp_path / "b")
    # each step once
    assert a == b and [s for s, _ in a["train/loss"]] == sorted({s for s, _ in a["train/loss"]})


def test_the_tensorboard_command_is_an_alias_of_export_metrics_to_tensorboard(capsys):
    from pilotrun.commands.cli import build_parser

    parser = build_parser()
    for extra in ([], ["--out", "tb", "--force"]):
        alias = parser.parse_args(["tensorboard", "r", *extra])
        export = parser.parse_args(["export-metrics", "r", "--to", "tensorboard", *extra])
        assert vars(alias) == vars(export)  # the same command, tracker, folder, flags and handler
    assert main(["tensorboard", "--help"]) == 0
    shown = "".join(capsys.readouterr().out.split())  # argparse wraps at any space or hyphen
    assert (
        "Analias:`pilotruntensorboardR[--outDIR][--force]`is`pilotrunexport-metricsR--totensorboard" in shown
    )


def test_an_unknown_tracker_is_refused_by_the_parser(tmp_path, capsys):
    assert main(["export-metrics", str(tmp_path), "--to", "neptune"]) == 2
    assert "invalid choice: 'neptune'" in capsys.readouterr().err
