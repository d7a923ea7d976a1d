"""A fixed hang bound below an update the run has already taken (or a start-up bound below a set-up it has
taken) would end every session hung with nothing saved, and a scheduler would requeue it for ever: `pilotrun
train` refuses it (one line, exit 2) before any set-up, as it refuses a deadline too close to train anything.
With nothing recorded, a bound below its stated floor is refused the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from pilotrun.run.start_costs import read_start_costs
from pilotrun.training.callbacks.hang_watchdog import (
    STARTUP_FLOOR_SECONDS,
    STEADY_FLOOR_SECONDS,
    HangBounds,
    check_bounds_fit,
)
from tests.report.synthetic import SyntheticRun


def slowest_recorded_update(run_dir: Path) -> float | None:
    return max(read_start_costs(run_dir).seconds_per_update, default=None)


def fits(bounds: HangBounds, run_dir: Path) -> None:
    """check_bounds_fit against the run folder's record."""
    check_bounds_fit(bounds, read_start_costs(run_dir))


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
        fits(HangBounds(steady=slowest / 2), tmp_path / "r")
    fits(HangBounds(steady=slowest * 2), tmp_path / "r")
    fits(HangBounds(), tmp_path / "r")  # auto derives its bound from the measured stretches
    # nothing measured yet: the floor stands for the update (this was accepted before the floor)
    with pytest.raises(ValueError, match="has recorded no update to measure it against"):
        fits(HangBounds(steady=0.001), tmp_path / "new")


def test_train_refuses_it_in_one_line_before_any_set_up(tmp_path, capsys):
    recorded_run(tmp_path / "r")
    code = main(["train", "--config", str(SMOKE), "--data", str(tmp_path), "--run-dir", str(tmp_path / "r"),
                 "--resume", "auto", "--hang-timeout", "0.001"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(
        "pilotrun: error: --hang-timeout: the bound 0.001 s is below an update this run has"
    )


def test_a_start_up_bound_below_a_recorded_set_up_is_refused(tmp_path):
    recorded_run(tmp_path / "r")
    setups = read_start_costs(tmp_path / "r").setup_seconds
    assert len(setups) == 1 and setups[0] > 0
    slowest = slowest_recorded_update(tmp_path / "r")
    with pytest.raises(ValueError, match="start-up bound .* is below a set-up this run has taken"):
        fits(HangBounds(steady=slowest * 2, startup=setups[0] / 2), tmp_path / "r")
    fits(HangBounds(steady=slowest * 2, startup=setups[0] * 2), tmp_path / "r")


def test_with_nothing_recorded_each_bound_is_held_to_its_floor(tmp_path):
    fresh = tmp_path / "new"
    with pytest.raises(ValueError, match=f"below {STEADY_FLOOR_SECONDS:g} s"):
        fits(HangBounds(steady=STEADY_FLOOR_SECONDS / 2, startup=600.0), fresh)
    with pytest.raises(ValueError, match=f"start-up bound 30 s is below {STARTUP_FLOOR_SECONDS:g} s"):
        fits(HangBounds(steady=5.0, startup=30.0), fresh)
    fits(HangBounds(steady=STEADY_FLOOR_SECONDS, startup=STARTUP_FLOOR_SECONDS), fresh)
    fits(HangBounds(), fresh)  # auto
    fits(None, fresh)  # off


def test_train_refuses_a_fresh_run_s_bound_below_the_floor_writing_nothing(tmp_path, capsys):
    run_dir = tmp_path / "fresh"
    code = main(["train", "--config", str(SMOKE), "--data", str(tmp_path), "--run-dir", str(run_dir),
                 "--hang-timeout", "0.001"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "has recorded no update to measure it against" in err[0]
    assert not run_dir.exists()
