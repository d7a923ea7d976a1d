"""`pilotrun tune`: the plan and its stated cost, the refusals (one line, exit 2), and a whole check on a
small pilot: branches in the record, the findings in tune.json, the verdict, the report and the lock, a rerun
that reuses what is done and runs an interrupted branch again."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from pilotrun.commands import tune_cost
from pilotrun.commands.cli import main
from pilotrun.commands.freeze import freeze_run
from pilotrun.commands.next_commands import train_words
from pilotrun.commands.tune import TuneError, parse_checks, plan_checks, tune
from pilotrun.commands.tune_branch import branch_train_losses, make_branch_folder, pilot_session_ids
from pilotrun.commands.tune_cost import read_pilot_timings
from pilotrun.report.verdict.thresholds import Thresholds
from pilotrun.run.marker import step_folder
from pilotrun.run.record import read_metrics_tolerant

ROOT = Path(__file__).resolve().parents[2]
SMOKE = str(ROOT / "configs" / "smoke.yaml")
PILOT_SETS = ["train.max_steps=12", "optim.schedule.horizon=12", "train.checkpoint.every=4",
              "train.checkpoint.keep=10", "train.eval.every=4", "train.num_threads=1"]


@pytest.fixture(scope="module")
def pilot(builtin_data_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tune") / "pilot"
    words = train_words(config=SMOKE, data=builtin_data_dir, run_dir=run_dir, overrides=PILOT_SETS,
                        extra=["--progress", "none"])
    assert main(words) == 0
    return run_dir


@pytest.fixture
def budget_in_updates(monkeypatch):
    """These tests are of the budget in updates and of a whole check: the record's wall seconds are left out
    (and no launch is measured) so that K does not depend on how fast this machine ran the pilot; the budget
    in seconds is tested on a synthetic record (test_tune_cost.py)."""
    monkeypatch.setattr(tune_cost, "pilot_wall_seconds", lambda sessions: None)
    monkeypatch.setattr(tune_cost, "measure_launch_seconds", lambda: 0.0)


def _refusal(capsys, argv: list[str]) -> tuple[int, list[str]]:
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.usefixtures("budget_in_updates")
def test_the_plan_branches_past_warm_up_and_states_its_cost(pilot):
    plan = plan_checks(pilot, ("lr", "batch"), budget=4.0)
    assert (plan.updates, plan.lr_step, plan.batch_steps) == (4, 8, [4, 8])
    assert sorted(b.name for b in plan.branches if b.from_step == 8) == sorted(
        ["lr-0.5x-from-8", "lr-0.7071x-from-8", "base-1x-from-8", "lr-1.414x-from-8", "lr-2x-from-8",
         "batch-0.5x-from-8", "batch-2x-from-8", "batch-4x-from-8"])
    half = next(b for b in plan.branches if b.name == "batch-0.5x-from-4")
    assert (half.updates, half.overrides) == (8, ["train.batch_size=2", "train.eval.batches=4"])
    four = next(b for b in plan.branches if b.name == "batch-4x-from-4")
    assert (four.updates, four.overrides) == (1, ["train.gradient_accumulation_steps=4"])
    assert plan.cost_updates == 48
    assert "12 branches of 4 updates cost 48 updates at the recipe's batch = 4.00x the pilot's 12" in (
        plan.cost_line(4.0))


@pytest.mark.usefixtures("budget_in_updates")
def test_the_start_up_each_branch_pays_again_is_the_pilots_as_its_time_ledger_counts_it(pilot):
    from pilotrun.report.record_check.summarize import summarize_run

    ledger = summarize_run(pilot).overall["time_ledger"]
    (session,) = ledger["sessions"]
    startup = read_pilot_timings(pilot).startup_seconds
    assert startup == pytest.approx(session["parts"]["startup"], abs=1e-6)
    plan = plan_checks(pilot, ("lr",))
    assert f"and {5 * startup:.0f} s of start-up (5 x the pilot's" in plan.cost_line(3.0)


@pytest.mark.usefixtures("budget_in_updates")
def test_the_budget_holds_the_checks_at_three_times_the_pilot(pilot):
    with pytest.raises(TuneError, match="too short to branch"):
        plan_checks(pilot, ("lr", "batch"))  # 48 updates > 3 x 12
    assert plan_checks(pilot, ("lr",)).cost_updates == 20
    with pytest.raises(TuneError, match="would cost more than the budget: .* 64 updates"):
        plan_checks(pilot, ("lr", "batch"), updates=8)


def test_not_a_pilot_is_refused_in_one_line(tmp_path, capsys):
    code, lines = _refusal(capsys, ["tune", str(tmp_path)])
    assert code == 2 and len(lines) == 1
    assert "is not a pilot's run folder: it has no run.json" in lines[0]


def test_a_run_json_without_a_recipe_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "x", "recipe": {"train": {"max_steps": 4}}}))
    code, lines = _refusal(capsys, ["tune", str(tmp_path)])
    assert code == 2 and len(lines) == 1
    assert "holds no recipe with optim.schedule.warmup_steps: not a pilot's run folder" in lines[0]


def test_a_pilot_without_a_checkpoint_past_warm_up_is_refused_in_one_line(pilot, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy2(pilot / "run.json", bare / "run.json")
    code, lines = _refusal(capsys, ["tune", str(bare)])
    assert code == 2 and len(lines) == 1
    assert "has no committed checkpoint past warm-up (step > 2)" in lines[0]
    assert not (bare / "tune").exists()


def test_bad_options_are_refused_in_one_line(pilot, capsys):
    for argv, words in ((["--check", "speed"], "the checks are lr, batch"),
                        (["--updates", "6"], "must be a multiple of 4"),
                        (["--budget", "0"], "must be a positive multiple")):
        code, lines = _refusal(capsys, ["tune", str(pilot), *argv])
        assert code == 2 and len(lines) == 1 and words in lines[0]
    assert not (pilot / "tune").exists()


def test_parse_checks():
    assert parse_checks("lr, batch") == ("lr", "batch")
    with pytest.raises(TuneError):
        parse_checks("")


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "tune" not in p.relative_to(folder).parts}


def test_a_finished_branch_is_read_once_for_its_loss_and_its_clock_start(pilot, tmp_path, monkeypatch):
    """Its record holds the pilot's copied events (as long as the pilot's): one read gives both the loss and
    when its session's clock started (the launch measured in tune.json)."""
    import types

    from pilotrun.commands import tune as tune_module
    from pilotrun.commands import tune_branch

    branch = tune_branch.Branch("base", 1.0, from_step=8, updates=4)
    folder = tmp_path / "tune" / branch.name
    shutil.copytree(pilot, folder)  # the pilot's own session stands for the branch's: completed, val at 12
    reads: list[Path] = []
    real = tune_branch.read_metrics_tolerant
    monkeypatch.setattr(tune_branch, "read_metrics_tolerant", lambda run_dir: reads.append(Path(run_dir))
                        or real(run_dir))
    loss, clock_start = tune_module._branch_result(types.SimpleNamespace(run_dir=tmp_path), branch, set(), 0,
                                                   io.StringIO())
    assert reads == [folder]
    events = read_metrics_tolerant(pilot).events
    assert loss == [e["loss"] for e in events if e["event"] == "val" and e["step"] == 12][-1]
    end = [e for e in events if e["event"] == "session_end"][-1]
    assert clock_start == end["time"] - end["time_split"]["wall_seconds"]


@pytest.mark.slow
@pytest.mark.usefixtures("budget_in_updates")
def test_a_whole_check_lands_in_the_record_the_verdict_the_report_and_the_lock(pilot, tmp_path):
    before = _hashes(pilot)
    out = io.StringIO()
    result = tune(pilot, ("lr", "batch"), budget=4.0, out=out)
    assert _hashes(pilot) == before  # the pilot's own files are only read
    printed = out.getvalue().splitlines()
    assert printed[0].startswith("[tune] 12 branches of 4 updates cost 48 updates")  # before any branch ran
    written = json.loads((pilot / "tune" / "tune.json").read_text())
    assert written["lr"]["line"] == result["lr"]["line"] and written["batch"]["from_steps"] == [4, 8]
    assert len(written["branches"]) == 12
    # The branches shared one process, one after another: the ones that change nothing, run after others
    # there, are still the pilot's own continuation, losses and weights bit for bit.
    for name, start, end in (("base-1x-from-8", 8, 12), ("base-1x-from-4", 4, 8)):
        assert branch_train_losses(pilot / "tune" / name, pilot_session_ids(pilot)) == {
            e["step"]: e["loss"] for e in read_metrics_tolerant(pilot).events
            if e.get("event") == "train" and start < e["step"] <= end}
        mine = torch.load(step_folder(pilot / "tune" / name, end) / "model.pt", weights_only=True)
        theirs = torch.load(step_folder(pilot, end) / "model.pt", weights_only=True)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    for name in written["branches"]:
        assert main(["summarize", str(pilot / "tune" / name)]) == 0  # each branch is a valid run record
    assert (pilot / "tune" / "tune_lr.png").is_file() and (pilot / "tune" / "tune_batch.png").is_file()
    # the launch stated is the pilot's own from its record; the one the shared process paid is kept beside it
    cost = written["cost"]
    assert cost["launch_from_record"] is True
    assert cost["launch_seconds"] == read_pilot_timings(pilot).launch_seconds
    assert isinstance(cost["measured_launch_seconds"], float) and isinstance(cost["measured_seconds"], float)

    from pilotrun.commands.api import verdict

    judged = verdict(pilot, resume_required=False)
    assert [line.split(":")[0] for line in judged.tuning] == [
        "lr check (from step 8, 4 updates a branch)", "batch check (from steps 4 and 8, 4 updates a branch)"]
    assert (pilot / "report" / "tune_lr.png").is_file()
    assert "Evidence, not a rule: lr check" in (pilot / "report" / "report.html").read_text()
    code, lock, _ = freeze_run(pilot, tmp_path / "recipe.lock.json", despite_no_go=True,
                               thresholds=Thresholds(resume_required=False))
    assert code == 0 and lock["tuning"]["lr"]["line"] == result["lr"]["line"]

    # Again: every branch is reused; one left interrupted is run again, with the same finding.
    shutil.rmtree(pilot / "tune" / "lr-2x-from-8")
    make_branch_folder(pilot, pilot / "tune" / "lr-2x-from-8", 8)
    again = io.StringIO()
    rerun = tune(pilot, ("lr", "batch"), budget=4.0, out=again)
    assert sum("already done" in line for line in again.getvalue().splitlines()) == 11
    assert "lr-2x-from-8: an interrupted branch, run again" in again.getvalue()
    assert rerun["branches"] == result["branches"]  # bit-exact branches: the same losses
