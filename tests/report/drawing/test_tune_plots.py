"""The checks' plots: one per check that ran, drawn from tune.json's content, none where no check ran."""

from __future__ import annotations

import json

from pilotrun.report.drawing.tune_plots import write_run_tune_plots, write_tune_plots

RESULT = {
    "yardstick": 0.01,
    "lr": {"losses": [[0.5, 3.1], [1.0, 3.0], [2.0, "Infinity"]], "best_loss": 3.0, "from_steps": [8],
           "updates": 4},
    "batch": {"critical": 2.0, "points": [{"step": 4, "critical": 2.0, "best_loss": 3.0,
                                           "losses": [[0.5, 3.0], [1.0, 3.0], [2.0, 3.005], [4.0, 3.1]]}]},
}


def test_a_plot_per_check_that_ran(tmp_path):
    drawn = write_tune_plots(RESULT, tmp_path)
    assert sorted(drawn) == ["tune_batch", "tune_lr"]
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in drawn.values())
    assert not list(tmp_path.glob(".*partial"))
    only_lr = write_tune_plots({"yardstick": 0.0, "lr": RESULT["lr"]}, tmp_path)
    assert list(only_lr) == ["tune_lr"]


def test_the_report_draws_them_only_where_a_check_wrote_tune_json(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert write_run_tune_plots(tmp_path, out) == {}
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "tune.json").write_text(json.dumps(RESULT))
    assert sorted(write_run_tune_plots(tmp_path, out)) == ["tune_batch", "tune_lr"]
