"""pilotrun/commands/lm_eval_model.py: EleutherAI's harness on a committed checkpoint, answered by pilotrun's
own model, gives exactly pilotrun's own scoring of the same examples. Offline: a local task file."""

from __future__ import annotations

import json
import shutil

import pytest

from pilotrun.common.errors import PilotrunError
from pilotrun.data.choice_tasks import read_choice_task

lm_eval = pytest.importorskip("lm_eval", reason="needs EleutherAI's harness, the eval extra: pip install "
                              "'pilotrun[eval]' (the dev extra includes it)")


def test_a_local_task_becomes_a_harness_task_of_the_same_examples(tmp_path):
    from pilotrun.commands.lm_eval_model import local_task_config

    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"context": "a", "choices": [" b", " c"], "label": 0}) + "\n")
    config = local_task_config(read_choice_task(path), tmp_path / "cache")
    assert config["dataset_kwargs"]["data_files"] == {"test": str(path.resolve())}
    assert (config["doc_to_text"], config["doc_to_choice"], config["doc_to_target"]) == (
        "context",
        "choices",
        "label",
    )
    assert config["target_delimiter"] == "" and config["output_type"] == "multiple_choice"


@pytest.mark.slow
def test_the_harness_scores_every_choice_exactly_as_pilotrun_does(task_run):
    from pilotrun.commands.evaluate import _scorer
    from pilotrun.commands.lm_eval_model import run_harness
    from pilotrun.training.multiple_choice import score_task

    _data, task_path, run_dir = task_run
    task = read_choice_task(task_path)
    scorer, step, _marker = _scorer(run_dir, 40, None, "cpu")
    ours: list[list[float]] = []
    own = score_task(scorer, task, on_example=lambda index, scores: ours.append(scores))
    ran = run_harness(scorer, [], [task], shots=0, limit=0, seed=0)
    assert ran["samples"]["fineweb_next"] == ours  # every choice of every example, bit for bit
    figures = ran["tasks"]["fineweb_next"]
    assert (figures["acc"], figures["acc_norm"], figures["examples"]) == (own["acc"], own["acc_norm"], 40)
    assert figures["sha256"] == task.sha256 and figures["version"] == 1.0 and figures["shots"] == 0
    assert figures["chance"] == own["chance"]  # guessing's accuracy, from the examples' choices


@pytest.mark.slow
def test_evaluate_with_the_harness_records_its_version_and_the_task_identity(task_run, tmp_path):
    from pilotrun.commands.evaluate import evaluate_checkpoint
    from pilotrun.commands.lm_eval_model import harness_version
    from pilotrun.report.record_check.summarize import summarize_run

    _data, task, source = task_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    result = evaluate_checkpoint(run, str(task), harness="lm-eval", limit=8)
    assert result["harness_version"] == harness_version() and result["limit"] == 8
    assert result["tasks"]["fineweb_next"]["examples"] == 8
    written = json.loads((run / result["results"]["path"]).read_text())
    assert written["harness_output"]["versions"] == {"fineweb_next": 1.0}
    summary = summarize_run(run, require_step=40, require_eval=["fineweb_next"])
    assert summary.valid, summary.reasons


def test_a_generative_request_is_refused_in_one_line():
    from pilotrun.commands.lm_eval_model import pilotrun_lm

    model = pilotrun_lm(scorer=None)
    with pytest.raises(PilotrunError, match="multiple-choice"):
        model.generate_until([])
    with pytest.raises(PilotrunError, match="multiple-choice"):
        model.loglikelihood_rolling([])


@pytest.mark.slow
def test_a_name_the_harness_does_not_know_is_refused_before_anything_is_written(task_run, tmp_path, capsys):
    from pilotrun.commands.cli import main
    from tests.commands.test_cli_bad_input import tree_hashes

    _data, _task, source = task_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    before = tree_hashes(run)
    assert main(["evaluate", str(run), "--harness", "lm-eval", "--tasks", "no_such_harness_task"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown task no_such_harness_task" in err[0]
    assert tree_hashes(run) == before
