"""verdict and freeze on records the real trainer wrote: each FAIL path of the verdict once on a real tiny
run, and the freeze -> frozen train -> refused change -> allowed change round trip.

The runs are the smoke model on the built-in corpus, one thread, a few updates each (seconds). Its tiny MoE
layer is never balanced in 20 updates and a seconds-long run's throughput on a shared test machine says
nothing, so those two thresholds are loosened here (TINY), and the lock records them."""

import json
import shutil
from pathlib import Path

import pytest

from pilotrun.commands.cli import main

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
COMMON = [
    "train.num_threads=1",
    "train.checkpoint_every=4",
    "train.eval_every=4",
    "optim.schedule.horizon=20",
    "optim.grad_clip=10",
    "model.bias_update_speed=0.01",
]
TINY = ["--threshold", "max_imbalance=3", "--threshold", "min_throughput_ratio=0"]


def _train(data_dir, run_dir, *overrides, extra=()):
    args = ["train", "--config", str(SMOKE), "--data", str(data_dir), "--run-dir", str(run_dir)]
    for override in (*COMMON, *overrides):
        args += ["--set", override]
    return main([*args, *extra])


def _verdict_json(capsys, run_dir, *extra):
    capsys.readouterr()
    code = main(["verdict", str(run_dir), "--json", *TINY, *extra])
    data = json.loads(capsys.readouterr().out)
    return code, data, {r["name"]: r for r in data["rules"]}


@pytest.fixture(scope="module")
def pilot_run(builtin_data_dir, tmp_path_factory):
    """A real pilot: 12 updates, then a resume from checkpoint 8 that lowers the clipping bound (an allowed
    change) and goes on to 20: the kept history has a resume with training after it and 5 replayed windows
    (train at 9..12, val at 12), not compared since the recipe changed."""
    run_dir = tmp_path_factory.mktemp("pilot") / "run"
    assert _train(builtin_data_dir, run_dir, "train.max_steps=12") == 0
    assert _train(builtin_data_dir, run_dir, "train.max_steps=20", "optim.grad_clip=8",
                  extra=["--resume", "--from-step", "8", "--allow-change", "optim.grad_clip"]) == 0
    return run_dir


def _copy(run_dir, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(run_dir, target)
    return target


@pytest.mark.slow
def test_real_pilot_is_go_and_names_its_recipe_change(pilot_run, capsys):
    code, data, rules = _verdict_json(capsys, pilot_run)
    assert code == 0 and data["decision"] == "GO", data["statement"]
    assert rules["loss_decreased"]["status"] == "PASS"
    assert rules["resumed"]["status"] == "PASS"
    assert "5 replayed under a changed recipe, not compared" in rules["resumed"]["figure"]
    assert rules["final_checkpoint"]["status"] == "PASS"
    change = rules["recipe_changes"]
    assert change["status"] == "WARN" and "optim.grad_clip 10.0 -> 8.0 from update 9" in change["figure"]
    assert "recipe_changes" in [w["name"] for w in data["warnings"]]
    assert data["candidate"]["supported_from_update"] == 9
    assert json.loads((pilot_run / "run.json").read_text())["recipe"]["optim"]["grad_clip"] == 8.0


@pytest.mark.slow
def test_real_run_without_its_recipe_is_invalid(pilot_run, tmp_path, capsys):
    run_dir = _copy(pilot_run, tmp_path)
    record = json.loads((run_dir / "run.json").read_text())
    del record["recipe"]
    (run_dir / "run.json").write_text(json.dumps(record))
    code, data, rules = _verdict_json(capsys, run_dir)
    assert code == 1 and rules["record_valid"]["status"] == "FAIL"
    assert any("run.json lacks recipe.optim.grad_clip" in r for r in data["summary"]["reasons"])
    assert rules["clip_rate"]["status"] == "FAIL" and "lacks optim.grad_clip" in rules["clip_rate"]["figure"]


@pytest.mark.slow
def test_real_damaged_final_checkpoint_fails(pilot_run, tmp_path, capsys):
    run_dir = _copy(pilot_run, tmp_path)
    folder = run_dir / "checkpoints" / "step-00000020"
    victim = sorted(p for p in folder.iterdir() if p.name != "COMMITTED.json")[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, verdict, rules = _verdict_json(capsys, run_dir)
    assert code == 1 and rules["final_checkpoint"]["status"] == "FAIL"
    assert f"{victim}: sha256 differs" in rules["final_checkpoint"]["figure"]
    # summarize --require-step (which the verdict runs) refuses a damaged final checkpoint as well, naming it.
    assert verdict["failed"] == ["record_valid", "final_checkpoint"]
    assert any(f"final checkpoint: {victim}: sha256 differs" in r for r in verdict["summary"]["reasons"])


@pytest.mark.slow
def test_real_run_with_lr_zero_and_an_idle_resume_fails_learning_and_resume(
    builtin_data_dir, tmp_path, capsys
):
    """An LR of ~0 (loss down ~0.1%) is 'not learning'; resuming the finished run with nothing left to do adds
    a resume but no update after it, which is no resume evidence."""
    run_dir = tmp_path / "run"
    lr_zero = ("train.max_steps=16", "optim.muon.lr=1e-9", "optim.adamw.lr=1e-9")
    assert _train(builtin_data_dir, run_dir, *lr_zero) == 0
    assert _train(builtin_data_dir, run_dir, *lr_zero, extra=["--resume"]) == 0
    code, data, rules = _verdict_json(capsys, run_dir)
    assert code == 1 and data["summary"]["valid"] and data["summary"]["overall"]["resumes"] == 1
    assert rules["loss_decreased"]["status"] == "FAIL" and "not learning" in rules["loss_decreased"]["figure"]
    assert rules["resumed"]["status"] == "FAIL"
    assert "no update applied after any of them" in rules["resumed"]["figure"]


@pytest.mark.slow
def test_freeze_then_frozen_train_refuses_unlisted_changes_and_records_allowed_ones(
    pilot_run, builtin_data_dir, tmp_path, capsys
):
    lock_path = tmp_path / "recipe.lock.json"
    assert main(["freeze", str(pilot_run), "--out", str(lock_path), *TINY]) == 0
    lock = json.loads(lock_path.read_text())
    record = json.loads((pilot_run / "run.json").read_text())
    assert lock["decision"] == "GO" and lock["despite_no_go"] is False
    assert (
        lock["recipe"] == record["recipe"]
        and lock["data"]["metadata_sha256"] == record["data"]["metadata_sha256"]
    )
    assert (
        lock["code"] == record["sessions"][-1]["git"]
        and lock["software"] == record["sessions"][-1]["software"]
    )
    assert lock["verdict"]["thresholds"]["max_imbalance"] == 3.0
    assert [c["key"] for c in lock["recipe_changes"]] == ["optim.grad_clip"]
    # A lock is never overwritten.
    capsys.readouterr()
    assert main(["freeze", str(pilot_run), "--out", str(lock_path)]) == 2
    assert "already exists" in capsys.readouterr().err

    # An unlisted difference is refused, listed, before anything is written.
    refused_dir = tmp_path / "refused"
    code = main(
        [
            "train",
            "--frozen",
            str(lock_path),
            "--data",
            str(builtin_data_dir),
            "--run-dir",
            str(refused_dir),
            "--set",
            "train.max_steps=2",
            "--set",
            "train.eval_every=0",
            "--allow-change",
            "train.max_steps",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and not refused_dir.exists()
    assert err.count("\n") == 1 and "1 difference(s)" in err and "train.eval.every (lock 4, run 0)" in err

    # Listed, it starts; run.json records the lock and the accepted difference.
    long_dir = tmp_path / "long"
    assert (
        main(
            [
                "train",
                "--frozen",
                str(lock_path),
                "--data",
                str(builtin_data_dir),
                "--run-dir",
                str(long_dir),
                "--set",
                "train.max_steps=2",
                "--allow-change",
                "train.max_steps",
            ]
        )
        == 0
    )
    frozen = json.loads((long_dir / "run.json").read_text())["frozen"]
    assert frozen["lock_sha256"] == lock["sha256"]
    assert frozen["differences"] == [{"key": "train.max_steps", "lock": 20, "run": 2}]
    capsys.readouterr()
    main(["summarize", str(long_dir), "--json"])
    status = json.loads(capsys.readouterr().out)["overall"]["frozen_candidate"]
    assert (
        status["matches"] is True
        and status["lock_file"] == "unchanged"
        and status["lock_sha256"] == lock["sha256"]
    )
    _, data, _ = _verdict_json(capsys, long_dir, "--no-resume-required")
    assert data["frozen"]["matches"] is True

    # An edited lock is refused, and the run started from it no longer matches.
    edited = dict(lock, tokens_per_update=1)
    lock_path.write_text(json.dumps(edited))
    assert main(["train", "--frozen", str(lock_path), "--data", str(builtin_data_dir), "--run-dir",
                 str(tmp_path / "x")]) == 2
    assert "the lock was edited" in capsys.readouterr().err
    _, data, _ = _verdict_json(capsys, long_dir, "--no-resume-required")
    assert data["frozen"]["matches"] is False and data["frozen"]["lock_file"] == "changed"


def test_freeze_of_a_no_go_pilot_needs_the_flag_and_records_it(pilot_run, tmp_path, capsys):
    run_dir = _copy(pilot_run, tmp_path)
    folder = run_dir / "checkpoints" / "step-00000020"
    shutil.rmtree(folder)  # cannot be continued: NO-GO
    out = tmp_path / "lock.json"
    assert main(["freeze", str(run_dir), "--out", str(out), *TINY]) == 1 and not out.exists()
    assert main(["freeze", str(run_dir), "--out", str(out), "--despite-no-go", *TINY]) == 0
    lock = json.loads(out.read_text())
    assert lock["decision"] == "NO-GO" and lock["despite_no_go"] is True
    assert main(["freeze", str(tmp_path / "nowhere"), "--out", str(tmp_path / "l2.json")]) == 2
