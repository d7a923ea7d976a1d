"""verdict: the healthy synthetic pilot passes every rule; the decision, its statement and the CLI. Each
rule's FAIL case is in the test file of the module that judges it."""

import json

import pytest

from pilotrun.commands.cli import main
from pilotrun.report.verdict.thresholds import FAIL, PASS
from pilotrun.report.verdict.verdict import format_verdict, judge
from tests.report.synthetic import SyntheticRun, busier_machine, changed, crashed_and_resumed, verdict_of


def test_healthy_pilot_passes_every_rule(tmp_path):
    verdict, rules = verdict_of(tmp_path)
    assert {name: r.status for name, r in rules.items()} == dict.fromkeys(rules, PASS)
    assert verdict.decision == "GO"
    assert "does not say the final model will be good" in verdict.statement
    assert "60 applied updates" in verdict.statement
    assert "3 replayed window(s) compared, 0 differ" in rules["resumed"].figure


def test_judge_requires_the_pilot_to_have_finished(tmp_path):
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(33)  # killed, never resumed: no session_end at max_steps
    run.write()
    verdict = judge(tmp_path / "r")
    rule = {r.name: r for r in verdict.rules}["record_valid"]
    assert rule.status == FAIL and "no session_end at step 60" in rule.figure
    finished = crashed_and_resumed(tmp_path / "f")
    finished.write()
    assert judge(tmp_path / "f").decision == "GO"


def test_text_verdict_prints_each_warning_under_the_go_line(tmp_path):
    verdict, rules = verdict_of(tmp_path, busier_machine)
    lines = format_verdict(verdict).splitlines()
    at = lines.index("VERDICT: GO")
    assert lines[at + 1] == f"  WARN throughput_steady: {rules['throughput_steady'].figure}"
    assert lines[at + 2] == verdict.statement and "(warnings: throughput_steady)" in verdict.statement


@pytest.mark.slow
def test_cli_verdict_go_nogo_json_and_bad_threshold(tmp_path, capsys):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    assert main(["verdict", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "VERDICT: GO" in out and f"report: {tmp_path / 'r' / 'report' / 'report.html'}" in out
    # (A WARN does not block: see test_resumed_fails_without_resume_unless_waived.) A 2x throughput bound
    # fails.
    assert main(["verdict", str(tmp_path / "r"), "--json", "--threshold", "min_throughput_ratio=2"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["decision"] == "NO-GO" and data["thresholds"]["min_throughput_ratio"] == 2.0
    assert {r["name"]: r["status"] for r in data["rules"]}["throughput_steady"] == FAIL
    assert main(["verdict", str(tmp_path / "r"), "--threshold", "bogus=1"]) == 2
    assert "unknown name 'bogus'" in capsys.readouterr().err


def test_run_json_without_its_recipe_is_invalid_not_defaulted(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    del run.run["recipe"]
    run.write()
    verdict = judge(tmp_path / "r")
    rules = {r.name: r for r in verdict.rules}
    assert verdict.decision == "NO-GO" and not verdict.summary.valid
    assert any("lacks recipe.optim.grad_clip" in reason for reason in verdict.summary.reasons)
    assert rules["record_valid"].status == FAIL
    for name in ("clip_rate", "memory", "qk_clip"):
        assert rules[name].status == FAIL and "lacks" in rules[name].figure


def test_missing_evidence_fails_the_rule_that_needs_it(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    for event in run.events:
        event.pop("memory", None)
    run.write()
    rule = {r.name: r for r in judge(tmp_path / "r").rules}["memory"]
    assert rule.status == FAIL and "memory not recorded" in rule.figure


@pytest.mark.slow
def test_cli_verdict_json_lists_warnings_and_the_candidate(tmp_path, capsys):
    run = crashed_and_resumed(
        tmp_path / "r", make_run=lambda d, **kw: changed(SyntheticRun(d, **kw), busier_machine)
    )
    run.write()
    assert main(["verdict", str(tmp_path / "r"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["decision"] == "GO" and data["failed"] == []
    assert [w["name"] for w in data["warnings"]] == ["throughput_steady"]
    assert data["warnings"][0]["figure"].startswith("the machine got busier")
    assert len(data["candidate"]["recipe_sha256"]) == 64 and data["frozen"] is None




def test_the_text_verdict_keeps_a_forged_session_id_on_its_rule_s_line(tmp_path):
    from tests.report.record_check.test_summarize import forged_session_run

    run_dir = forged_session_run(tmp_path / "r")
    verdict = judge(run_dir)
    lines = format_verdict(verdict).split("\n")
    # a header, a line per rule, a blank, the decision, a line per warning, the statement, and the forecast
    expected = 1 + len(verdict.rules) + 2 + len(verdict.warnings) + 1 + (verdict.forecast is not None)
    assert len(lines) == expected + (verdict.frozen is not None) and "\x1b" not in "".join(lines)
    assert "run synthetic-run: VALID" not in lines and f"VERDICT: {verdict.decision}" in lines
    (resumed,) = [line for line in lines if line.startswith("resumed ")]
    assert "session s2\\nrun synthetic-run: VALID\\x1b[2J from step 20" in resumed
