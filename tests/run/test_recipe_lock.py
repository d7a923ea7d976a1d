"""The frozen lock's format: its self-hash, the comparison a frozen run is held to, and the status summarize
reports."""

import json

import pytest

from pilotrun.common.files import canonical_sha256
from pilotrun.run.recipe_lock import (
    FreezeError,
    check_against_lock,
    check_resumed_lock,
    frozen_candidate_status,
    frozen_run_facts,
    load_lock,
    write_lock,
)

RECIPE = {"train": {"max_steps": 240, "batch_size": 8}, "optim": {"muon": {"lr": 0.003}}}


def _lock(recipe=RECIPE, data="a" * 64):
    lock = {"format": "pilotrun.recipe-lock/1", "recipe": recipe, "data": {"metadata_sha256": data},
            "pilot": {"run_id": "run-p"}, "decision": "GO", "despite_no_go": False}
    lock["sha256"] = canonical_sha256(lock)
    return lock


def _with(recipe, key, value):
    copy = json.loads(json.dumps(recipe))
    section, name = key.rsplit(".", 1)
    node = copy
    for part in section.split("."):
        node = node[part]
    node[name] = value
    return copy


def test_check_against_lock_splits_allowed_from_refused_differences():
    lock = _lock()
    recipe = _with(_with(RECIPE, "train.max_steps", 20000), "optim.muon.lr", 0.002)
    accepted, refused = check_against_lock(lock, recipe, "b" * 64, ["recipe.train.max_steps"])
    assert accepted == [{"key": "train.max_steps", "lock": 240, "run": 20000}]
    assert refused == [{"key": "optim.muon.lr", "lock": 0.003, "run": 0.002},
                       {"key": "data.metadata_sha256", "lock": "a" * 64, "run": "b" * 64}]
    assert check_against_lock(lock, RECIPE, "a" * 64, []) == ([], [])
    # A key present on one side only is a difference too.
    _, refused = check_against_lock(lock, dict(RECIPE, model={"d_model": 64}), "a" * 64, [])
    assert refused == [{"key": "model.d_model", "lock": None, "run": 64}]


def test_a_lock_that_said_train_tensorboard_accepts_the_run_loaded_from_it():
    # `train --frozen LOCK` loads the lock's recipe (config.loaded_recipe), folding the alias into
    # train.log.trackers; both keys are machine keys, so nothing is refused and the lock itself is never
    # rewritten.
    from pilotrun.config import RunConfig, config_to_dict, loaded_recipe

    recipe = config_to_dict(RunConfig())
    recipe["train"]["log"]["tensorboard"] = True
    lock = _lock(recipe)
    run = config_to_dict(loaded_recipe(lock["recipe"]))
    assert (run["train"]["log"]["tensorboard"], run["train"]["log"]["trackers"]) == (False, ["tensorboard"])
    assert check_against_lock(lock, run, "a" * 64, []) == ([], [])
    assert lock["recipe"]["train"]["log"]["tensorboard"] is True  # the lock's recipe is untouched


def test_frozen_run_facts_refuse_every_unlisted_difference_on_one_line():
    recipe = _with(_with(RECIPE, "train.batch_size", 16), "optim.muon.lr", 0.002)
    with pytest.raises(FreezeError) as caught:
        frozen_run_facts(_lock(), "l.json", recipe, "b" * 64, ["optim.muon.lr"])
    message = str(caught.value)
    assert "\n" not in message and "2 difference(s)" in message
    assert "train.batch_size (lock 8, run 16)" in message and "data.metadata_sha256" in message
    facts = frozen_run_facts(_lock(), "l.json", recipe, "a" * 64, ["optim.muon.lr", "train.batch_size"])
    assert facts["lock_sha256"] == _lock()["sha256"] and facts["allowed"] == [
        "optim.muon.lr",
        "train.batch_size",
    ]
    assert [d["key"] for d in facts["differences"]] == ["optim.muon.lr", "train.batch_size"]


def test_other_data_than_the_locks_asks_whether_data_and_lock_are_the_right_ones():
    with pytest.raises(FreezeError, match=r"data.metadata_sha256 .*: is --data the right folder, and "
                                          r"this the right lock\?"):
        frozen_run_facts(_lock(), "l.json", RECIPE, "b" * 64, [])


def test_a_run_resumed_under_another_lock_or_none_asks_whether_this_is_the_right_run_folder(tmp_path):
    check_resumed_lock(_lock(), "l.json", tmp_path / "new")  # no run yet: --resume auto starts it
    run_dir = tmp_path / "long"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"frozen": frozen_run_facts(_lock(), "l.json", RECIPE,
                                                                             "a" * 64, [])}))
    check_resumed_lock(_lock(), "l.json", run_dir)  # its own lock
    other = _lock(data="b" * 64)
    with pytest.raises(FreezeError) as caught:
        check_resumed_lock(other, "other.json", run_dir)
    message = str(caught.value)
    assert f"was started from another lock (sha256 {_lock()['sha256'][:16]}" in message
    assert "is " + str(run_dir) + " the right run folder, and this the right lock?" in message
    assert "--allow-change" not in message
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r"}))
    with pytest.raises(FreezeError, match=r"from a recipe \(--config\), not from a lock"):
        check_resumed_lock(_lock(), "l.json", run_dir)


def test_load_lock_detects_an_edited_lock(tmp_path):
    path = tmp_path / "lock.json"
    path.write_text(json.dumps(_lock()))
    assert load_lock(path)["recipe"] == RECIPE
    path.write_text(json.dumps(dict(_lock(), decision="NO-GO"), indent=2))  # sha256 no longer matches
    with pytest.raises(FreezeError, match="the lock was edited"):
        load_lock(path)
    path.write_text("{")
    with pytest.raises(FreezeError, match="not valid JSON"):
        load_lock(path)
    with pytest.raises(FreezeError, match="not found"):
        load_lock(tmp_path / "missing.json")


def test_frozen_candidate_status_reports_drift_after_the_start(tmp_path):
    lock_path = tmp_path / "lock.json"
    lock_path.write_text(json.dumps(_lock()))
    recipe = _with(RECIPE, "train.max_steps", 1000)
    facts = frozen_run_facts(_lock(), lock_path, recipe, "a" * 64, ["train.max_steps"])
    run = {"frozen": facts, "recipe": recipe, "data": {"train": {"metadata_sha256": "a" * 64}}}
    status = frozen_candidate_status(run)
    assert status["matches"] is True and status["lock_file"] == "unchanged" and status["drift"] == []
    # A later resume changed the LR: the run no longer runs the frozen candidate.
    run["recipe"] = _with(recipe, "optim.muon.lr", 0.001)
    status = frozen_candidate_status(run)
    assert status["matches"] is False and status["drift"] == [
        {"key": "optim.muon.lr", "lock": 0.003, "run": 0.001}
    ]
    run["recipe"] = recipe
    lock_path.unlink()
    assert frozen_candidate_status(run)["lock_file"] == "missing" and frozen_candidate_status(run)["matches"]
    assert frozen_candidate_status({"recipe": recipe}) is None


CODE = {"commit": "c" * 40, "dirty": False, "diff_sha256": "d" * 64}


def _lock_with_code(code=CODE):
    lock = {k: v for k, v in _lock().items() if k != "sha256"}
    lock["code"] = code
    lock["sha256"] = canonical_sha256(lock)
    return lock


def test_other_code_is_refused_unless_allowed_and_the_allowance_is_recorded():
    lock = _lock_with_code()
    new_commit = dict(CODE, commit="e" * 40)
    _, refused = check_against_lock(lock, RECIPE, "a" * 64, [], code=new_commit)
    assert refused == [
        {"key": "code", "lock": "commit cccccccccccc clean", "run": "commit eeeeeeeeeeee clean"}
    ]
    # The same commit with uncommitted changes is other code too; the same diff on both sides is the same
    # code.
    dirty = dict(CODE, dirty=True, diff_sha256="f" * 64)
    assert check_against_lock(lock, RECIPE, "a" * 64, [], code=dirty)[1][0]["run"] == \
        "commit cccccccccccc dirty (diff ffffffff)"
    assert check_against_lock(dict(lock, code=dirty), RECIPE, "a" * 64, [], code=dict(dirty)) == ([], [])
    with pytest.raises(FreezeError, match=r"1 difference\(s\).*code \(lock"):
        frozen_run_facts(lock, "l.json", RECIPE, "a" * 64, [], code=new_commit)
    facts = frozen_run_facts(lock, "l.json", RECIPE, "a" * 64, ["code"], code=new_commit)
    assert facts["allowed"] == ["code"] and [d["key"] for d in facts["differences"]] == ["code"]
    assert facts["lock_code"] == CODE


def test_a_later_session_on_other_code_is_drift_even_when_the_recipe_still_matches(tmp_path):
    lock = _lock_with_code()
    lock_path = tmp_path / "lock.json"
    lock_path.write_text(json.dumps(lock))
    facts = frozen_run_facts(lock, lock_path, RECIPE, "a" * 64, [], code=CODE)
    run = {"frozen": facts, "recipe": RECIPE, "data": {"train": {"metadata_sha256": "a" * 64}},
           "sessions": [{"session_id": "s1", "git": CODE}]}
    assert frozen_candidate_status(run)["matches"] is True
    run["sessions"].append({"session_id": "s2", "git": dict(CODE, dirty=True, diff_sha256="9" * 64)})
    status = frozen_candidate_status(run)
    assert status["matches"] is False
    assert status["drift"] == [{"key": "code", "lock": "commit cccccccccccc clean",
                                "run": "commit cccccccccccc dirty (diff 99999999) in session s2"}]


def test_the_downstream_tasks_are_watching_not_recipe_a_long_run_may_name_its_own_copies():
    from pilotrun.run.recipe_lock import lock_differences

    pilot = {"train": {"downstream_tasks": ["/pilot/tasks/arc.jsonl"], "downstream_every": 50,
                       "downstream_limit": 0, "max_steps": 100}}
    long = {"train": {"downstream_tasks": ["/cluster/tasks/arc.jsonl"], "downstream_every": 5000,
                      "downstream_limit": 200, "max_steps": 100}}
    assert lock_differences(pilot, "d", long, "d") == []


@pytest.mark.parametrize("figure", [float("inf"), float("-inf"), float("nan")])
def test_the_writer_refuses_a_non_finite_figure_by_its_field_and_writes_nothing(tmp_path, figure):
    """No lock section takes a non-finite figure from a measurement: one reaching the writer is a bug, refused
    in one line that names its field (never json's 'Out of range float values' without one)."""
    lock = _lock()
    lock["watch"] = {"throughput": {"low": 10.0, "points": [[1, 2.0], [2, figure]]}}
    with pytest.raises(FreezeError) as refused:
        write_lock(tmp_path / "lock.json", lock)
    message = str(refused.value)
    assert "\n" not in message and "the lock's watch.throughput.points.1.1 is NaN or infinite" in message
    assert list(tmp_path.iterdir()) == []
