"""Every command's `--json` output is strict JSON: a non-finite figure (an overflowed loss, a NaN gradient
norm, an accuracy over no examples) is a string there, never a bare Infinity or NaN that jq or JSON.parse
refuse. Each command is run through the CLI on a record (or a result) holding inf and NaN, and its output
parsed with a parser that refuses the bare constants."""

from __future__ import annotations

import json
import math

from pilotrun.commands.cli import main
from tests.report.synthetic import SyntheticRun, crashed_and_resumed


def strict(text: str):
    def refuse(constant):
        raise ValueError(f"bare {constant} in --json output")

    return json.loads(text, parse_constant=refuse)


def nonfinite_run(run_dir):
    """A pilot-shaped record whose last windows' loss is infinite and gradient norm NaN, and whose val loss
    overflowed."""

    def figures(path, **kwargs):
        run = SyntheticRun(path, **kwargs)
        run.loss = lambda step: math.inf if step >= 50 else 2.0
        run.grad_norm = lambda step: math.nan if step >= 50 else 1.0
        run.val_loss = lambda step: math.inf if step >= 50 else 2.1
        return run

    crashed_and_resumed(run_dir, make_run=figures).write()
    return run_dir


def test_summarize_json_of_a_record_holding_inf_and_nan_is_strict(tmp_path, capsys, monkeypatch):
    run_dir = nonfinite_run(tmp_path / "r")
    assert main(["summarize", str(run_dir), "--json"]) == 1
    assert strict(capsys.readouterr().out)["valid"] is False
    # A figure the summary itself holds as a float (a rate over no seconds) goes out as a string.
    from pilotrun.report.record_check import summarize

    original = summarize.summarize_run

    def with_infinite_figure(*args, **kwargs):
        summary = original(*args, **kwargs)
        summary.overall["tokens_per_second"] = math.inf
        return summary

    monkeypatch.setattr(summarize, "summarize_run", with_infinite_figure)
    assert main(["summarize", str(run_dir), "--json"]) == 1
    assert strict(capsys.readouterr().out)["overall"]["tokens_per_second"] == "Infinity"


def test_verdict_json_of_a_record_holding_inf_and_nan_is_strict(tmp_path, capsys, monkeypatch):
    run_dir = nonfinite_run(tmp_path / "r")
    assert main(["verdict", str(run_dir), "--json"]) == 1
    assert strict(capsys.readouterr().out)["decision"] == "NO-GO"
    from pilotrun.report.verdict import verdict as verdict_module

    original = verdict_module.judge

    def with_nan_figure(*args, **kwargs):
        verdict = original(*args, **kwargs)
        verdict.summary.overall["tokens_per_second"] = math.nan
        return verdict

    monkeypatch.setattr(verdict_module, "judge", with_nan_figure)
    assert main(["verdict", str(run_dir), "--json"]) == 1
    assert strict(capsys.readouterr().out)["summary"]["overall"]["tokens_per_second"] == "NaN"
    # the report folder's summary.json, written beside the HTML, is strict too
    written = strict((run_dir / "report" / "summary.json").read_text())
    assert written["summary"]["overall"]["tokens_per_second"] == "NaN"


def test_evaluate_json_with_a_nan_accuracy_is_strict(tmp_path, capsys, monkeypatch):
    from pilotrun.commands import evaluate

    def scored(*args, **kwargs):
        return {"step": 4, "tasks": {"empty": {"acc": math.nan, "acc_norm": math.inf, "chance": 0.25}},
                "written": str(tmp_path / "evals")}

    monkeypatch.setattr(evaluate, "evaluate_checkpoint", scored)
    assert main(["evaluate", str(tmp_path), "--tasks", "hellaswag", "--json"]) == 0
    assert strict(capsys.readouterr().out)["tasks"]["empty"] == {"acc": "NaN", "acc_norm": "Infinity",
                                                                 "chance": 0.25}


def test_export_json_is_strict(tmp_path, capsys, monkeypatch):
    from pilotrun.commands import export

    def exported(*args, **kwargs):
        return {"step": 4, "storage": "single", "out": str(tmp_path / "hf"), "parameters": 10, "tensors": 2,
                "loss": -math.inf}

    monkeypatch.setattr(export, "export_run", exported)
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "hf"), "--json"]) == 0
    assert strict(capsys.readouterr().out)["loss"] == "-Infinity"


def test_config_json_is_strict(capsys, monkeypatch):
    from pilotrun.config import describe

    original = describe.describe_config

    def with_infinite_default(config):
        return [*original(config), {"key": "made.up", "value": math.inf, "default": math.nan}]

    monkeypatch.setattr(describe, "describe_config", with_infinite_default)
    assert main(["config", "--config", "stability", "--json"]) == 0
    assert strict(capsys.readouterr().out)[-1] == {"key": "made.up", "value": "Infinity", "default": "NaN"}


def test_watch_json_of_a_record_holding_inf_and_nan_is_strict(tmp_path, capsys):
    """One JSON object a line per alert (an alert's own non-finite figure:
    tests/report/watch/test_alerts.py)."""
    run_dir = nonfinite_run(tmp_path / "r")
    assert main(["watch", str(run_dir), "--json"]) == 1
    alerts = [strict(line) for line in capsys.readouterr().out.splitlines()]
    assert alerts and any(a["key"] == "rule:losses_finite" for a in alerts)
