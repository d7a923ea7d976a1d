"""The run record cannot be edited unnoticed (record.py's hash chain, checked by summarize), on records the
real trainer wrote: a run of 8 updates, then a resume that goes on to 12.

Each edit a person could make with a text editor is detected and named: one loss changed with every counter
kept consistent, a line deleted, two lines swapped, the last lines cut, run.json's recipe changed. A crash's
torn last line is cut by the next session without breaking the chain. `--require-step` needs a completed
session end and an intact committed checkpoint at that step, and the latest session is labelled.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from pilotrun.report.record_check.summarize import format_summary, summarize_run
from tests.report.synthetic import SyntheticRun

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["train.num_threads=1", "train.checkpoint_every=4", "train.eval_every=4", "train.log_every=2",
          "optim.schedule.horizon=12"]


def _train(data_dir: Path, run_dir: Path, *overrides: str, resume: bool = False) -> int:
    args = ["train", "--config", str(ROOT / "configs" / "smoke.yaml"), "--data", str(data_dir),
            "--run-dir", str(run_dir)]
    for override in (*COMMON, *overrides):
        args += ["--set", override]
    return main(args + (["--resume"] if resume else []))


@pytest.fixture(scope="module")
def real_run(builtin_data_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("integrity") / "run"
    assert _train(builtin_data_dir, run_dir, "train.max_steps=8") == 0
    assert _train(builtin_data_dir, run_dir, "train.max_steps=12", resume=True) == 0
    return run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(run_dir, target)
    return target


def _lines(run_dir: Path) -> list[str]:
    return (run_dir / "metrics.jsonl").read_text().splitlines()


def _write_lines(run_dir: Path, lines: list[str]) -> None:
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _index(lines: list[str], event: str, step: int) -> int:
    return next(i for i, line in enumerate(lines) if json.loads(line)["event"] == event
                and json.loads(line)["step"] == step)


@pytest.mark.slow
def test_the_untouched_record_is_valid_complete_and_labels_its_latest_session(real_run):
    summary = summarize_run(real_run, require_step=12)
    assert summary.valid, summary.reasons
    assert [s.latest for s in summary.sessions] == [False, True]
    assert summary.to_dict()["sessions"][1]["latest"] is True
    assert summary.overall["final_checkpoint"]["intact"] and summary.overall["final_checkpoint"]["step"] == 12
    text = format_summary(summary)
    latest_id = summary.sessions[1].session_id
    assert f"latest session: {latest_id} (completed at step 12; kept)" in text
    assert "final checkpoint at step 12: intact" in text
    # Every line carries its chain value, every session where it stood, every marker the head at its commit.
    run = json.loads((real_run / "run.json").read_text())
    assert all(json.loads(line)["chain"] for line in _lines(real_run))
    assert all(s["chain_start"] and s["chain_end"] for s in run["sessions"])
    marker = json.loads((real_run / "checkpoints" / "step-00000012" / "COMMITTED.json").read_text())
    assert marker["meta"]["metrics_chain_head"] in {json.loads(line)["chain"] for line in _lines(real_run)}


def test_one_loss_edited_with_the_counters_kept_is_named_by_its_line(real_run, tmp_path):
    run_dir = _copy(real_run, tmp_path)
    lines = _lines(run_dir)
    index = _index(lines, "train", 6)
    event = json.loads(lines[index])
    edited = lines[index].replace(
        f'"loss":{json.dumps(event["loss"])}', f'"loss":{json.dumps(event["loss"] - 0.5)}'
    )
    assert edited != lines[index]
    lines[index] = edited
    _write_lines(run_dir, lines)
    summary = summarize_run(run_dir)
    assert not summary.valid
    broken = [r for r in summary.reasons if "hash chain broken" in r]
    assert len(broken) == 1 and broken[0].startswith(f"metrics.jsonl line {index + 1} (train, step 6)"), (
        summary.reasons
    )
    # the counters agree
    assert all("went backwards" not in r and "grew by" not in r for r in summary.reasons)


def test_a_deleted_line_breaks_the_chain_at_the_line_after_the_gap(real_run, tmp_path):
    run_dir = _copy(real_run, tmp_path)
    lines = _lines(run_dir)
    index = _index(lines, "val", 4)  # a val line: deleting it leaves every counter consistent
    del lines[index]
    _write_lines(run_dir, lines)
    summary = summarize_run(run_dir)
    assert not summary.valid
    assert any(r.startswith(f"metrics.jsonl line {index + 1} ") and "hash chain broken" in r
               for r in summary.reasons), summary.reasons


def test_a_swapped_pair_of_lines_breaks_both_and_the_line_after(real_run, tmp_path):
    run_dir = _copy(real_run, tmp_path)
    lines = _lines(run_dir)
    index = _index(lines, "val", 4)
    lines[index], lines[index + 1] = lines[index + 1], lines[index]  # val and checkpoint of step 4
    _write_lines(run_dir, lines)
    summary = summarize_run(run_dir)
    broken = [r for r in summary.reasons if "hash chain broken" in r]
    # Each of the two follows the wrong line now, and so does the line after them.
    assert [r.split(" (")[0] for r in broken] == [f"metrics.jsonl line {index + n}" for n in (1, 2, 3)]


def test_lines_cut_from_the_end_are_detected_through_run_json(real_run, tmp_path):
    run_dir = _copy(real_run, tmp_path)
    _write_lines(run_dir, _lines(run_dir)[:-1])  # the session_end: the record would read as a killed session
    summary = summarize_run(run_dir)
    assert not summary.valid
    assert any("chain_end is not its last line" in r for r in summary.reasons), summary.reasons


def test_a_changed_recipe_in_run_json_is_detected(real_run, tmp_path):
    run_dir = _copy(real_run, tmp_path)
    run = json.loads((run_dir / "run.json").read_text())
    run["recipe"]["optim"]["muon"]["lr"] *= 2
    (run_dir / "run.json").write_text(json.dumps(run, indent=2))
    summary = summarize_run(run_dir)
    assert not summary.valid
    assert any(r.startswith("run.json: recipe differ(s) from what the latest session recorded") for r in
               summary.reasons), summary.reasons


@pytest.mark.slow
def test_a_torn_tail_after_a_kill_is_cut_by_the_resume_and_the_chain_holds(builtin_data_dir, tmp_path):
    """A kill mid-write: the first session's log ends inside a line, with no session_end; run.json has no end
    for it. The resume cuts the torn tail (noted), appends, and the chain verifies end to end."""
    run_dir = tmp_path / "run"
    assert _train(builtin_data_dir, run_dir, "train.max_steps=8") == 0
    lines = _lines(run_dir)
    keep = _index(lines, "checkpoint", 4) + 1
    torn = lines[keep][: len(lines[keep]) // 2]  # what a SIGKILL halfway through a write leaves
    (run_dir / "metrics.jsonl").write_text("\n".join(lines[:keep]) + "\n" + torn)
    run = json.loads((run_dir / "run.json").read_text())
    for key in ("chain_end", "end_reason", "ended_at"):
        run["sessions"][0].pop(key)
    (run_dir / "run.json").write_text(json.dumps(run, indent=2))
    shutil.rmtree(run_dir / "checkpoints" / "step-00000008")  # killed before it was written
    assert _train(builtin_data_dir, run_dir, "train.max_steps=8", resume=True) == 0
    summary = summarize_run(run_dir, require_step=8)
    assert summary.valid, summary.reasons
    assert any(f"cut a torn last line of {len(torn)} bytes" in note for note in summary.notes), summary.notes


def test_require_step_needs_a_completed_end_and_an_intact_final_checkpoint(real_run, tmp_path):
    run_dir = _copy(real_run, tmp_path)
    folder = run_dir / "checkpoints" / "step-00000012"
    victim = sorted(p for p in folder.iterdir() if p.name != "COMMITTED.json")[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    summary = summarize_run(run_dir, require_step=12)
    assert not summary.valid and not summary.overall["final_checkpoint"]["intact"]
    assert any(
        r.startswith("--require-step 12: final checkpoint:") and str(victim) in r for r in summary.reasons
    )
    shutil.rmtree(folder)
    summary = summarize_run(run_dir, require_step=12)
    assert any(r.startswith("--require-step 12: final checkpoint:") and "no checkpoint folder" in r
               for r in summary.reasons), summary.reasons
    assert summarize_run(run_dir).valid  # without --require-step, an ended run needs no checkpoint


def test_require_step_refuses_a_session_that_ended_in_error_without_a_checkpoint(tmp_path):
    run = SyntheticRun(tmp_path / "run", max_steps=30, checkpoint_every=20)
    run.start_session()
    run.train_until(30)
    run.end_session(reason="error")
    run.write()
    summary = summarize_run(run.run_dir, require_step=30)
    assert not summary.valid
    assert any("has reason 'error', not 'completed'" in r for r in summary.reasons), summary.reasons
    assert any(
        "final checkpoint:" in r and "step-00000030: no checkpoint folder" in r for r in summary.reasons
    )
    assert summarize_run(run.run_dir).valid  # the record itself is consistent: only the claim is refused


def test_summarize_exits_1_and_json_names_the_broken_line(real_run, tmp_path, capsys):
    run_dir = _copy(real_run, tmp_path)
    lines = _lines(run_dir)
    index = _index(lines, "train", 10)
    lines[index] = lines[index].replace('"event":"train"', '"event":"train" ', 1)  # one space, nothing else
    _write_lines(run_dir, lines)
    capsys.readouterr()
    assert main(["summarize", str(run_dir), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert not data["valid"] and any(
        r.startswith(f"metrics.jsonl line {index + 1} ") for r in data["reasons"]
    )
