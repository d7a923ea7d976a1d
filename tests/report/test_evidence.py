"""evidence.py: what the judges read from a summary, and record_valid."""

from pilotrun.report.evidence import judge_record_valid, lacks, recipe_value, train_events, window_of
from pilotrun.report.summarize import summarize_run
from pilotrun.report.thresholds import FAIL, PASS, Thresholds
from tests.report.synthetic import crashed_and_resumed, verdict_of


def test_record_valid_fails_on_inconsistent_record(tmp_path):
    def change(run):
        run.tokens_per_microbatch += 1  # session_start then disagrees with every window's tokens
    verdict, rules = verdict_of(tmp_path, change)
    assert rules["record_valid"].status == FAIL and verdict.decision == "NO-GO"
    assert "NO-GO: record_valid" in verdict.statement


def test_the_readers_take_the_kept_history_and_the_recorded_recipe(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    summary = summarize_run(tmp_path / "r")
    trains = train_events(summary)
    assert trains and all(e["event"] == "train" for e in trains)
    assert trains == [e for e in summary.kept_events if e["event"] == "train"]  # never the rolled-back windows
    assert window_of(trains[0])["updates_applied"] > 0 and window_of({"event": "val"}) == {}
    assert recipe_value(summary, "optim.grad_clip") == 1.0
    assert recipe_value(summary, "optim.nope.deeper") is None  # missing is None, never a default
    found = lacks("optim.grad_clip", "bound")
    assert found.status == FAIL and "run.json's recipe lacks optim.grad_clip" in found.figure


def test_record_valid_passes_a_valid_record_and_names_the_first_problem(tmp_path):
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    assert judge_record_valid(summarize_run(tmp_path / "r"), Thresholds()).status == PASS
    run.run["tokens_per_update"] = 0
    run.write()
    found = judge_record_valid(summarize_run(tmp_path / "r"), Thresholds())
    assert found.status == FAIL and "first: run.json: tokens_per_update is 0" in found.figure
