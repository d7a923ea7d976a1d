"""pilotrun/commands/cli_evaluate.py: `pilotrun evaluate`'s arguments reach the command; its output names each
task's figures and what was written."""

from __future__ import annotations

import pilotrun.commands.evaluate as evaluate_module
from pilotrun.commands.cli import build_parser, main


def test_the_arguments_and_their_defaults():
    args = build_parser().parse_args(["evaluate", "runs/x", "--tasks", "a.jsonl,hellaswag"])
    assert (
        args.run_dir,
        args.tasks,
        args.step,
        args.harness,
        args.limit,
        args.shots,
        args.seed,
        args.device,
        args.data,
        args.json,
    ) == ("runs/x", "a.jsonl,hellaswag", None, "pilotrun", 0, 0, 0, "cpu", None, False)


def test_the_handler_prints_each_task_and_what_was_written(monkeypatch, capsys):
    calls = []

    def fake(run_dir, tasks, **options):
        calls.append((run_dir, tasks, options))
        return {
            "tasks": {"t": {"acc": 0.5, "acc_norm": 0.25, "examples": 8}},
            "step": 20,
            "harness": "lm-eval",
            "harness_version": "0.4.13",
            "written": "runs/x/evals/step-00000020/e.json",
        }

    monkeypatch.setattr(evaluate_module, "evaluate_checkpoint", fake)
    assert main(["evaluate", "runs/x", "--tasks", "t.jsonl", "--step", "20", "--harness", "lm-eval",
                 "--limit", "8", "--shots", "1", "--seed", "3"]) == 0
    assert calls == [("runs/x", "t.jsonl", {"step": 20, "harness": "lm-eval", "data_dir": None, "limit": 8,
                                             "shots": 1, "seed": 3, "device": "cpu"})]
    out = capsys.readouterr().out
    assert "t: acc 0.5000, acc_norm 0.2500 over 8 examples (step 20, lm-eval 0.4.13)" in out
    assert "written: runs/x/evals/step-00000020/e.json" in out
    assert main(["evaluate", "runs/x", "--tasks", "t.jsonl", "--json"]) == 0
    assert '"step": 20' in capsys.readouterr().out


def test_the_printed_line_reads_each_accuracy_against_its_chance_level(monkeypatch, capsys):
    result = {"tasks": {"t": {"acc": 0.5, "acc_norm": 0.25, "examples": 8, "chance": 0.25}}, "step": 20,
              "harness": "pilotrun", "harness_version": "1.0", "written": "runs/x/evals/e.json"}
    monkeypatch.setattr(evaluate_module, "evaluate_checkpoint", lambda run_dir, tasks, **options: result)
    assert main(["evaluate", "runs/x", "--tasks", "t.jsonl"]) == 0
    assert "t: acc 0.5000, acc_norm 0.2500 (chance 0.2500) over 8 examples (step 20, pilotrun 1.0)" in (
        capsys.readouterr().out
    )
