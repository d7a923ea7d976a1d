"""`pilotrun train`'s last line after a stop: it says whether the work was saved. A second signal stops at
once without the checkpoint the first asked for, and the line says so (training/signals.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import pilotrun.training.trainer as trainer_module
from pilotrun.commands.cli import main
from pilotrun.training.signals import SecondSignal

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"


@pytest.mark.parametrize(
    "requests, said",
    [
        (1, "pilotrun train: stopped with a committed checkpoint; continue the run with `"),
        (
            2,
            "pilotrun train: stopped at once by a second signal, without saving the work since the last "
            "checkpoint; "
            "continue the run with `",
        ),
    ],
)
def test_the_last_line_says_whether_the_stop_saved(tmp_path, monkeypatch, capsys, requests, said):
    def stopped(*args, signals, **kwargs):
        try:
            for _ in range(requests):
                signals.request(signal.SIGINT)
        except SecondSignal as second:
            return signals.exit_code(second.signum)
        return signals.exit_code(signal.SIGINT)

    monkeypatch.setattr(trainer_module, "train_from_cli", stopped)
    monkeypatch.delenv("RANK", raising=False)
    code = main(
        ["train", "--config", str(SMOKE), "--data", str(tmp_path), "--run-dir", str(tmp_path / "run")]
    )
    assert code == 130
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(said)
