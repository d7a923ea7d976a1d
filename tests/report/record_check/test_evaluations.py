"""pilotrun/report/record_check/evaluations.py: each evaluation stands on the checkpoint and results file it
names, or is named; --require-eval holds completion to standing evaluations of the final checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pilotrun.commands.evaluate import evaluate_checkpoint
from pilotrun.report.record_check.evaluations import format_evaluations, require_evaluations
from pilotrun.report.record_check.summarize import format_summary, summarize_run
from pilotrun.run.marker import step_folder
from tests.choice_task_fixture import train_task_run

pytestmark = pytest.mark.slow  # every test here reads a trained run


@pytest.fixture(scope="module")
def evaluated(task_run, tmp_path_factory) -> Path:
    """The task run, copied, with an evaluation of the task at step 20 and at step 40."""
    _data, task, run_dir = task_run
    copy = tmp_path_factory.mktemp("evaluated") / "run"
    shutil.copytree(run_dir, copy)
    for step in (20, 40):
        evaluate_checkpoint(copy, str(task), step=step)
    return copy


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_evaluations_on_intact_checkpoints_stand_and_the_summary_shows_each_with_its_checkpoint(evaluated):
    summary = summarize_run(evaluated, require_step=40, require_eval=["fineweb_next"])
    assert summary.valid, summary.reasons
    entries = summary.overall["evaluations"]
    assert [(e["step"], e["status"], e["harness"]) for e in entries] == [(20, "stands", "pilotrun"),
                                                                         (40, "stands", "pilotrun")]
    text = format_summary(summary)
    assert "evaluation at step 20 (checkpoint marker" in text and "fineweb_next acc" in text
    assert entries[0]["marker_sha256"][:12] in text


def test_a_checkpoint_replaced_by_another_runs_is_named(evaluated, task_run, tmp_path):
    data, task, _ = task_run
    other = train_task_run(data, task, tmp_path / "other", steps=20, seed=1)
    run = _copy(evaluated, tmp_path)
    shutil.rmtree(step_folder(run, 20))
    shutil.copytree(step_folder(other, 20), step_folder(run, 20))
    summary = summarize_run(run)
    named = [r for r in summary.reasons if "evaluation of step 20" in r]
    assert len(named) == 1 and "another run's" in named[0], summary.reasons
    assert summary.overall["evaluations"][0]["status"] == "checkpoint replaced"


def test_an_edited_results_file_or_a_damaged_checkpoint_is_named(evaluated, tmp_path):
    run = _copy(evaluated, tmp_path)
    results = sorted((run / "evals" / "step-00000040").glob("*.json"))[0]
    data = json.loads(results.read_text())
    data["tasks"]["fineweb_next"]["acc"] = 0.99
    results.write_text(json.dumps(data))
    with open(step_folder(run, 20) / "model.pt", "ab") as handle:
        handle.write(b"\0")
    summary = summarize_run(run)
    assert not summary.valid
    assert any(
        "evaluation of step 40" in r and "was edited after the evaluation" in r for r in summary.reasons
    )
    assert any("evaluation of step 20" in r and "damaged" in r for r in summary.reasons)


def test_a_pruned_checkpoint_leaves_a_note_and_require_eval_names_what_is_missing(evaluated, tmp_path):
    run = _copy(evaluated, tmp_path)
    shutil.rmtree(step_folder(run, 20))
    summary = summarize_run(run, require_step=40, require_eval=["fineweb_next"])
    assert summary.valid, summary.reasons
    assert any("evaluation of step 20" in n and "no longer committed" in n for n in summary.notes)
    missing = summarize_run(run, require_step=40, require_eval=["fineweb_next", "hellaswag"])
    assert missing.reasons == [
        "--require-eval: no standing evaluation of hellaswag on the final checkpoint (step "
        f"40); run `pilotrun evaluate {run} --step 40 --tasks hellaswag --harness lm-eval`"
    ]


def test_require_eval_without_an_evaluation_of_the_final_checkpoint_is_invalid(task_run):
    _data, task, run_dir = task_run
    summary = summarize_run(run_dir, require_step=40, require_eval=["fineweb_next"])
    assert not summary.valid
    # the task is named by its stem; the command names its file, from the recipe's downstream tasks
    assert summary.reasons == [
        "--require-eval: no standing evaluation of fineweb_next on the final checkpoint (step "
        f"40); run `pilotrun evaluate {run_dir} --step 40 --tasks {task}`"
    ]


def test_require_eval_names_an_evaluation_that_no_longer_stands():
    entries = [{"step": 40, "status": "results edited", "tasks": {"arc": {"acc": 0.3}}, "marker_sha256": "ab",
                "harness": "lm-eval", "harness_version": "0.4"}]
    reasons: list[str] = []
    require_evaluations(entries, 40, ["arc"], reasons)
    assert reasons == ["--require-eval: no standing evaluation of arc on the final checkpoint (step 40); arc "
                       "evaluated there but not standing"]
    assert format_evaluations(entries) == [
        "evaluation at step 40 (checkpoint marker ab..., lm-eval 0.4): arc acc "
        "0.300 (None examples); results edited"
    ]


def test_a_session_resumed_after_an_evaluation_continues_the_chain_and_the_evaluation_still_stands(
    evaluated, task_run, tmp_path
):
    import io

    from pilotrun.report.watch.alerts import Watcher
    from pilotrun.training.trainer import Trainer
    from tests.choice_task_fixture import task_recipe

    data, task, _ = task_run
    run = _copy(evaluated, tmp_path)
    assert not [
        a for a in Watcher(run, holder=lambda _: None).check(final=True)[0] if a.kind == "session_end"
    ]
    recipe = task_recipe(task, steps=60, extra=("optim.schedule.horizon=40",))
    assert Trainer(recipe, data, run, resume=True, allow_changes=["train.max_steps"], progress=False,
                   out=io.StringIO()).run().exit_code == 0
    summary = summarize_run(run, require_step=60)
    assert summary.valid, summary.reasons
    assert [(e["step"], e["status"]) for e in summary.overall["evaluations"]] == [
        (20, "stands"),
        (40, "stands"),
    ]


def test_the_report_shows_each_evaluation_with_its_checkpoint_and_plots_it(evaluated, tmp_path):
    from pilotrun.report.drawing.html import write_report
    from pilotrun.report.verdict.verdict import judge

    run = _copy(evaluated, tmp_path)
    verdict = judge(run)
    folder = write_report(verdict, run)
    page = (folder / "report.html").read_text()
    entries = verdict.summary.overall["evaluations"]
    assert "Evaluations of checkpoints (pilotrun evaluate)" in page
    for entry in entries:
        assert entry["marker_sha256"][:16] in page
    assert page.count("fineweb_next acc ") >= len(entries) and (folder / "downstream_accuracy.png").is_file()
    rule = next(r for r in verdict.rules if r.name == "downstream")
    assert rule.status in ("PASS", "WARN") and "fineweb_next acc" in rule.figure


def test_an_evaluation_event_re_chained_with_other_figures_than_its_results_file_is_named(
    evaluated, tmp_path
):
    """The results file untouched (its sha256 holds), the event's accuracy changed and its line chained again:
    the event is held to the file it names, and does not stand."""
    from pilotrun.run.record import chained_line, unchained_body

    run = _copy(evaluated, tmp_path)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    previous = unchained_body(lines[-2])[1]
    event = json.loads(unchained_body(lines[-1])[0])
    assert event["event"] == "evaluation" and event["checkpoint"]["step"] == 40
    event["tasks"]["fineweb_next"]["acc"] = 0.99
    lines[-1] = chained_line(previous, event)[0]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = summarize_run(run)
    assert summary.overall["evaluations"][1]["status"] == "figures differ", summary.reasons
    assert any("evaluation of step 40" in r and "task fineweb_next acc 0.99 in the event" in r
               for r in summary.reasons), summary.reasons
    assert not summary.valid


def test_require_eval_suggests_a_command_that_runs_for_a_harness_task_and_a_task_file_given_by_path():
    entries = [{"step": 40, "status": "stands", "tasks": {"arc": {"acc": 0.3}}}]
    reasons: list[str] = []
    require_evaluations(entries, 40, ["hellaswag"], reasons, run_dir="runs/long")
    assert reasons == ["--require-eval: no standing evaluation of hellaswag on the final checkpoint "
                       "(step 40); run `pilotrun evaluate runs/long --step 40 --tasks hellaswag "
                       "--harness lm-eval`"]
    reasons = []
    require_evaluations(entries, 40, ["tasks/mine.jsonl", "arc"], reasons, run_dir="runs/my long")
    assert reasons == ["--require-eval: no standing evaluation of mine on the final checkpoint (step 40) "
                       "(a task file is named by its stem: tasks/mine.jsonl as mine); run `pilotrun evaluate "
                       "'runs/my long' --step 40 --tasks tasks/mine.jsonl`"]
    standing = [{"step": 40, "status": "stands", "tasks": {"mine": {"acc": 0.3}}}]
    reasons = []
    require_evaluations(standing, 40, ["tasks/mine.jsonl"], reasons, run_dir="runs/long")
    assert reasons == []  # the path is accepted: its stem is the name the evaluation recorded
    reasons = []
    require_evaluations(entries, 40, ["mine"], reasons, run_dir="r", task_files=["tasks/mine.jsonl"])
    assert reasons[0].endswith("run `pilotrun evaluate r --step 40 --tasks tasks/mine.jsonl`")


def test_an_accuracy_that_is_not_a_number_is_null_in_the_event_and_its_file_and_they_still_match(
    task_run, tmp_path, monkeypatch
):
    """A task scored to NaN (an accuracy over no example, a harness's NaN): the results file is strict JSON
    with null there, the event says null too, the evaluation stands; an event re-chained with a number there
    instead is still named."""
    import pilotrun.training.multiple_choice as multiple_choice
    from pilotrun.run.record import chained_line, unchained_body

    _data, task, source = task_run
    run = _copy(source, tmp_path)
    real = multiple_choice.score_task

    def not_a_number(*args, **kwargs):
        return {**real(*args, **kwargs), "acc": float("nan"), "acc_above_chance": float("inf")}

    monkeypatch.setattr(multiple_choice, "score_task", not_a_number)
    evaluate_checkpoint(run, str(task), step=40)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    event = json.loads(unchained_body(lines[-1])[0])
    written = (run / event["results"]["path"]).read_text()

    def refuse(constant):
        raise AssertionError(f"bare {constant} in the results file")

    figures = json.loads(written, parse_constant=refuse)["tasks"]["fineweb_next"]
    assert figures["acc"] is None and figures["acc_above_chance"] is None
    assert event["tasks"]["fineweb_next"]["acc"] is None and event["tasks"]["fineweb_next"]["acc_norm"] >= 0
    summary = summarize_run(run)
    assert summary.valid, summary.reasons
    assert summary.overall["evaluations"][-1]["status"] == "stands"
    from pilotrun.report.verdict.verdict import judge_summary

    assert "fineweb_next acc null (not a finite number) (" in format_summary(summary)
    assert judge_summary(summary).rules  # read, no traceback
    event["tasks"]["fineweb_next"]["acc"] = 0.5
    lines[-1] = chained_line(unchained_body(lines[-2])[1], event)[0]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = summarize_run(run)
    assert summary.overall["evaluations"][-1]["status"] == "figures differ" and not summary.valid
    assert any("task fineweb_next acc 0.5 in the event, None in the file" in r for r in summary.reasons)
