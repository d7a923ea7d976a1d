"""rules.py: the rule table is one account of the verdict's rules. Every threshold has a meaning and a rule
that reads it, every plot a rule links to is one plots.py writes, `verdict --help` lists every rule and
threshold from the table, and the verdict judges the table's rules in its order."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from pilotrun.commands.cli import build_parser
from pilotrun.report.drawing.plots import PLOT_NAMES, write_plots
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.verdict.rules import (
    RULE_PLOTS,
    RULES,
    RULES_BY_NAME,
    Rule,
    live_rules,
    table_problems,
    window_rules,
)
from pilotrun.report.verdict.thresholds import FAIL, PASS, THRESHOLD_FIELDS, WARN, Finding, Thresholds
from pilotrun.report.verdict.verdict import judge_summary
from tests.report.synthetic import SyntheticRun, crashed_and_resumed

PACKAGE = Path(__file__).resolve().parents[3] / "pilotrun"


def test_the_table_is_consistent():
    assert table_problems() == []


def test_every_threshold_has_a_meaning_and_belongs_to_exactly_one_rule():
    owners = {name: [rule.name for rule in RULES if name in rule.thresholds] for name in
              (f.name for f in THRESHOLD_FIELDS)}
    assert {name: rules for name, rules in owners.items() if len(rules) != 1} == {}
    for f in THRESHOLD_FIELDS:
        assert len(f.metadata["meaning"]) > 10, f.name
    read = {name for rule in RULES for name in rule.thresholds}
    assert read == {f.name for f in dataclasses.fields(Thresholds)}


def test_table_problems_names_a_threshold_without_a_rule(monkeypatch):
    import pilotrun.report.verdict.rules as rules

    without_qk = tuple(rule for rule in RULES if rule.name != "qk_clip")
    monkeypatch.setattr(rules, "RULES", without_qk)
    assert rules.table_problems() == ["threshold max_qk_clip_rate belongs to no rule"]
    stray = dataclasses.replace(without_qk[0], thresholds=("nope",))
    monkeypatch.setattr(rules, "RULES", (*without_qk, stray))
    problems = rules.table_problems()
    assert "rule record_valid reads nope, which Thresholds lacks" in problems


@pytest.mark.slow
def test_every_linked_plot_is_one_plots_writes(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    written = write_plots(summarize_run(tmp_path / "r"), tmp_path / "plots")
    for rule in RULES:
        if rule.plot is None:
            continue
        assert rule.plot in PLOT_NAMES, rule.name
        assert written[rule.plot].stat().st_size > 0, rule.name
    assert RULE_PLOTS == {rule.name: rule.plot for rule in RULES if rule.plot}
    # The rules no plot shows: the record's validity, memory (no memory plot yet), the passes over the data,
    # the final checkpoint's bytes and the recipe's changes are figures, not curves.
    assert {rule.name for rule in RULES if rule.plot is None} == {"record_valid", "memory", "data_passes",
                                                                   "final_checkpoint", "recipe_changes"}


def _verdict_help(capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["verdict", "--help"])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps; compare the words


def test_verdict_help_lists_every_rule_and_every_threshold_with_default_and_meaning(capsys):
    text = _verdict_help(capsys)
    for rule in RULES:
        assert f"- {rule.name}: {' '.join(rule.meaning.split())}" in text
    for f in THRESHOLD_FIELDS:
        assert f"{f.name}={f.default}: {' '.join(f.metadata['meaning'].split())}" in text, f.name
    assert "--threshold NAME=VALUE" in text


def test_the_verdict_judges_the_tables_rules_in_order(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    verdict = judge_summary(summarize_run(tmp_path / "r"))
    assert [r.name for r in verdict.rules] == [rule.name for rule in RULES]
    assert RULES_BY_NAME["loss_decreased"].apply(verdict.summary, Thresholds()) == verdict.rules[2]


def test_apply_names_the_judges_finding():
    rule = Rule("example", "an example", lambda summary, t: Finding(WARN, "figure", "bound", "records"))
    result = rule.apply(None, Thresholds())
    assert (result.name, result.status, result.figure, result.threshold, result.evidence) == \
        ("example", WARN, "figure", "bound", "records")


def test_the_live_rules_judge_a_run_still_in_progress(tmp_path):
    """What a reader of a long run can take from the table: the rules that apply before the run ends, judged
    on its kept history so far, without the checks only a finished pilot can pass."""
    run = SyntheticRun(tmp_path / "r")
    run.start_session()
    run.train_until(35)  # still running: no session_end yet
    run.write()
    summary = summarize_run(tmp_path / "r")
    live = live_rules()
    assert {rule.name for rule in RULES if rule not in live} == {"resumed", "final_checkpoint"}
    assert set(window_rules()) <= set(live)
    results = {rule.name: rule.apply(summary, Thresholds()) for rule in live}
    assert all(r.status in (PASS, WARN, FAIL) for r in results.values())
    assert results["record_valid"].status == PASS and results["loss_decreased"].status == PASS


def _rule_name_literals(path: Path, names: set[str]) -> list[tuple[int, str, bool]]:
    """(line, name, declared) of each string literal equal to a rule name: declared when it is the first
    argument of a Rule(...); a subscript, `.get` or comparison of the same word is a record key (the record
    has its own qk_clip section, memory section, final_checkpoint field), not the rule's name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and node.value in names):
            continue
        parent = parents[node]
        declared = (
            isinstance(parent, ast.Call)
            and isinstance(parent.func, ast.Name)
            and parent.func.id == "Rule"
            and parent.args
            and parent.args[0] is node
        )
        record_key = isinstance(parent, ast.Subscript | ast.Compare) or (
            isinstance(parent, ast.Call)
            and isinstance(parent.func, ast.Attribute)
            and parent.func.attr == "get"
        )
        if not record_key:
            found.append((node.lineno, node.value, declared))
    return found


def test_no_rule_name_is_written_twice():
    names = set(RULES_BY_NAME)
    # The modules that deal in rules (summarize, sessions, time_split and plots read the record, whose words
    # qk_clip, memory and final_checkpoint are its own).
    modules = [PACKAGE / "report" / "verdict" / f"{name}.py" for name in (
        "rules", "verdict", "thresholds", "evidence", "stability", "resources", "continuity")]
    modules += [PACKAGE / "report" / "drawing" / f"{name}.py" for name in ("html", "run_header")]
    modules += [PACKAGE / "commands" / "cli.py", PACKAGE / "commands" / "api.py"]
    declared, elsewhere = [], []
    for path in modules:
        for line, name, is_declaration in _rule_name_literals(path, names):
            (declared if is_declaration else elsewhere).append((path.name, line, name))
    assert elsewhere == []
    assert sorted(name for _, _, name in declared) == sorted(names)
    assert {path for path, _, _ in declared} == {"rules.py"}


@pytest.mark.parametrize("lines", [1, 2, 6])
def test_a_rule_that_fails_for_evidence_a_run_has_not_reached_yet_states_it_as_a_need(tmp_path, lines):
    """Every rule, on a healthy run cut after its first lines (a session start; one window; a resumed
    session's start): any FAIL comes from a rule still waiting for one of its needs (evidence.Need), so a new
    rule that reads something a young run lacks cannot alert on it. The complete record waits for nothing.
    (The synthetic run clips every update to 10, its warm-up as the recipe states it.)"""
    full = crashed_and_resumed(tmp_path / "full")
    full.run["recipe"]["optim"]["schedule"] = {"warmup_steps": 10}
    run = SyntheticRun(tmp_path / "r")
    run.run, run.events = (
        full.run,
        full.events[:lines]
        if lines < 6
        else [e for e in full.events if e["session_id"] == "s1" and e["step"] <= 5]
        + [full.find("session_start", "s2")],
    )
    run.write()
    summary = summarize_run(run.run_dir)
    for rule in RULES:
        if rule.name in ("record_valid", "resumed", "final_checkpoint") and lines == 6:
            continue  # the cut record's run.json names a session end that is not there: invalid, rightly
        if rule.apply(summary, Thresholds()).status == FAIL:
            assert rule.waiting_for(summary) is not None, rule.name
    assert all(rule.waiting_for(summarize_run(full.write())) is None for rule in RULES)


def test_every_rule_states_its_needs_in_words():
    from pilotrun.report.verdict.evidence import Need

    for rule in RULES:
        assert isinstance(rule.needs, tuple) and all(isinstance(n, Need) and n.what for n in rule.needs), (
            rule.name
        )
    assert [n.what for n in RULES_BY_NAME["losses_finite"].needs] == ["a train window"]
