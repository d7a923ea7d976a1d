"""summarize and verdict on records the real trainer wrote (tiny smoke model, built-in corpus, one thread)."""

from pathlib import Path

import pytest

from pilotrun.config import load_run_config
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.verdict.thresholds import Thresholds
from pilotrun.report.verdict.verdict import judge_summary
from pilotrun.training.trainer import Trainer

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"


def _train(data_dir, run_dir, *overrides, **kwargs):
    config = load_run_config(SMOKE, ["train.num_threads=1", *overrides])
    return Trainer(config, data_dir, run_dir, progress=False, **kwargs).run()


@pytest.mark.slow
def test_fp16_record_with_overflow_skips_is_valid(builtin_data_dir, tmp_path):
    _train(
        builtin_data_dir,
        tmp_path / "run",
        "train.precision=fp16",
        "train.loss_scale_init=16777216",
        "train.max_steps=4",
        "train.gradient_accumulation_steps=2",
        "train.log_every=2",
        "train.eval_every=0",
    )
    summary = summarize_run(tmp_path / "run", require_step=4)
    assert summary.valid, summary.reasons
    o = summary.overall
    assert o["updates_applied"] == 4 and o["updates_skipped"] >= 1
    assert o["updates_attempted"] == 4 + o["updates_skipped"]
    rules = {r.name: r for r in judge_summary(summary, Thresholds(resume_required=False)).rules}
    assert f"{o['updates_skipped']} of {o['updates_attempted']} updates skipped" in rules["skip_rate"].figure


@pytest.mark.slow
def test_resumed_record_is_reconciled_and_replayed_windows_are_identical(builtin_data_dir, tmp_path):
    run_dir = tmp_path / "run"
    _train(builtin_data_dir, run_dir, "train.max_steps=5", "train.eval_every=4")
    _train(builtin_data_dir, run_dir, "train.max_steps=8", "train.eval_every=4", resume=True, from_step=3)
    summary = summarize_run(run_dir, require_step=8)
    assert summary.valid, summary.reasons
    first, second = summary.sessions
    assert (first.status, first.end_reason, first.updates_applied, first.updates_rolled_back) == \
        ("partly rolled back", "completed", 5, 2)
    assert (second.resumed_from, second.updates_applied) == (3, 5)
    assert summary.overall["updates_applied"] == 8 and summary.overall["updates_rolled_back"] == 2
    rule = {r.name: r for r in judge_summary(summary).rules}["resumed"]
    assert rule.status == "PASS"
    assert "3 replayed window(s) compared, 0 differ" in rule.figure  # train at steps 4, 5 and val at step 4
