"""continuity.py: the pilot must have resumed (replayed windows bit-identical), end on an intact checkpoint,
and name every recipe change with the update it took effect from."""



from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.verdict.thresholds import FAIL, PASS, WARN, Thresholds
from pilotrun.report.verdict.verdict import judge, judge_summary
from tests.report.synthetic import SyntheticRun, crashed_and_resumed, verdict_of


def test_resumed_fails_without_resume_unless_waived(tmp_path):
    def straight(builder, run_dir, **kw):
        run = builder(run_dir, **kw)
        run.start_session()
        run.train_until(run.max_steps)
        run.end_session()
        return run
    verdict, rules = verdict_of(tmp_path / "a", build=straight)
    assert rules["resumed"].status == FAIL and verdict.decision == "NO-GO"
    verdict, rules = verdict_of(tmp_path / "b", build=straight, thresholds=Thresholds(resume_required=False))
    assert rules["resumed"].status == WARN and verdict.decision == "GO"


def test_resumed_fails_when_a_replayed_window_differs(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.find("train", session="s1", step=25)["loss"] += 1e-12  # the rolled-back window before the kill
    run.write()
    verdict = judge_summary(summarize_run(tmp_path / "r"))
    rule = {r.name: r for r in verdict.rules}["resumed"]
    assert rule.status == FAIL and "train step 25 loss" in rule.figure


def test_resume_with_nothing_left_to_do_is_not_resume_evidence(tmp_path):
    def finished_then_resumed(builder, run_dir, **kw):
        run = builder(run_dir, **kw)
        run.start_session()
        run.train_until(run.max_steps)
        run.end_session()
        run.resume()  # from the final checkpoint: zero updates left
        run.end_session()
        return run
    verdict, rules = verdict_of(tmp_path, build=finished_then_resumed)
    assert verdict.summary.valid, verdict.summary.reasons
    assert verdict.summary.overall["resumes"] == 1
    assert rules["resumed"].status == FAIL and verdict.decision == "NO-GO"
    assert "no update applied after any of them" in rules["resumed"].figure


def test_recipe_change_on_resume_is_named_with_its_step_and_the_supported_recipe(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.run["allowed_changes"].append(
        {"session_id": "s2", "key": "optim.muon.lr", "old": 0.003, "new": 0.001}
    )
    run.run["allowed_changes"].append({"session_id": "gone", "key": "optim.adamw.lr", "old": 1, "new": 2})
    run.write()
    verdict = judge(tmp_path / "r")
    rule = {r.name: r for r in verdict.rules}["recipe_changes"]
    assert verdict.decision == "GO" and rule.status == WARN
    # Session s2 resumed from checkpoint 20: its first update, 21, ran the new value.
    assert "1 change(s) on resume: optim.muon.lr 0.003 -> 0.001 from update 21" in rule.figure
    assert "over updates 21..60 (40 of 60)" in rule.figure
    data = verdict.to_dict()
    assert data["candidate"]["supported_from_update"] == 21
    assert data["candidate"]["changes"] == [{"key": "optim.muon.lr", "old": 0.003, "new": 0.001,
                                             "session_id": "s2", "from_update": 21}]
    assert [w["name"] for w in data["warnings"]] == ["recipe_changes"]


def test_final_checkpoint_damaged_or_missing_fails_can_continue(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    assert {r.name: r for r in judge(tmp_path / "r").rules}["final_checkpoint"].status == PASS
    damaged = tmp_path / "r" / "checkpoints" / "step-00000060" / "state.pt"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"!")  # same size, other bytes
    verdict = judge(tmp_path / "r")
    rule = {r.name: r for r in verdict.rules}["final_checkpoint"]
    assert rule.status == FAIL and verdict.decision == "NO-GO"
    assert f"{damaged}: sha256 differs" in rule.figure
    for path in damaged.parent.iterdir():
        path.unlink()
    damaged.parent.rmdir()
    rule = {r.name: r for r in judge(tmp_path / "r").rules}["final_checkpoint"]
    assert (
        rule.status == FAIL
        and "no checkpoint folder" in rule.figure
        and "newest committed: step 40" in rule.figure
    )


def test_replayed_windows_under_a_changed_recipe_are_not_compared(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.find("train", session="s1", step=25)["loss"] += 0.5  # the new recipe computes other figures
    run.run["allowed_changes"].append({"session_id": "s2", "key": "optim.grad_clip", "old": 1.0, "new": 0.5})
    run.write()
    rule = {r.name: r for r in judge(tmp_path / "r").rules}["resumed"]
    assert (
        rule.status == PASS
        and "no replayed window to compare; 3 replayed under a changed recipe" in rule.figure
    )


def test_recipe_change_that_did_not_reach_the_optimizer_fails(tmp_path):
    """run.json says Muon's LR became 0.001 from update 21, but the windows' lr / lr_multiplier (the base LR
    the optimizer used) stayed at 0.003: the recorded recipe is not what ran."""
    run = crashed_and_resumed(tmp_path / "r")
    run.run["optimizer"]["groups"] = [{"group": "attention", "optimizer": "muon", "lr": 0.001}]
    run.run["recipe"]["optim"]["muon"] = {"lr": 0.001}
    run.run["allowed_changes"].append(
        {"session_id": "s2", "key": "optim.muon.lr", "old": 0.003, "new": 0.001}
    )
    for event in run.events:
        if event["event"] == "train":
            event["lr"], event["lr_multiplier"] = 0.003 * 0.5, 0.5
    run.write()
    rule = {r.name: r for r in judge(tmp_path / "r").rules}["recipe_changes"]
    assert rule.status == FAIL and "ran a peak LR of 0.003 in group attention (muon)" in rule.figure
    for event in run.events:
        if event["event"] == "train" and event["session_id"] == "s2":
            event["lr"] = 0.001 * 0.5
    run.write()
    assert {r.name: r for r in judge(tmp_path / "r").rules}["recipe_changes"].status == WARN


def test_a_resume_on_another_thread_count_names_it_as_the_cause_and_proves_no_exact_continuation(tmp_path):
    """The thread count may decide the order of a reduction's additions: a resume on other threads is recorded
    (run.json's not_exact) as the update from which bit-exactness is not promised. Its replayed windows that
    differ name that cause instead of failing as broken exactness, and it is no proof of exact
    continuation."""
    run = crashed_and_resumed(tmp_path / "r")
    run.find("train", session="s1", step=25)["loss"] += 1e-12  # the last bit, as another thread split gives
    entry = next(e for e in run.run["sessions"] if e["session_id"] == "s2")
    entry["not_exact"] = {
        "from_update": 21,
        "changes": [{"key": "hardware.torch_threads", "old": 1, "new": 2}],
    }
    run.write()
    rule = {r.name: r for r in judge(tmp_path / "r").rules}["resumed"]
    assert rule.status == FAIL and "such a resume proves no exact continuation" in rule.figure
    assert "cause: hardware.torch_threads 1 -> 2 from update 21" in rule.figure
    assert "train step 25 loss" in rule.figure and "never proved it can continue" in rule.figure
    # Beside a resume on the same threads (the pilot's own), the run has proved it: PASS, the cause still
    # named.
    run = SyntheticRun(tmp_path / "b")
    run.start_session()
    run.train_until(33)
    run.kill()
    run.resume()  # s2 from 20, on other threads
    run.train_until(50)
    run.kill()
    run.resume()  # s3 from 40, on s2's threads
    run.train_until(run.max_steps)
    run.end_session()
    run.find("train", session="s1", step=25)["loss"] += 1e-12
    entry = next(e for e in run.run["sessions"] if e["session_id"] == "s2")
    entry["not_exact"] = {
        "from_update": 21,
        "changes": [{"key": "hardware.torch_threads", "old": 1, "new": 2}],
    }
    run.write()
    rule = {r.name: r for r in judge(tmp_path / "b").rules}["resumed"]
    assert (
        rule.status == PASS and "1 resume(s) with training after them: session s3 from step 40" in rule.figure
    )
    assert "cause: hardware.torch_threads 1 -> 2 from update 21" in rule.figure


def test_a_resume_on_another_thread_count_replayed_bit_identical_warns_naming_the_change(tmp_path):
    """The replay is the fact: a resume on 2 threads after 1 whose replayed windows are all bit-identical has
    shown the continuation (WARN naming the change, exactness not promised across it), not a NO-GO; one window
    that differs makes it FAIL with the change named as the likely cause."""
    run = crashed_and_resumed(tmp_path / "r")
    entry = next(e for e in run.run["sessions"] if e["session_id"] == "s2")
    entry["not_exact"] = {
        "from_update": 21,
        "changes": [{"key": "hardware.torch_threads", "old": 1, "new": 2}],
    }
    run.write()
    verdict = judge(tmp_path / "r")
    rule = {r.name: r for r in verdict.rules}["resumed"]
    assert rule.status == WARN and verdict.decision == "GO"
    assert "session s2: hardware.torch_threads 1 -> 2 from update 21" in rule.figure
    assert (
        "3 replayed window(s) after it, all bit-identical: the replay shows the continuation" in rule.figure
    )
    run.find("train", session="s1", step=25)["loss"] += 1e-12
    run.write()
    verdict = judge(tmp_path / "r")
    rule = {r.name: r for r in verdict.rules}["resumed"]
    assert rule.status == FAIL and verdict.decision == "NO-GO"
    assert "likely cause: hardware.torch_threads 1 -> 2 from update 21" in rule.figure
