"""pilotrun/commands/evaluate.py: `pilotrun evaluate` gives the in-loop figures for the same checkpoint,
writes its results and identity under RUN/evals/, puts an `evaluation` event on the chain, never writes into a
checkpoint or a live run; bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import builtins
import json
import shutil
from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from pilotrun.commands.evaluate import evaluate_checkpoint, parse_tasks
from pilotrun.common.errors import PilotrunError
from pilotrun.common.files import sha256_of_file
from pilotrun.report.record_check.evaluations import marker_sha256
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.run.folder_lock import RunFolderBusy, RunFolderLock
from pilotrun.run.marker import step_folder
from pilotrun.run.record import read_metrics_strict, read_run_json
from tests.commands.test_cli_bad_input import tree_hashes


def test_task_files_are_read_and_a_harness_name_needs_the_harness(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"context": "a", "choices": [" b", " c"], "label": 0}) + "\n")
    files, names = parse_tasks(f"{path}, hellaswag", "lm-eval")
    assert [t.name for t in files] == ["t"] and names == ["hellaswag"]
    with pytest.raises(PilotrunError, match="unknown task 'hellaswag'.*--harness lm-eval"):
        parse_tasks(f"{path},hellaswag", "pilotrun")
    with pytest.raises(PilotrunError, match="no task named"):
        parse_tasks(" , ", "pilotrun")
    with pytest.raises(PilotrunError, match="names a task twice"):
        parse_tasks(f"{path},{path}", "pilotrun")


@pytest.mark.slow
def test_evaluate_gives_the_in_loop_figures_of_the_same_checkpoint_and_puts_them_on_the_chain(
    task_run, tmp_path
):
    _data, task, source = task_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    checkpoint_before = tree_hashes(step_folder(run, 20))
    result = evaluate_checkpoint(run, str(task), step=20)
    in_loop = next(e for e in read_metrics_strict(run) if e["event"] == "downstream" and e["step"] == 20)
    figures = result["tasks"]["fineweb_next"]
    for key in ("acc", "acc_norm", "correct", "examples", "chance", "acc_above_chance", "sha256"):
        assert figures[key] == in_loop["tasks"]["fineweb_next"][key], key
    assert tree_hashes(step_folder(run, 20)) == checkpoint_before  # never writes into a checkpoint
    events = read_metrics_strict(run, read_run_json(run)["run_id"])  # the chain holds, the event on it
    event = events[-1]
    assert event["event"] == "evaluation" and event["session_id"].startswith("evaluate-")
    assert (event["step"], event["checkpoint"]["step"]) == (20, 20)
    assert event["checkpoint"]["marker_sha256"] == marker_sha256(run, 20)
    written = run / event["results"]["path"]
    assert (
        written.parent == run / "evals" / "step-00000020"
        and sha256_of_file(written) == event["results"]["sha256"]
    )
    identity = json.loads(written.read_text())["identity"]
    assert identity["checkpoint"]["marker_sha256"] == marker_sha256(run, 20)
    assert (identity["harness"], identity["shots"], identity["limit"], identity["seed"]) == (
        "pilotrun",
        0,
        0,
        0,
    )
    assert identity["task_sources"] == {"fineweb_next": str(task)}
    assert summarize_run(run).valid


@pytest.mark.slow
def test_a_run_held_by_a_live_session_is_refused_and_nothing_written(task_run, tmp_path):
    _data, task, source = task_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    lock = RunFolderLock.acquire(run)
    try:
        before = tree_hashes(run)
        with pytest.raises(PilotrunError, match="held by a live session"):
            evaluate_checkpoint(run, str(task))
        assert tree_hashes(run) == before
    finally:
        lock.release()


@pytest.mark.slow
def test_a_session_started_during_the_scoring_makes_it_refuse_with_nothing_written(task_run, tmp_path,
                                                                                   monkeypatch):
    import pilotrun.commands.evaluate as evaluate_module

    _data, task, source = task_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    before = tree_hashes(run)
    held = []
    real_scorer = evaluate_module._scorer

    def scorer_then_a_session_starts(*args, **kwargs):
        found = real_scorer(*args, **kwargs)
        held.append(RunFolderLock.acquire(run))
        return found

    monkeypatch.setattr(evaluate_module, "_scorer", scorer_then_a_session_starts)
    try:
        with pytest.raises(RunFolderBusy):
            evaluate_checkpoint(run, str(task), limit=2)
    finally:
        held[0].release()
    after = tree_hashes(run)
    after.pop("run.lock"), before.pop("run.lock")  # the holder line the session wrote, not evaluate
    assert after == before


def _cli(capsys, argv: list[str]) -> tuple[int, list[str]]:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip().splitlines()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unknown task", "malformed task", "no checkpoint at step", "missing extra",
                                  "missing task file"])
def test_bad_input_is_one_line_exit_2_and_nothing_written(task_run, tmp_path, capsys, monkeypatch, case):
    _data, task, source = task_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    malformed = tmp_path / "broken.jsonl"
    malformed.write_text(json.dumps({"context": "a", "choices": [" b"], "label": 0}) + "\n")
    argv = {"unknown task": ["--tasks", "no_such_task"],
            "malformed task": ["--tasks", str(malformed)],
            "no checkpoint at step": ["--tasks", str(task), "--step", "30"],
            "missing extra": ["--tasks", str(task), "--harness", "lm-eval"],
            "missing task file": ["--tasks", str(tmp_path / "absent.jsonl")]}[case]
    if case == "missing extra":
        real_import = builtins.__import__

        def no_lm_eval(name, *args, **kwargs):
            if name == "lm_eval" or name.startswith("lm_eval."):
                raise ImportError(name)
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", no_lm_eval)
    before = tree_hashes(run)
    code, lines = _cli(capsys, ["evaluate", str(run), *argv])
    assert code == 2 and len(lines) == 1, lines
    expected = {
        "unknown task": "unknown task 'no_such_task'",
        "malformed task": "broken.jsonl line 1",
        "no checkpoint at step": "--step 30: no committed checkpoint",
        "missing extra": "pilotrun[eval]",
        "missing task file": "absent.jsonl: not found",
    }[case]
    assert expected in lines[0]
    assert tree_hashes(run) == before


def test_not_a_run_folder_is_refused(tmp_path, capsys):
    task = tmp_path / "t.jsonl"
    task.write_text(json.dumps({"context": "a", "choices": [" b", " c"], "label": 0}) + "\n")
    code, lines = _cli(capsys, ["evaluate", str(tmp_path / "nowhere"), "--tasks", str(task)])
    assert code == 2 and len(lines) == 1 and "run folder not found" in lines[0]
    assert not Path(tmp_path / "nowhere").exists()


@pytest.mark.parametrize("device, said", [
    ("cuda", "--device 'cuda': CUDA is not available on this machine"),
    ("cpu;x", "--device 'cpu;x': not a device name (cpu, cuda or cuda:N)"),
    ("meta", "--device 'meta': pilotrun evaluates on cpu or cuda[:N]"),
    ("cpu\x1b[2J", "--device 'cpu\\x1b[2J': not a device name"),
])
def test_a_device_this_machine_lacks_or_that_is_no_name_is_one_line_exit_2(
    tmp_path, capsys, monkeypatch, device, said
):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a machine with a GPU
    task = tmp_path / "t.jsonl"
    task.write_text(json.dumps({"context": "a", "choices": [" b", " c"], "label": 0}) + "\n")
    code, lines = _cli(capsys, ["evaluate", str(tmp_path / "run"), "--tasks", str(task), "--device", device])
    assert code == 2 and len(lines) == 1 and said in lines[0], lines


@pytest.mark.slow
def test_a_hostile_task_file_name_is_printed_escaped_on_one_line(task_run, tmp_path, capsys):
    """A task's name is its file's stem: one carrying an escape sequence, a bell and a newline is printed
    escaped, on the one line of its figures."""
    _data, task, source = task_run
    run = tmp_path / "run"
    shutil.copytree(source, run)
    hostile = tmp_path / "t\x1b]0;owned\x07\nfake: acc 1.0000.jsonl"
    hostile.write_text(task.read_text())
    code = main(["evaluate", str(run), "--tasks", str(hostile), "--limit", "2"])
    out = capsys.readouterr().out
    assert code == 0 and not any(c in out for c in "\x1b\x07"), out
    assert not [line for line in out.splitlines() if line.startswith("fake: acc")]
    assert [
        line for line in out.splitlines() if line.startswith("t\\x1b]0;owned\\x07\\nfake: acc 1.0000: acc ")
    ]
