"""evidence.py: what the judges read from a summary, record_valid, and data_passes on hand-made records."""

from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.verdict.evidence import (
    judge_data_passes,
    judge_record_valid,
    lacks,
    recipe_value,
    train_events,
    window_of,
)
from pilotrun.report.verdict.thresholds import FAIL, PASS, WARN, Thresholds
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
    # never the rolled-back windows
    assert trains == [e for e in summary.kept_events if e["event"] == "train"]
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


def _read_over(run, passes_at_end: float, mode: str = "successive"):
    """Size the training split so that the run's kept tokens make `passes_at_end` passes, and give each train
    window the loader's restart count the trainer would log (one pass = whole global batches of the split)."""
    run.run["recipe"]["train"]["data_mode"] = mode
    batches = round(run.max_steps * run.grad_accum / passes_at_end)  # microbatches = global batches
    seq_len = run.run["recipe"]["train"]["seq_len"]
    # A split whose tail fills no whole batch: one pass reads fewer tokens than the split holds.
    run.run["data"]["train"]["tokens"] = batches * run.tokens_per_microbatch + seq_len // 2 + 1
    for e in run.events:
        if e["event"] == "train":
            e["data_restarts"] = e["epoch"] = (e["tokens_seen"] // run.tokens_per_microbatch - 1) // batches


def _passes_finding(tmp_path, passes_at_end, mode="successive", thresholds=None):
    run = crashed_and_resumed(tmp_path / "r")
    _read_over(run, passes_at_end, mode)
    run.write()
    return judge_data_passes(summarize_run(tmp_path / "r"), thresholds or Thresholds())


def test_data_passes_passes_a_run_that_read_each_token_once(tmp_path):
    found = judge_data_passes(summarize_run(crashed_and_resumed(tmp_path / "r").write()), Thresholds())
    assert found.status == PASS and "(0 restarts): no token read twice" in found.figure
    assert found.figure.startswith("0.38 of one pass")  # 60 updates x 32 tokens of a 5000-token split


def test_data_passes_fails_five_successive_passes_and_names_them(tmp_path):
    found = _passes_finding(tmp_path, 5)
    assert found.status == FAIL
    assert found.figure.startswith("5.0 passes over the training split (4 restarts)")
    assert "one pass = 24 global batches of 16 tokens of the split's 389" in found.evidence


def test_data_passes_warns_on_a_single_re_read_and_below_the_bound(tmp_path):
    once = _passes_finding(tmp_path / "once", 2)
    assert once.status == WARN and once.figure.startswith("2.0 passes over the training split (1 restart)")
    allowed = _passes_finding(tmp_path / "five", 5, thresholds=Thresholds(max_train_passes=5))
    assert allowed.status == WARN and "5.0 passes" in allowed.figure


def test_data_passes_counts_the_pass_the_loader_reads_not_the_whole_split(tmp_path):
    """Tokens over the split's size read 4.8 passes and hide the fifth; the loader read five."""
    run = crashed_and_resumed(tmp_path / "r")
    _read_over(run, 5)
    # one window more: no whole batch
    run.run["data"]["train"]["tokens"] += run.run["recipe"]["train"]["seq_len"]
    run.write()
    summary = summarize_run(tmp_path / "r")
    assert summary.overall["passes_over_train_split"] < 5
    assert judge_data_passes(summary, Thresholds()).figure.startswith("5.0 passes")


def test_data_passes_warns_for_repeat_batch_and_fails_without_the_mode_once_re_read(tmp_path):
    repeat = _passes_finding(tmp_path / "repeat", 5, mode="repeat_batch")
    assert repeat.status == WARN and "one batch read 120 times" in repeat.figure
    unknown = _passes_finding(tmp_path / "unknown", 2, mode=None)
    assert unknown.status == FAIL and "lacks train.data_mode" in unknown.figure
