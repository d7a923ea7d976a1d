"""pilot: the whole rehearsal with the shipped recipe (stability, 240 updates), a real SIGKILL and a
resume."""

import io
import json
from pathlib import Path

import pytest

from pilotrun.commands.cli import main
from pilotrun.commands.pilot import PilotError, configs_dir, kill_point_step, run_pilot
from pilotrun.report.record_check.summarize import summarize_run


def test_configs_dir_is_the_repository_folder():
    folder = configs_dir()
    assert (folder / "stability.yaml").is_file()


def test_bad_recipe_for_a_pilot_is_refused_before_writing(tmp_path):
    with pytest.raises(PilotError, match="recipe not found"):
        run_pilot(tmp_path / "w", config=tmp_path / "missing.yaml")
    with pytest.raises(PilotError, match=r"train\.checkpoint\.every"):
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
    # The pilot's run has its report card, written from the summary the verdict judged.
    card = result.run_dir / "report.md"
    assert f"report card: {card}" in text and "pilotrun pilot" in card.read_text()
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
    # The smoke recipe's updates take milliseconds, far less than the pilot's poll: a kill decided from
    # outside alone could land after the final checkpoint (the resumed session would have nothing to do). The
    # trainer stops itself past the midpoint, so the kill point is exact: step 4 logged, step 3 committed, 4-6
    # redone.
    result = run_pilot(
        tmp_path / "work", config=configs_dir() / "smoke.yaml", out=io.StringIO(), poll_seconds=0.5
    )
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


# ---------------------------------------------------------------------------------------------- the user's
# candidate
FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"
SMALL_RECIPE = """\
# A smoke-sized candidate of a user's own, outside the repository: GO on 24 updates of real text.
model: {d_model: 64, n_layers: 2, n_dense_layers: 1, n_heads: 4, q_lora_rank: 0, kv_lora_rank: 32,
        qk_nope_head_dim: 16, qk_rope_head_dim: 8, v_head_dim: 16, n_routed_experts: 4, n_shared_experts: 1,
        top_k: 2, moe_hidden: 64, dense_hidden: 192, bias_update_speed: 0.05}
optim:
  muon: {lr: 5.0e-3, weight_decay: 0.1}
  adamw: {lr: 5.0e-3, weight_decay: 0.1}
  grad_clip: 10.0
  schedule: {kind: cosine, warmup_steps: 2, horizon: 24}
train: {batch_size: 4, seq_len: 32, max_steps: 24, log_every: 2, eval_every: 6, eval_batches: 2,
        checkpoint_every: 6, keep_checkpoints: 2, num_threads: 1}
"""


def test_the_kill_step_is_the_first_logged_step_past_the_point_with_a_checkpoint():
    assert kill_point_step(120, 240, 5, 40) == 125  # the shipped recipe: what the end-to-end test sees
    assert kill_point_step(3, 6, 1, 3) == 4
    assert kill_point_step(1, 30, 10, 12) == 12  # no checkpoint before step 12: the first window after it
    assert kill_point_step(5, 6, 1, 3) is None  # nothing left to redo after step 6


def test_an_interrupt_point_the_kill_cannot_reach_is_refused_before_writing(tmp_path):
    with pytest.raises(PilotError, match="--interrupt-at 6"):
        run_pilot(tmp_path / "w", config="smoke", interrupt_at=6)
    with pytest.raises(PilotError, match="cannot land past step 5"):
        run_pilot(tmp_path / "w", config="smoke", interrupt_at=5)
    assert not (tmp_path / "w").exists()


def test_cli_pilot_data_and_source_together_are_refused(tmp_path, capsys):
    from pilotrun.commands.cli import main

    assert (
        main(["pilot", "--workdir", str(tmp_path / "w"), "--data", str(tmp_path), "--source", "builtin"]) == 2
    )
    assert "one or the other" in capsys.readouterr().err and not (tmp_path / "w").exists()


@pytest.mark.slow
@pytest.mark.shared_fixtures
@pytest.mark.skipif(
    not (FIXTURES / "fineweb-edu").is_dir(),
    reason="the FineWeb-Edu fixture (../shared/fixtures) is not on this machine",
)
def test_a_recipe_outside_the_repository_on_prepared_fineweb_edu_is_go_and_frozen(tmp_path):
    from pilotrun.data.prepare import prepare_corpus

    data = tmp_path / "edu"
    prepare_corpus(data, source=str(FIXTURES / "fineweb-edu" / "fineweb_edu_sample10bt_150docs.jsonl"),
                   tokenizer=str(FIXTURES / "tokenizers" / "gpt2"), val_fraction=0.05, progress=False)
    recipe = tmp_path / "mine" / "candidate.yaml"
    recipe.parent.mkdir()
    recipe.write_text(SMALL_RECIPE)
    before = sorted(p.name for p in data.iterdir())
    out = io.StringIO()
    result = run_pilot(
        tmp_path / "work",
        config=recipe,
        data=data,
        freeze=tmp_path / "candidate.lock.json",
        out=out,
        poll_seconds=0.05,
    )
    assert (result.decision, result.exit_code) == ("GO", 0), out.getvalue()[-3000:]
    assert (result.killed_at_step, result.committed_checkpoint) == (14, 12)
    assert sorted(p.name for p in data.iterdir()) == before  # the user's data folder is only read
    assert not (tmp_path / "work" / "data").exists()
    run = json.loads((result.run_dir / "run.json").read_text())
    assert run["data"]["vocab_size"] == 50257 and run["recipe"]["train"]["max_steps"] == 24
    assert (result.report_dir / "report.html").is_file()
    lock = json.loads(result.lock.read_text())
    assert lock["data"]["metadata_sha256"] == run["data"]["metadata_sha256"]


def _alive(pid: int) -> bool:
    from pilotrun.commands.pilot_process import is_alive

    return is_alive(pid)


@pytest.mark.slow
def test_a_two_rank_pilot_under_torchrun_loses_every_process_at_once_and_resumes_bit_exactly(tmp_path):
    out = io.StringIO()
    result = run_pilot(tmp_path / "work", config="smoke", nproc_per_node=2, out=out, poll_seconds=0.05,
                       overrides=["train.num_threads=1"])
    # Every rank stopped itself at the same update: step 4 logged, step 3 committed, as with one process.
    assert (result.killed_at_step, result.committed_checkpoint) == (4, 3)
    assert len(result.killed_pids) >= 3  # torchrun and its two workers (in sessions of their own)
    assert not [pid for pid in result.killed_pids if _alive(pid)]
    log = (tmp_path / "work" / "train-1.log").read_text()
    assert "session_end" not in log  # killed, not ended: no handler ran on any rank
    summary = summarize_run(result.run_dir, require_step=6)
    assert summary.valid, summary.reasons
    first, second = summary.sessions
    assert (first.end_reason, second.resumed_from, second.end_reason) == (None, 3, "completed")
    events = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {e["world_size"] for e in events if e["event"] == "session_start"} == {2}
    losses = {}
    for e in events:
        if e["event"] == "train":
            losses.setdefault(e["step"], []).append(e["loss"])
    assert len(losses[4]) == 2 and losses[4][0] == losses[4][1]  # the redone update, bit for bit
    rules = {r["name"]: r for r in json.loads((result.report_dir / "summary.json").read_text())["rules"]}
    assert rules["resumed"]["status"] == "PASS" and "0 differ" in rules["resumed"]["figure"]


@pytest.mark.slow
def test_sigint_to_the_pilot_stops_its_child_and_exits_130_with_one_line(builtin_data_dir, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from pilotrun.run.record import read_metrics_tolerant

    root = Path(__file__).resolve().parents[2]
    workdir = tmp_path / "w"
    command = [
        sys.executable,
        "-m",
        "pilotrun",
        "pilot",
        "--workdir",
        str(workdir),
        "--config",
        "smoke",
        "--data",
        str(builtin_data_dir),
        "--set",
        "train.num_threads=1",
        "--set",
        "train.max_steps=5000",
        "--set",
        "optim.schedule.horizon=5000",
        "--interrupt-at",
        "4900",
    ]
    pilot = subprocess.Popen(
        command,
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240  # a hang guard, not a timing assertion
        while time.monotonic() < deadline and pilot.poll() is None:
            run = workdir / "run"
            if (run / "metrics.jsonl").is_file() and any(
                    e["event"] == "checkpoint" for e in read_metrics_tolerant(run).events):
                break
            time.sleep(0.05)
        pilot.send_signal(signal.SIGINT)
        stdout, stderr = pilot.communicate(timeout=240)
    finally:
        if pilot.poll() is None:
            pilot.kill()
            pilot.wait()
    assert pilot.returncode == 130, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "pilotrun pilot: stopped by SIGINT while training the first session (step "
    ), stderr
    assert "--resume" in lines[0] and str(workdir / "run") in lines[0]
    # The continue command carries every --set the pilot was given: without them it would load another recipe.
    assert "--set train.max_steps=5000 --set optim.schedule.horizon=5000" in lines[0]
    ends = [e for e in read_metrics_tolerant(workdir / "run").events if e["event"] == "session_end"]
    assert [e["reason"] for e in ends] == ["interrupted"]  # the child finished its update and checkpointed
    assert summarize_run(workdir / "run").valid


def test_the_printed_continue_command_is_the_resumed_childs_own(tmp_path):
    import shlex
    import signal

    from pilotrun.commands.pilot import _interrupted, _train_args
    from pilotrun.commands.pilot_process import StopForwarding

    stops = StopForwarding()
    stops.signum = signal.SIGINT
    run, data, recipe = tmp_path / "w" / "run", tmp_path / "my data", tmp_path / "my.yaml"
    overrides = ["train.max_steps=80", "optim.schedule.horizon=80"]
    message = str(_interrupted(stops, "while training", run, 80, recipe, data, overrides))
    printed = shlex.split(message.split("`")[1])
    assert printed == ["pilotrun", *_train_args(recipe, data, run, overrides, resume=True)]
    assert printed[-5:] == ["--set", "train.max_steps=80", "--set", "optim.schedule.horizon=80", "--resume"]
    under_torchrun = str(_interrupted(stops, "while training", run, 80, recipe, data, overrides, nproc=2))
    assert shlex.split(under_torchrun.split("`")[1])[:5] == [
        "torchrun",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "pilotrun",
    ]


@pytest.mark.slow
def test_a_failed_child_is_quoted_not_only_named_by_its_log(builtin_data_dir, tmp_path, capsys):
    workdir = tmp_path / "w"
    code = main(["pilot", "--workdir", str(workdir), "--config", "smoke", "--data", str(builtin_data_dir),
                 "--set", "model.vocab_size=10", "--set", "train.num_threads=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(
        "pilotrun: error: the first training process exited (code 2) before it could be "
        "interrupted past step 3: model.vocab_size (10) is smaller than the data's vocabulary"
    )
    assert err[0].endswith(f"(its output: {workdir / 'train-1.log'})")


@pytest.mark.slow  # prepares the built-in corpus (seconds), no child
def test_the_prepare_inside_a_pilot_checks_the_val_split_against_the_users_recipe(
    tmp_path, capsys, monkeypatch
):
    import pilotrun.commands.pilot as pilot

    class NoTraining:  # the check under test happens before any training: stop there
        def __init__(self, *args, **kwargs):
            raise PilotError("no training in this test")

    monkeypatch.setattr(pilot, "TrainingChild", NoTraining)
    code = main(["pilot", "--workdir", str(tmp_path / "w"), "--config", "smoke", "--source", "builtin",
                 "--set", "train.eval_batches=20", "--progress", "plain"])
    err = capsys.readouterr().err
    assert code == 2 and "no training in this test" in err
    (warning,) = [line for line in err.splitlines() if "fewer than one evaluation" in line]
    assert (
        "of the recipe smoke.yaml reads (eval_batches 20 x batch_size 4 x world_size 1 x seq_len 32 + 1 = "
        "2,561)"
        in warning
        and "packaged" not in warning
    )


def test_a_second_pilot_keeps_the_first_and_never_moves_a_run_a_lock_names(builtin_data_dir, tmp_path, capsys,
                                                                            monkeypatch):
    import pilotrun.commands.pilot as pilot

    class NoTraining:  # what is kept or refused happens before any training: stop there
        def __init__(self, *args, **kwargs):
            raise PilotError("no training in this test")

    monkeypatch.setattr(pilot, "TrainingChild", NoTraining)
    workdir = tmp_path / "w"
    (workdir / "run" / "checkpoints").mkdir(parents=True)
    (workdir / "run" / "run.json").write_text("{}")
    (workdir / "train-1.log").write_text("first pilot")
    (workdir / pilot.PILOT_MARKER).write_text("made by the pilot")
    command = ["pilot", "--workdir", str(workdir), "--config", "smoke", "--data", str(builtin_data_dir)]
    assert main(command) == 2
    out = capsys.readouterr().out
    assert f"kept the previous pilot run as {workdir / 'run-1'} (its logs beside it)" in out
    assert (workdir / "run-1" / "run.json").read_text() == "{}" and (
        workdir / "run-1" / "checkpoints"
    ).is_dir()
    assert (workdir / "run-1-train-1.log").read_text() == "first pilot" and not (workdir / "run").exists()

    # A lock in the workdir frozen from W/run: refused in one line, nothing moved.
    (workdir / "run").mkdir()
    lock = workdir / "candidate.json"
    lock.write_text(json.dumps({"format": "pilotrun.recipe-lock/1", "pilot": {"run_dir": str((workdir / "run")
                                                                                            .resolve())}}))
    before = sorted(p.name for p in workdir.iterdir())
    assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the recipe lock {lock} was frozen from" in err[0]
    assert sorted(p.name for p in workdir.iterdir()) == before

    # The README's layout keeps the lock beside the workdir (`--workdir runs/pilot --freeze
    # runs/recipe.lock.json`), and a later pilot may freeze elsewhere: either lock is found, nothing moved.
    for folder in (tmp_path, tmp_path / "locks"):
        folder.mkdir(exist_ok=True)
        outside = folder / "recipe.lock.json"
        outside.write_text(lock.read_text())
        lock.unlink()
        freeze = ["--freeze", str(tmp_path / "locks" / "second.lock.json")] if folder != tmp_path else []
        assert main(command + freeze) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"the recipe lock {outside} was frozen from" in err[0]
        assert sorted(p.name for p in workdir.iterdir()) == sorted(set(before) - {"candidate.json"})
        lock.write_text(outside.read_text())
        outside.unlink()


def test_the_pilots_checks_run_before_the_verdict_and_a_pilot_they_cannot_branch_is_still_judged(
        monkeypatch, tmp_path):
    from pilotrun.commands import pilot as pilot_module
    from pilotrun.commands import tune as tune_module

    calls = []

    def fake_tune(run_dir, checks, **options):
        calls.append((run_dir, checks, options["data"], options["nproc"]))
        if checks == ("batch",):
            raise tune_module.TuneError("run is too short to branch")
        return {}

    monkeypatch.setattr(tune_module, "tune", fake_tune)
    out, phases = io.StringIO(), {}
    pilot_module._run_checks(tmp_path, ("lr", "batch"), tmp_path / "data", None, out, phases)
    pilot_module._run_checks(tmp_path, ("batch",), None, 2, out, phases)
    assert calls == [(tmp_path, ("lr", "batch"), tmp_path / "data", None), (tmp_path, ("batch",), None, 2)]
    assert out.getvalue() == "[pilot] checks not run: run is too short to branch\n"
    assert "checks" in phases


def test_a_bad_check_is_refused_before_the_pilot_starts(tmp_path, capsys):
    assert main(["pilot", "--workdir", str(tmp_path / "w"), "--check", "speed"]) == 2
    assert "the checks are lr, batch" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_a_pilot_with_the_lr_check_has_its_finding_in_the_verdict_and_the_report(builtin_data_dir, tmp_path,
                                                                                 monkeypatch):
    from pilotrun.commands import tune_cost

    # the budget in updates only, so that K does not depend on how fast this machine ran the pilot
    monkeypatch.setattr(tune_cost, "pilot_wall_seconds", lambda sessions: None)
    out = io.StringIO()
    result = run_pilot(tmp_path / "work", config="smoke", data=builtin_data_dir, out=out, poll_seconds=0.05,
                       overrides=["train.max_steps=24", "optim.schedule.horizon=24", "train.eval.every=4",
                                  "train.checkpoint.every=4", "train.checkpoint.keep=10"], check=("lr",))
    text = out.getvalue()
    assert text.index("[tune] 5 branches of") < text.index("VERDICT:")  # the cost, stated before the branches
    report = json.loads((result.report_dir / "summary.json").read_text())
    finding = json.loads((result.run_dir / "tune" / "tune.json").read_text())["lr"]["line"]
    assert report["tuning"] == [f"lr check (from step 12, 12 updates a branch): {finding}"]
    assert "evidence, not a rule: lr check" in text
    assert (result.report_dir / "tune_lr.png").is_file()
    phases = list(result.phase_seconds)
    assert phases.index("checks") == phases.index("resume") + 1 == phases.index("report") - 1
