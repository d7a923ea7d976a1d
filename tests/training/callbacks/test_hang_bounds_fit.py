"""A fixed hang bound below an update the run has already taken would end every session hung after its first
updates with nothing saved, and a scheduler would requeue it for ever: `pilotrun train` refuses it (one line,
exit 2) before any set-up, as it refuses a deadline too close to train anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from pilotrun.training.callbacks.hang_watchdog import HangBounds, check_bounds_fit, slowest_recorded_update
from tests.report.synthetic import SyntheticRun

SMOKE = Path(__file__).resolve().parents[3] / "configs" / "smoke.yaml"


def recorded_run(run_dir: Path) -> float:
    run = SyntheticRun(run_dir)
    run.start_session()
    run.train_until(10)
    run.end_session("hung")
    run.write()
    slowest = slowest_recorded_update(run_dir)
    assert slowest is not None and slowest > 0
    return slowest


def test_a_bound_below_a_recorded_update_is_refused_and_one_above_is_not(tmp_path):
    slowest = recorded_run(tmp_path / "r")
    with pytest.raises(ValueError, match="below an update this run has taken"):
        check_bounds_fit(HangBounds(steady=slowest / 2), tmp_path / "r")
    check_bounds_fit(HangBounds(steady=slowest * 2), tmp_path / "r")
    check_bounds_fit(HangBounds(), tmp_path / "r")  # auto derives its bound from the measured stretches
    check_bounds_fit(HangBounds(steady=0.001), tmp_path / "new")  # nothing measured yet: nothing to compare


def test_train_refuses_it_in_one_line_before_any_set_up(tmp_path, capsys):
    recorded_run(tmp_path / "r")
    code = main(["train", "--config", str(SMOKE), "--data", str(tmp_path), "--run-dir", str(tmp_path / "r"),
                 "--resume", "auto", "--hang-timeout", "0.001"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(
        "pilotrun: error: --hang-timeout: the bound 0.001 s is below an update this run has"
    )
