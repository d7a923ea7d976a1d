"""report folder: summary.json, the PNGs and a self-contained report.html that embeds each one."""

import base64
import json

import pytest

from pilotrun.report.drawing.html import write_report
from pilotrun.report.drawing.plots import PLOT_NAMES
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.verdict.rules import RULE_PLOTS
from pilotrun.report.verdict.verdict import judge_summary
from tests.report.synthetic import crashed_and_resumed


@pytest.mark.slow
def test_report_folder_is_complete_and_self_contained(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    verdict = judge_summary(summarize_run(tmp_path / "r"))
    report = write_report(verdict)
    assert report == tmp_path / "r" / "report"
    page = (report / "report.html").read_text()
    for name in PLOT_NAMES:
        png = (report / f"{name}.png").read_bytes()
        assert len(png) > 0
        assert f"data-file='{name}.png'" in page
        assert base64.b64encode(png).decode("ascii") in page  # embedded, not linked
    for rule in verdict.rules:
        plot = RULE_PLOTS.get(rule.name)
        cell = f"<a href='#plot-{plot}'>{rule.name}</a>" if plot else rule.name
        assert f"<td>{cell}</td>" in page
        if plot:
            assert f"<figure id='plot-{plot}'>" in page
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert verdict.decision in page and "does not predict the final model" in page
    summary = json.loads((report / "summary.json").read_text())
    assert summary["decision"] == verdict.decision
    assert [r["name"] for r in summary["rules"]] == [r.name for r in verdict.rules]
    assert summary["summary"]["overall"]["updates_applied"] == 60


@pytest.mark.slow
def test_html_escapes_record_text(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.run["run_id"] = "<b>run</b>"
    run.write()
    page = (write_report(judge_summary(summarize_run(tmp_path / "r"))) / "report.html").read_text()
    assert "<b>run</b>" not in page and "&lt;b&gt;run&lt;/b&gt;" in page


@pytest.mark.slow
def test_html_lists_the_warnings_under_the_decision(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.run["allowed_changes"].append({"session_id": "s2", "key": "optim.grad_clip", "old": 1.0, "new": 2.0})
    run.write()
    verdict = judge_summary(summarize_run(tmp_path / "r"))
    page = (write_report(verdict) / "report.html").read_text()
    assert verdict.decision == "GO"
    decision_at = page.index("<p class=\"decision\">GO</p>")
    warning_at = page.index("<li>WARN recipe_changes: 1 change(s) on resume: optim.grad_clip 1.0 -&gt; 2.0")
    assert decision_at < warning_at < page.index("<h2>Rules</h2>")


@pytest.mark.slow
def test_the_page_gives_each_rules_meaning_and_the_thresholds_it_was_held_to(tmp_path):
    import html

    from pilotrun.report.verdict.rules import RULES
    from pilotrun.report.verdict.thresholds import parse_thresholds, threshold_meaning

    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    verdict = judge_summary(summarize_run(tmp_path / "r"), parse_thresholds(["min_loss_drop=0.1"]))
    page = (write_report(verdict) / "report.html").read_text()
    for rule in RULES:
        assert f"<dd>{html.escape(rule.meaning)}" in page
        for name in rule.thresholds:
            held = 0.1 if name == "min_loss_drop" else getattr(verdict.thresholds, name)
            assert f"<li><code>{name}</code> = {held}: {html.escape(threshold_meaning(name))}</li>" in page
