"""Left alone: the same `pilotrun train ... --resume auto` command run again and again until it exits 0.

Each interruption (a pre-emption signal at start-up, in an update, an evaluation or a save; a deadline) ends
with a committed checkpoint and its resumable exit code; the finished run equals one that never stopped, bit
for bit (the losses of every update exactly, the final weights torch.equal); a complete run says "nothing to
do"; a damaged newest checkpoint is passed over and named, all damaged is refused. In-process (main()), so
that the signal reaches this process's own handlers at the moment a monkeypatched seam chooses.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import threading
import time
import types
from pathlib import Path

import pytest

import pilotrun.training.callbacks.checkpointing as checkpointing
import pilotrun.training.loop as loop_module
import pilotrun.training.trainer as trainer_module
from pilotrun.commands.cli import main
from pilotrun.common.stop_signals import DEADLINE_EXIT_CODE, HUNG_EXIT_CODE, TOO_LATE_EXIT_CODE
from pilotrun.training.callbacks.evaluation import EvalCallback
from pilotrun.training.callbacks.hang_watchdog import HangWatchdog
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from tests.exactness import assert_exactly_equal

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"
MAX_STEPS = 8


def argv(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--config",
        str(SMOKE),
        "--data",
        str(data_dir),
        "--run-dir",
        str(run_dir),
        "--resume",
        "auto",
        "--progress",
        "none",
        "--set",
        f"train.max_steps={MAX_STEPS}",
        "--set",
        "optim.schedule.horizon=8",
        "--set",
        "train.eval_every=3",
        "--set",
        "train.checkpoint_every=3",
        "--set",
        "train.keep_checkpoints=10",
        "--set",
        "train.num_threads=1",
        *extra,
    ]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    """The loss of every update, the last session's where a step was redone (none is, after a checkpoint)."""
    return {e["step"]: e["loss"] for e in events(run_dir) if e["event"] == "train"}


def final_weights(run_dir: Path) -> dict:
    state, _meta = Checkpointer(run_dir, keep=100).load()
    return state["model"]


def folder_digest(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def straight(builtin_data_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    assert main(argv(builtin_data_dir, run_dir)) == 0
    return run_dir


def assert_same_as_straight(run_dir: Path, straight: Path) -> None:
    assert losses(run_dir) == losses(straight)
    assert sorted(losses(run_dir)) == list(range(1, MAX_STEPS + 1))
    assert_exactly_equal(final_weights(run_dir), final_weights(straight), "final weights")


def kill_self_on_call(target, attribute: str, monkeypatch, call: int = 1, signum=signal.SIGUSR1) -> list[int]:
    """Wrap `target.attribute` so that its `call`-th call first sends this process `signum` (the handler runs
    at once, inside the call: a signal arriving in the middle of that work)."""
    real = getattr(target, attribute)
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, attribute, wrapped)
    return calls


def test_a_new_folder_is_started_and_a_complete_run_has_nothing_to_do(builtin_data_dir, straight, capsys):
    recorded = json.loads((straight / "run.json").read_text())
    assert len(recorded["sessions"]) == 1 and recorded["sessions"][0]["resumed_from"] is None
    before = folder_digest(straight)
    capsys.readouterr()
    assert main(argv(builtin_data_dir, straight)) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert folder_digest(straight) == before  # nothing written, not even a session


@pytest.mark.parametrize("moment", ["start-up", "update", "evaluation", "save"])
def test_a_pre_emption_signal_at_any_moment_saves_and_auto_resume_is_exact(
    builtin_data_dir, tmp_path, straight, monkeypatch, moment
):
    run_dir = tmp_path / "run"
    if moment == "start-up":
        kill_self_on_call(trainer_module, "build_session", monkeypatch)
    elif moment == "update":
        kill_self_on_call(loop_module, "train_one_update", monkeypatch, call=2)
    elif moment == "evaluation":
        kill_self_on_call(EvalCallback, "after_update", monkeypatch)
    else:
        kill_self_on_call(checkpointing, "save_checkpoint", monkeypatch)
    assert main(argv(builtin_data_dir, run_dir)) == 128 + signal.SIGUSR1
    end = events(run_dir)[-1]
    assert end["event"] == "session_end" and end["reason"] == "interrupted" and "SIGUSR1" in end["message"]
    assert Checkpointer(run_dir, keep=100).committed_steps()[-1] == end["step"] < MAX_STEPS
    monkeypatch.undo()
    assert main(argv(builtin_data_dir, run_dir)) == 0
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert [s["resumed_from"] for s in sessions] == [None, end["step"]]
    assert_same_as_straight(run_dir, straight)


def test_a_stalled_update_is_ended_hung_with_its_stacks_and_auto_resume_is_exact(
    builtin_data_dir, tmp_path, straight, monkeypatch, capsys
):
    """The fifth update stalls (a seam) until the watchdog's own thread fires; its exit (a seam: os._exit
    would end pytest) releases the stall, which leaves as the process would have, with the hung code."""
    run_dir, released, exits = tmp_path / "run", threading.Event(), []

    def exit_(code):
        exits.append(code)
        released.set()

    monkeypatch.setattr(trainer_module, "start_watchdog", lambda bounds, run_dir: HangWatchdog(
        bounds, run_dir, 0, exit=exit_).start())
    real_update, calls = loop_module.train_one_update, []

    def stalling(loop):
        calls.append(1)
        if len(calls) == 5:
            assert released.wait(600)
            raise SystemExit(exits[0])
        return real_update(loop)

    monkeypatch.setattr(loop_module, "train_one_update", stalling)
    with pytest.raises(SystemExit) as stopped:
        main(argv(builtin_data_dir, run_dir, "--hang-timeout", "10,600"))
    assert stopped.value.code == HUNG_EXIT_CODE and exits == [HUNG_EXIT_CODE]
    end = events(run_dir)[-1]
    assert end["event"] == "session_end" and end["reason"] == "hung" and end["step"] == 4
    assert re.search(r"^rank 0: no progress for \d+ s in update after step 4 \(bound 10 s", end["message"])
    (stacks,) = (run_dir / "hangs").iterdir()
    assert stacks.name.endswith("-rank0.txt") and str(stacks) in end["message"]
    assert "in stalling" in stacks.read_text() and "released.wait" in stacks.read_text()
    assert json.loads((run_dir / "run.json").read_text())["sessions"][-1]["end_reason"] == "hung"
    assert "hung: rank 0: no progress" in capsys.readouterr().err
    monkeypatch.undo()
    assert main(argv(builtin_data_dir, run_dir)) == 0
    sessions = json.loads((run_dir / "run.json").read_text())["sessions"]
    assert [s["resumed_from"] for s in sessions] == [None, 3]
    assert_same_as_straight(run_dir, straight)
    assert main(["summarize", str(run_dir)]) == 0


def test_runs_again_and_again_under_a_deadline_until_done(builtin_data_dir, tmp_path, straight, monkeypatch):
    """A deadline 20 (fake) seconds ahead at every start, the clock moving 1 s at each reading: every session
    ends itself before the deadline with the resumable code, and the sum of them is the straight run."""
    import pilotrun.run.start_costs as start_costs

    run_dir = tmp_path / "run"
    codes, deadlines, reads = [], [], []
    real_read = start_costs.read_record_once
    monkeypatch.setattr(start_costs, "read_record_once", lambda d: reads.append(d) or real_read(d))
    reads_per_command = []
    for _attempt in range(MAX_STEPS + 1):
        start = time.time()
        readings = iter(range(10**6))
        fake = types.SimpleNamespace(time=lambda start=start, readings=readings: start + next(readings))
        monkeypatch.setattr(trainer_module, "time", fake)
        reads.clear()
        codes.append(main(argv(builtin_data_dir, run_dir, "--stop-by", "@" + str(int(start) + 20))))
        reads_per_command.append(len(reads))
        deadlines.append(int(start) + 20)
        if codes[-1] == 0:
            break
    assert codes[-1] == 0 and set(codes[:-1]) == {DEADLINE_EXIT_CODE} and len(codes) > 1
    # a resumed session's deadline check and its start share one read of metrics.jsonl (the first command
    # found no record, and a missing file is read again at the start, where the new session may have begun it)
    assert reads_per_command[1:] == [1] * (len(codes) - 1), reads_per_command
    ends = [e for e in events(run_dir) if e["event"] == "session_end"]
    assert [e["reason"] for e in ends] == ["deadline"] * (len(codes) - 1) + ["completed"]
    committed = Checkpointer(run_dir, keep=100).committed_steps()
    assert all(e["step"] in committed for e in ends)
    assert_same_as_straight(run_dir, straight)
    assert main(argv(builtin_data_dir, run_dir, "--stop-by", "1h")) == 0  # nothing to do


def test_a_damaged_newest_checkpoint_is_passed_over_and_named(builtin_data_dir, tmp_path, straight, capsys):
    run_dir = tmp_path / "run"
    assert main(argv(builtin_data_dir, run_dir, "--set", "train.max_steps=7")) == 0  # checkpoints 3, 6, 7
    assert Checkpointer(run_dir, keep=100).committed_steps() == [3, 6, 7]
    newest = run_dir / "checkpoints" / "step-00000007"
    damaged = max((p for p in newest.iterdir() if p.name != "COMMITTED.json"), key=lambda p: p.stat().st_size)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(argv(builtin_data_dir, run_dir)) == 0
    out = capsys.readouterr().out
    assert "passed over" in out and "step 7" in out and "continuing from step 6" in out
    assert json.loads((run_dir / "run.json").read_text())["sessions"][-1]["resumed_from"] == 6
    assert_same_as_straight(run_dir, straight)


def test_every_checkpoint_damaged_is_refused_naming_each_and_nothing_changes(
    builtin_data_dir, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    assert main(argv(builtin_data_dir, run_dir, "--set", "train.max_steps=4")) == 0  # checkpoints 3, 4
    for folder in (run_dir / "checkpoints").iterdir():
        for file in folder.iterdir():
            if file.name != "COMMITTED.json":
                file.write_bytes(b"damaged" + file.read_bytes()[7:])
    before = folder_digest(run_dir)
    capsys.readouterr()
    assert main(argv(builtin_data_dir, run_dir)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "none of the 2 committed checkpoint(s)" in err
    assert "step 4 (" in err and "step 3 (" in err and "not started again at step 0" in err
    assert folder_digest(run_dir) == before


@pytest.mark.parametrize("extra, named", [
    (["--stop-by", "after lunch"], "not a time"),
    (["--stop-by", "@1000"], "already past"),
    (["--stop-by", "2001-01-01T00:00"], "already past"),
    (["--stop-signals", "SIGUSR1,SIGBOGUS"], "unknown signal name 'SIGBOGUS'"),
    (["--stop-signals", "SIGKILL"], "cannot be a stop signal"),
    (["--hang-timeout", "soon"], "--hang-timeout: bound 'soon' is not a positive duration"),
    (["--hang-timeout", "0"], "is not a positive duration"),
    (["--hang-timeout", "1m,2m,3m"], "auto, off, STEADY or STEADY,STARTUP"),
])
def test_bad_unattended_settings_are_one_line_exit_2_and_nothing_written(
    builtin_data_dir, tmp_path, capsys, extra, named
):
    run_dir = tmp_path / "run"
    assert main(argv(builtin_data_dir, run_dir, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err
    assert not run_dir.exists()


def test_slurm_job_end_time_is_the_default_deadline(builtin_data_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_END_TIME", "1000")
    assert main(argv(builtin_data_dir, tmp_path / "run")) == 2
    assert "SLURM_JOB_END_TIME '@1000': the deadline is already past" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_plain_resume_of_a_complete_run_completes_whatever_its_deadline(
    builtin_data_dir, straight, tmp_path, monkeypatch
):
    """`--resume` (not auto) of a complete run records a session that trains nothing and completes, 0, also
    with a deadline closer than the record's set-up, update and save."""
    import shutil

    import pilotrun.run.start_costs as start_costs

    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    slow = start_costs.StartCosts([3600.0], [3600.0], 60.0)
    monkeypatch.setattr(start_costs, "read_start_costs", lambda run_dir: slow)
    plain = [word for word in argv(builtin_data_dir, run_dir, "--stop-by", "30m") if word != "auto"]
    assert main(plain) == 0
    end = events(run_dir)[-1]
    assert (end["event"], end["reason"], end["step"]) == ("session_end", "completed", MAX_STEPS)



def test_a_resume_from_the_final_checkpoint_completes_whatever_its_deadline(
    builtin_data_dir, straight, tmp_path, monkeypatch
):
    """`--resume --from-step` naming the checkpoint at max_steps starts a session with nothing to train, as a
    plain `--resume` of the complete run does: it completes (0), not refused by the deadline (79); one naming
    an earlier checkpoint is."""
    import shutil

    import pilotrun.run.start_costs as start_costs

    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    slow = start_costs.StartCosts([3600.0], [3600.0], 60.0)
    monkeypatch.setattr(start_costs, "read_start_costs", lambda run_dir: slow)
    plain = [word for word in argv(builtin_data_dir, run_dir, "--stop-by", "30m") if word != "auto"]
    # an earlier checkpoint of the same run has updates to train: held to the deadline
    assert main([*plain, "--from-step", "6"]) == TOO_LATE_EXIT_CODE
    assert main([*plain, "--from-step", str(MAX_STEPS)]) == 0
    end = events(run_dir)[-1]
    assert (end["event"], end["reason"], end["step"]) == ("session_end", "completed", MAX_STEPS)


# the straight run is complete: these starts have updates left to train, so the deadline holds them
MORE_STEPS = ("--set", f"train.max_steps={MAX_STEPS + 2}")


def test_a_complete_run_has_nothing_to_do_whatever_its_deadline(
    builtin_data_dir, straight, capsys, monkeypatch
):
    """The deadline check does not refuse (79, "not in this allocation") a run with nothing left to train: it
    says so and exits 0, writing nothing, so that a scheduler marks it done."""
    import pilotrun.run.start_costs as start_costs

    slow = start_costs.StartCosts([3600.0], [3600.0], 60.0)
    monkeypatch.setattr(start_costs, "read_start_costs", lambda run_dir: slow)
    before = folder_digest(straight)
    capsys.readouterr()
    assert main(argv(builtin_data_dir, straight, "--stop-by", "30m")) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert folder_digest(straight) == before


def test_a_deadline_shorter_than_one_recorded_update_is_refused(
    builtin_data_dir, straight, capsys, monkeypatch
):
    import pilotrun.run.start_costs as start_costs

    slow = start_costs.StartCosts([3600.0], [], None)
    monkeypatch.setattr(start_costs, "read_start_costs", lambda run_dir: slow)
    before = folder_digest(straight)
    # its own code (not bad input's 2): not to be retried in this allocation
    assert main(argv(builtin_data_dir, straight, "--stop-by", "30m", *MORE_STEPS)) == TOO_LATE_EXIT_CODE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "less than one update of this run" in err[0]
    assert folder_digest(straight) == before


def test_a_deadline_closer_than_the_set_up_an_update_and_a_save_is_refused(
    builtin_data_dir, straight, capsys, monkeypatch
):
    """The start check counts the run's recorded set-up (here made an hour) before its update and its save."""
    import pilotrun.run.start_costs as start_costs

    recorded = start_costs.read_start_costs(straight)
    assert recorded.seconds_per_update and recorded.last_save is not None
    monkeypatch.setattr(start_costs, "read_start_costs", lambda run_dir: start_costs.StartCosts(
        recorded.seconds_per_update, [3600.0, 4000.0], recorded.last_save))
    before = folder_digest(straight)
    assert main(argv(builtin_data_dir, straight, "--stop-by", "30m", *MORE_STEPS)) == TOO_LATE_EXIT_CODE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "set-up (3600.0 s, the run's fastest)" in err[0], err
    assert "not started in this allocation (exit 79)" in err[0]
    assert folder_digest(straight) == before
