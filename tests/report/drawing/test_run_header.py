"""The report's identity block reads run.json and nothing else."""

from __future__ import annotations

import pytest

from pilotrun.report.drawing.plots import PLOT_NAMES
from pilotrun.report.drawing.run_header import NOT_RECORDED, recipe_name, run_identity
from pilotrun.report.verdict.rules import RULE_PLOTS, RULES


def test_recipe_name_from_the_recorded_command():
    assert (
        recipe_name(["pilotrun", "train", "--config", "configs/stability.yaml", "--data", "d"]) == "stability"
    )
    assert recipe_name(["pilotrun", "train", "--config=gpu/smoke.yaml"]) == "smoke"
    assert recipe_name(["pilotrun", "train", "--frozen", "lock.json"]) == "frozen candidate lock.json"
    assert recipe_name(["pilotrun", "train"]) == NOT_RECORDED
    assert recipe_name(None) == NOT_RECORDED


def test_identity_rows_come_from_run_json():
    run = {
        "model": {"parameters": 1234, "active_parameters": 1000},
        "recipe": {"train": {"precision": "bf16"}},
        "data": {
            "metadata_sha256": "ab" * 32,
            "vocab_size": 2048,
            "source": {"kind": "builtin", "documents": 435},
            "tokenizer": {"kind": "bpe"},
        },
        "sessions": [
            {
                "session_id": "s1",
                "start_step": 0,
                "command": ["pilotrun", "train", "--config", "x/stability.yaml"],
                "git": {"commit": "c" * 40, "dirty": True},
                "software": {"torch": "2.13.0", "python": "3.11.7"},
                "hardware": {"device": "cpu", "device_name": "x86_64", "world_size": 1},
            },
            {"session_id": "s2", "start_step": 20, "git": {"commit": "c" * 40, "dirty": True}},
        ],
    }
    rows = dict(run_identity(run))
    assert rows["recipe"] == "stability (precision bf16)"
    assert rows["model parameters"] == "1,234 total, 1,000 active per token"
    assert rows["data metadata_sha256"] == "ab" * 32
    assert rows["git commit"] == "cccccccccccc (dirty)"  # one commit for both sessions, listed once
    assert "torch 2.13.0" in rows["software"]
    assert rows["sessions"].startswith("2: s1 from step 0, s2 from step 20")
    assert set(dict(run_identity({})).values()) <= {NOT_RECORDED, "not recorded (precision not recorded)"}


def test_every_linked_rule_exists_and_points_at_a_drawn_plot():
    rule_names = {rule.name for rule in RULES}
    assert set(RULE_PLOTS) <= rule_names
    assert set(RULE_PLOTS.values()) <= set(PLOT_NAMES)


@pytest.mark.slow
def test_fp32_report_leaves_loss_scale_off_the_page_but_in_the_folder(tmp_path):
    from pilotrun.report.drawing.html import write_report
    from pilotrun.report.record_check.summarize import summarize_run
    from pilotrun.report.verdict.verdict import judge_summary
    from tests.report.synthetic import crashed_and_resumed

    run = crashed_and_resumed(tmp_path / "r")
    run.run["recipe"]["train"]["precision"] = "fp32"
    run.write()
    report = write_report(judge_summary(summarize_run(tmp_path / "r")))
    page = (report / "report.html").read_text()
    assert (report / "loss_scale.png").stat().st_size > 0
    assert "data-file='loss_scale.png'" not in page
    assert "<a href='#plot-loss_scale'>" not in page  # skip_rate is not linked to a plot left off the page
    assert all(f"data-file='{name}.png'" in page for name in PLOT_NAMES if name != "loss_scale")


@pytest.mark.slow
def test_session_notes_from_run_json_reach_the_page(tmp_path):
    from pilotrun.report.drawing.html import write_report
    from pilotrun.report.record_check.summarize import summarize_run
    from pilotrun.report.verdict.verdict import judge_summary
    from tests.report.synthetic import crashed_and_resumed

    run = crashed_and_resumed(tmp_path / "r")
    run.run["sessions"][1]["notes"] = ["restored checkpoints/step-00000020: step 20"]
    run.write()
    page = (write_report(judge_summary(summarize_run(tmp_path / "r"))) / "report.html").read_text()
    assert "<li>session s2: restored checkpoints/step-00000020: step 20</li>" in page
