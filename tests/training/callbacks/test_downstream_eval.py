"""pilotrun/training/callbacks/downstream_eval.py: the in-loop tasks on their cadence, one `downstream` event
each time, in the eval phase; a bad task file refused before anything is written."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from pilotrun.common.errors import DataError
from pilotrun.run.mirror import scalar_fields
from pilotrun.run.record import read_metrics_strict, read_run_json
from pilotrun.training.callbacks.base import PRIORITY_CHECKPOINT, PRIORITY_EVAL
from pilotrun.training.callbacks.downstream_eval import PRIORITY_DOWNSTREAM, DownstreamEvalCallback
from pilotrun.training.trainer import Trainer
from tests.choice_task_fixture import task_recipe
from tests.training.callbacks.test_base import loop_state


def test_due_on_its_cadence_after_an_applied_update_and_never_without_tasks():
    section = SimpleNamespace(every=4, limit=0, tasks=[])  # train.downstream
    callback = DownstreamEvalCallback(section, tasks=[object()])
    assert callback.phase == "eval" and PRIORITY_EVAL < PRIORITY_DOWNSTREAM < PRIORITY_CHECKPOINT
    assert callback.due(loop_state(step=8)) and not callback.due(loop_state(step=9))
    assert not callback.due(loop_state(step=8, applied=False))
    assert not DownstreamEvalCallback(section, tasks=[]).due(loop_state(step=8))
    assert not DownstreamEvalCallback(SimpleNamespace(every=0), tasks=[object()]).due(loop_state(step=8))


def test_a_malformed_task_file_is_refused_before_the_run_folder_is_made(tmp_path, builtin_data_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(DataError, match="bad.jsonl line 1: not JSON"):
        Trainer(task_recipe(bad), builtin_data_dir, tmp_path / "run", progress=False, out=io.StringIO())
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_tasks_are_scored_on_the_cadence_into_the_record_the_trackers_and_the_eval_phase(task_run):
    data, task, run_dir = task_run
    events = read_metrics_strict(run_dir, read_run_json(run_dir)["run_id"])
    scored = [e for e in events if e["event"] == "downstream"]
    assert [e["step"] for e in scored] == [20, 40]
    figures = scored[-1]["tasks"]["fineweb_next"]
    assert figures["examples"] == 40 and figures["chance"] == 0.25 and figures["acc"] >= 0.5
    assert figures["acc_above_chance"] == figures["acc"] - figures["chance"]
    # each downstream event lands before the checkpoint of its step
    order = [(e["event"], e["step"]) for e in events if e["event"] in ("downstream", "checkpoint")]
    assert order == [("downstream", 20), ("checkpoint", 20), ("downstream", 40), ("checkpoint", 40)]
    tags = dict(scalar_fields(scored[-1]))
    assert tags["downstream/tasks/fineweb_next/acc"] == figures["acc"]
    assert tags["downstream/tasks/fineweb_next/acc_above_chance"] == figures["acc_above_chance"]
    end = [e for e in events if e["event"] == "session_end"][-1]
    assert end["time_split"]["eval_seconds"] >= sum(e["seconds"] for e in scored) > 0


@pytest.mark.slow
@pytest.mark.shared_fixtures
def test_scoring_in_the_loop_leaves_the_training_bit_for_bit_as_it_was(builtin_data_dir, tmp_path):
    from pilotrun.config import load_run_config
    from tests.choice_task_fixture import REPO_ROOT, fineweb_task

    task = fineweb_task(tmp_path / "tasks", count=4)
    runs = {}
    for name, extra in (
        ("plain", []),
        ("scored", [f"train.downstream_tasks=[{task}]", "train.downstream_every=2"]),
    ):
        config = load_run_config(REPO_ROOT / "configs" / "smoke.yaml", ["train.num_threads=1", *extra])
        trainer = Trainer(config, builtin_data_dir, tmp_path / name, progress=False, out=io.StringIO())
        trainer.run()
        events = read_metrics_strict(tmp_path / name)
        runs[name] = ([e["loss"] for e in events if e["event"] in ("train", "val")],
                      {k: v.clone() for k, v in trainer.session.raw_model.state_dict().items()})
    assert [e for e in read_metrics_strict(tmp_path / "scored") if e["event"] == "downstream"]
    assert runs["plain"][0] == runs["scored"][0]
    assert all(torch.equal(runs["plain"][1][k], runs["scored"][1][k]) for k in runs["plain"][1])
