"""The checks' budget in seconds (commands/tune_cost.py): the stated projection and K against a synthetic
pilot record whose times are set by hand (no clock is read), every fixed cost a branch pays again counted
from that record, the refusal where not even the fewest updates fit, and the run with its overrun stated
where the user allows it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pilotrun.commands import tune_cost
from pilotrun.commands.cli import main
from pilotrun.commands.tune import TuneError, plan_checks
from pilotrun.commands.tune_cost import read_pilot_timings
from pilotrun.run.marker import MARKER_NAME, step_folder

RECIPE = {"optim": {"schedule": {"warmup_steps": 4}, "muon": {"lr": 0.02}, "adamw": {"lr": 0.004}},
          "train": {"max_steps": 96, "batch_size": 8, "gradient_accumulation_steps": 1,
                    "eval": {"batches": 8}}}


def _event(kind: str, time: float, step: int, session: str = "s1", **fields) -> str:
    counters = {"step": step, "tokens_seen": step * 512, "updates_attempted": step, "updates_skipped": 0}
    return json.dumps({"event": kind, "session_id": session, "time": time, **counters, **fields})


@pytest.fixture
def pilot(tmp_path) -> Path:
    """96 updates in one session: its clock starts at 100.0 s, 1.0 s of start-up, then 12 windows of 8
    updates, 1.0 s each (0.125 s an update), and the session ends at 116.0 s after 16.0 s of wall time."""
    run_dir = tmp_path / "pilot"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"run_id": "synthetic", "recipe": RECIPE}))
    for step in range(8, 96, 8):
        step_folder(run_dir, step).mkdir(parents=True)
        (step_folder(run_dir, step) / MARKER_NAME).write_text("{}")
    window = {"wall_seconds": 1.0, "train_seconds": 1.0, "updates_attempted": 8}
    lines = [_event("train", 101.0 + n, 8 * n, window=window, loss=5.0) for n in range(1, 13)]
    lines.append(_event("session_end", 116.0, 96, reason="completed", time_split={"wall_seconds": 16.0}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_the_pilots_timings_are_read_from_its_record(pilot):
    timings = read_pilot_timings(pilot, launch_seconds=2.0)
    assert (timings.seconds_per_update, timings.startup_seconds, timings.pilot_seconds,
            timings.launch_seconds) == (0.125, 1.0, 16.0, 2.0)
    assert timings.branch_fixed_seconds == 1.0  # the start-up alone: no evaluation, save or split recorded


def test_a_session_killed_before_its_end_counts_from_its_first_event_to_its_last(pilot):
    killed = [_event("train", t, 8, session="s2") for t in (200.0, 203.5)]
    with open(pilot / "metrics.jsonl", "a") as log:
        log.write("\n".join(killed) + "\n")
    assert read_pilot_timings(pilot, launch_seconds=2.0).pilot_seconds == 19.5


def test_k_is_the_most_that_fits_the_budget_in_seconds_and_the_line_states_both(pilot):
    plan = plan_checks(pilot, ("lr",), launch_seconds=10.0)
    # in updates alone 56 fit (280 <= 3 x 96); in seconds 52: 260 x 0.125 + 5 x 1 + 10 = 47.5 <= 3 x 16
    assert (plan.updates, plan.cost_updates, plan.cost_seconds, plan.overrun) == (52, 260, 47.5, False)
    assert plan.cost_line(3.0) == (
        "5 branches of 52 updates cost 260 updates at the recipe's batch = 2.71x the pilot's 96; projected "
        "48 s = 2.97x the pilot's own 16 s (budget 3x): 32 s of training at the pilot's 0.125 s per update "
        "and 5 s of start-up (5 x the pilot's 1 s a session) and 10 s of launch (1 x 10 s measured for a "
        "process that imports the trainer: the branches share one process)")
    assert plan_checks(pilot, ("lr",), launch_seconds=0.0).updates == 56  # the updates bind first


def test_branches_under_torchrun_pay_the_launch_once_each(pilot):
    shared = plan_checks(pilot, ("lr",), launch_seconds=2.0)
    assert (shared.processes, shared.updates, shared.cost_seconds) == (1, 56, 42.0)
    apart = plan_checks(pilot, ("lr",), launch_seconds=2.0, nproc=2)  # 260 x 0.125 + 5 x 1 + 5 x 2 = 47.5
    assert (apart.processes, apart.updates, apart.cost_seconds) == (5, 52, 47.5)
    line = apart.cost_line(3.0)
    assert "(5 x 2 s measured for a process that imports the trainer: a process a branch, under" in line


def test_checks_that_do_not_fit_the_seconds_even_at_the_fewest_updates_are_refused(pilot):
    # 5 x 1 s of start-up and 45 s of launch alone are more than 3 x 16 s
    with pytest.raises(TuneError, match=r"do not fit 3x the pilot's wall seconds even at the fewest, 4 "
                                        r"updates a branch: .*projected 52 s = 3.28x .*--allow-overrun"):
        plan_checks(pilot, ("lr",), launch_seconds=45.0)
    with pytest.raises(TuneError, match="at --updates 56 updates a branch"):
        plan_checks(pilot, ("lr",), updates=56, launch_seconds=10.0)


def test_the_refusal_is_one_line_and_writes_nothing(pilot, monkeypatch, capsys):
    monkeypatch.setattr(tune_cost, "measure_launch_seconds", lambda: 45.0)
    assert main(["tune", str(pilot), "--check", "lr"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "do not fit 3x the pilot's wall seconds" in lines[0]
    assert not (pilot / "tune").exists()


def test_allowed_to_overrun_the_checks_run_the_most_that_fit_in_updates_their_overrun_stated(pilot):
    plan = plan_checks(pilot, ("lr",), allow_overrun=True, launch_seconds=45.0)
    assert (plan.updates, plan.cost_updates, plan.cost_seconds, plan.overrun) == (56, 280, 85.0, True)
    assert ("280 updates at the recipe's batch = 2.92x the pilot's 96; projected 85 s = 5.31x the pilot's "
            "own 16 s (budget 3x: OVER the budget by 2.31x, run as --allow-overrun asked)") in (
        plan.cost_line(3.0))
    assert plan_checks(pilot, ("lr",), allow_overrun=True, launch_seconds=10.0).overrun is False  # it fits


def test_a_record_without_wall_seconds_is_budgeted_in_updates_only(pilot):
    # no session_end: neither the wall seconds nor the session's start-up; 280 x 0.125 + 45 s projected
    lines = (pilot / "metrics.jsonl").read_text().splitlines()[:-1]
    (pilot / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    plan = plan_checks(pilot, ("lr",), launch_seconds=45.0)
    assert plan.updates == 56 and not plan.overrun
    assert "(budget 3x, in updates only: the record has no session's wall seconds), about 80 s projected" in (
        plan.cost_line(3.0))


@pytest.fixture
def full_pilot(pilot) -> Path:
    """The same pilot with every fixed cost in its record: its command started at 96.0 s (session_start at
    100.5 s, 4.5 s of set-up), so 4.0 s before its session's clock (100.0 s); 20.0 s of wall, of which 12.0 s
    training, 3.0 s in 12 evaluations (0.25 s each), 1.5 s in 12 saves (0.125 s each), 1.0 s of start-up
    and 2.5 s of bookkeeping (the rest)."""
    split = {"train_seconds": 12.0, "eval_seconds": 3.0, "checkpoint_seconds": 1.5, "profile_seconds": 0.0,
             "report_seconds": 0.5, "other_seconds": 3.0, "wall_seconds": 20.0}
    window = {"wall_seconds": 1.0, "train_seconds": 1.0, "updates_attempted": 8}
    lines = [_event("session_start", 100.5, 0, setup_seconds=4.5)]
    for n in range(1, 13):
        lines += [_event("train", 101.0 + n, 8 * n, window=window, loss=5.0),
                  _event("val", 101.0 + n, 8 * n, loss=5.0),
                  _event("checkpoint", 101.0 + n, 8 * n, seconds=0.1)]
    lines.append(_event("session_end", 120.0, 96, reason="completed", time_split=split))
    (pilot / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return pilot


def test_every_fixed_cost_a_branch_pays_again_is_the_pilots_own_from_its_record(full_pilot):
    timings = read_pilot_timings(full_pilot)
    assert (timings.eval_seconds, timings.save_seconds, timings.bookkeeping_seconds) == (0.25, 0.125, 2.5)
    assert timings.launch_seconds == 4.0
    assert timings.pilot_seconds == 24.0  # the set-up before its clock is the pilot's too
    assert (timings.launch_seconds, timings.launch_from_record, timings.branch_fixed_seconds) == (
        4.0, True, 3.875)


def test_k_is_the_most_that_fits_with_every_fixed_cost_counted(full_pilot, monkeypatch):
    probes = []
    monkeypatch.setattr(tune_cost, "measure_launch_seconds", lambda: probes.append(1) or 0.0)
    plan = plan_checks(full_pilot, ("lr",), budget=1.5)
    # 100 x 0.125 + 5 x (1 + 0.25 + 0.125 + 2.5) + 4 = 35.875 <= 1.5 x 24; at 24 updates a branch 38.375
    assert (plan.updates, plan.cost_updates, plan.cost_seconds, plan.overrun) == (20, 100, 35.875, False)
    assert probes == []  # the launch is the pilot's own: no interpreter is launched to measure it
    assert plan.cost_line(1.5) == (
        "5 branches of 20 updates cost 100 updates at the recipe's batch = 1.04x the pilot's 96; projected "
        "36 s = 1.49x the pilot's own 24 s (budget 1.5x): 12 s of training at the pilot's 0.125 s per update "
        "and 5 s of start-up (5 x the pilot's 1 s a session) and 14 s of 5 x the pilot's 0.25 s an "
        "evaluation, 0.12 s a save, 2.5 s a session's bookkeeping and 4 s of launch (1 x 4 s the pilot's "
        "own, from its command's start to its session's clock, imports included: the branches share one "
        "process)")


def test_where_the_fixed_costs_alone_do_not_fit_the_refusal_is_one_line_and_writes_nothing(full_pilot,
                                                                                            capsys):
    # at 4 updates a branch: 2.5 s of training and 23.375 s of fixed costs > 1 x 24 s
    assert main(["tune", str(full_pilot), "--check", "lr", "--budget", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert "do not fit 1x the pilot's wall seconds even at the fewest, 4 updates" in lines[0]
    assert "projected 26 s = 1.08x the pilot's own 24 s" in lines[0]
    assert not (full_pilot / "tune").exists()


def test_a_smaller_batchs_updates_are_priced_whole_in_seconds_and_by_their_tokens_in_updates(full_pilot):
    plan = plan_checks(full_pilot, ("batch",), updates=8, budget=10.0)
    assert plan.batch_steps == [48, 88]
    halves = [b for b in plan.branches if b.value == 0.5]
    assert [(b.updates, b.overrides[0]) for b in halves] == [(16, "train.batch_size=4")] * 2
    # per checkpoint 8 + 16 x 1/2 + 4 x 2 + 2 x 4 = 32 updates of the recipe's tokens; in seconds the half
    # batch's 16 count whole: 40 x 2 = 80 updates x 0.125 s + 8 x 3.875 s + 4 s of launch
    assert (plan.cost_updates, plan.priced_updates, plan.cost_seconds) == (64, 80, 45.0)
    assert "10 s of training at the pilot's 0.125 s per update (16 more for the smaller batch's updates, " \
           "each priced whole) and 8 s of start-up" in plan.cost_line(10.0)
