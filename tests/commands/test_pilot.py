"""pilot: the whole rehearsal with the shipped recipe (stability, 240 updates), a real SIGKILL and a resume."""

import io
import json

import pytest

from pilotrun.commands.pilot import PilotError, configs_dir, run_pilot
from pilotrun.report.summarize import summarize_run


def test_configs_dir_is_the_repository_folder():
    folder = configs_dir()
    assert (folder / "stability.yaml").is_file()


def test_bad_recipe_for_a_pilot_is_refused_before_writing(tmp_path):
    with pytest.raises(PilotError, match="recipe not found"):
        run_pilot(tmp_path / "w", config=tmp_path / "missing.yaml")
    with pytest.raises(PilotError, match="checkpoint_every"):
        run_pilot(tmp_path / "w", config=configs_dir() / "smoke.yaml", overrides=["train.checkpoint_every=0"])
    assert not (tmp_path / "w").exists()


def test_cli_pilot_bad_input_is_one_line_exit_2(tmp_path, capsys):
    from pilotrun.commands.cli import main

    code = main(["pilot", "--workdir", str(tmp_path / "w"), "--config", str(tmp_path / "nope.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("pilotrun: error: recipe not found") and "Traceback" not in err


@pytest.mark.slow
def test_pilot_with_the_shipped_recipe_end_to_end_is_go(tmp_path):
    # The recipe `pilotrun pilot` ships with, unchanged (about a minute on 2 cores): a smaller stand-in such
    # as 60 updates of the smoke model is NO-GO (clip rate, expert balance), so it could not show that the
    # pilot a user runs passes.
    out = io.StringIO()
    result = run_pilot(tmp_path / "work", out=out, poll_seconds=0.05)
    text = out.getvalue()
    # Fresh machine: the built-in corpus was prepared inside the workdir.
    assert (tmp_path / "work" / "data" / "metadata.json").is_file()
    # A real kill past the midpoint, after a committed checkpoint, then a resume that finished.
    # The trainer stops itself at the first logged step past the midpoint (log_every 5, checkpoint_every 40).
    assert (result.killed_at_step, result.committed_checkpoint) == (125, 120)
    summary = summarize_run(result.run_dir, require_step=240)
    assert summary.valid, summary.reasons
    first, second = summary.sessions
    assert first.end_reason is None and second.end_reason == "completed"
    assert second.resumed_from == result.committed_checkpoint
    assert summary.overall["updates_applied"] == 240
    # The decision is read from summary.json: GO and exit 0 (a NO-GO names the failed rules).
    report = json.loads((result.report_dir / "summary.json").read_text())
    rules = {r["name"]: r["status"] for r in report["rules"]}
    assert rules["record_valid"] == "PASS" and rules["resumed"] == "PASS"
    assert (report["decision"], result.exit_code) == ("GO", 0), (report["statement"], report["failed"])
    assert "VERDICT: GO" in text
    assert "the pilot pins 1" in text and json.loads((result.run_dir / "run.json").read_text())[
        "recipe"]["train"]["num_threads"] == 1
    assert f"report: {result.report_dir / 'report.html'}" in text
    assert (result.report_dir / "report.html").stat().st_size > 0
    assert list(result.phase_seconds) == ["prepare", "train_until_kill", "resume", "report"]
    assert sum(result.phase_seconds.values()) <= result.seconds


def test_pilot_never_replaces_a_run_folder_it_did_not_create(tmp_path, capsys):
    from pilotrun.commands.cli import main

    workdir = tmp_path / "w"
    user_file = workdir / "run" / "notes.txt"
    user_file.parent.mkdir(parents=True)
    user_file.write_text("mine")
    code = main(["pilot", "--workdir", str(workdir), "--config", str(configs_dir() / "smoke.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and str(workdir / "run") in err
    assert user_file.read_text() == "mine"
    assert sorted(p.name for p in workdir.iterdir()) == ["run"]  # nothing prepared before the refusal

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    (workdir / "run" / "notes.txt").unlink()
    (workdir / "run").rmdir()
    (workdir / "run").symlink_to(elsewhere, target_is_directory=True)
    (workdir / ".pilotrun-pilot-run").write_text("a marker does not make a link replaceable")
    assert main(["pilot", "--workdir", str(workdir), "--config", str(configs_dir() / "smoke.yaml")]) == 2
    assert (elsewhere / "keep.txt").read_text() == "keep"


@pytest.mark.slow
def test_the_kill_lands_at_the_first_logged_step_past_the_midpoint_however_fast_the_updates(tmp_path):
    # The smoke recipe's updates take milliseconds, far less than the pilot's poll: a kill decided from outside
    # alone could land after the final checkpoint (the resumed session would have nothing to do). The trainer
    # stops itself past the midpoint, so the kill point is exact: step 4 logged, step 3 committed, 4-6 redone.
    result = run_pilot(tmp_path / "work", config=configs_dir() / "smoke.yaml", out=io.StringIO(), poll_seconds=0.5)
    assert (result.killed_at_step, result.committed_checkpoint) == (4, 3)
    summary = summarize_run(result.run_dir, require_step=6)
    assert summary.valid, summary.reasons
    first, second = summary.sessions
    assert (first.end_reason, second.resumed_from, second.updates_applied) == (None, 3, 3)
    report = json.loads((result.report_dir / "summary.json").read_text())
    rules = {r["name"]: r["status"] for r in report["rules"]}
    assert rules["record_valid"] == "PASS" and rules["resumed"] == "PASS"


def test_the_kill_point_option_is_accepted_but_not_listed(capsys):
    from pilotrun.commands.cli import build_parser

    args = build_parser().parse_args(["train", "--config", "smoke", "--data", "d", "--run-dir", "r",
                                      "--stop-past-step", "120"])
    assert args.stop_past_step == 120
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    assert "stop-past-step" not in capsys.readouterr().out
