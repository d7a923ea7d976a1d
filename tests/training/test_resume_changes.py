"""An allowed or free change on resume takes effect from the first update after the resume.

Run A trains N updates in one process and switches the changed setting at update K (the trainer's
`set_learning_rates` is wrapped to make the switch just before update K + 1, the in-process equivalent of
editing the recipe there). Run B is a K-update run resumed with the change (`--allow-change KEY --set
KEY=VALUE`). Their per-step losses and final weights must be identical bit for bit, and the change must
matter (a run resumed without it ends elsewhere), otherwise equality would prove nothing.

The trap this guards: the optimizer's state dict restores the checkpoint's param-group settings (LR, weight
decay, momentum, betas) over the ones the resumed recipe built. Settings read from the recipe at each use
(grad_clip, the schedule, QK-Clip's tau, the expert-bias speed) are covered too.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from pilotrun.config import load_run_config
from tests.exactness import assert_exactly_equal

ROOT = Path(__file__).resolve().parents[2]
N_STEPS, K_STEPS = 6, 3


def _groups(field, muon):
    def switch(trainer, optimizer, value):
        for group in optimizer.param_groups:
            if group["use_muon"] == muon:
                group[field] = value
    return switch


def _set_config(section, name):
    def switch(trainer, optimizer, value):
        setattr(getattr(trainer.config.optim, section) if section else trainer.config.optim, name, value)
    return switch


def _set_hook(hook, name):
    def switch(trainer, optimizer, value):
        setattr(next(h for h in trainer.session.state.hooks if h.name == hook), name, value)
    return switch


CHANGES = {  # key: (new value, how a running trainer would switch to it)
    "optim.muon.lr": (0.006, _groups("base_lr", True)),
    "optim.adamw.lr": (0.001, _groups("base_lr", False)),
    "optim.muon.weight_decay": (0.5, _groups("weight_decay", True)),
    "optim.adamw.weight_decay": (0.5, _groups("weight_decay", False)),
    "optim.muon.momentum": (0.8, _groups("momentum", True)),
    "optim.adamw.betas": ((0.8, 0.9), _groups("betas", False)),
    "optim.grad_clip": (0.01, _set_config(None, "grad_clip")),
    "optim.schedule.warmup_steps": (6, _set_config("schedule", "warmup_steps")),
    "optim.qk_clip.tau": (0.005, _set_hook("qk_clip", "tau")),
    "model.bias_update_speed": (0.05, _set_hook("moe", "speed")),
}


def recipe(max_steps: int, extra: tuple[str, ...] = ()):
    return load_run_config(ROOT / "configs" / "smoke.yaml", [
        f"train.max_steps={max_steps}", "train.num_threads=1", "train.log_every=1", "train.eval_every=0",
        "train.checkpoint_every=0", "train.keep_checkpoints=3", "optim.schedule.horizon=20", *extra])


def make_trainer(config, data_dir, run_dir, **kwargs):
    from pilotrun.training.trainer import Trainer

    return Trainer(config, data_dir, run_dir, progress=False, out=io.StringIO(), **kwargs)


def losses(run_dir: Path) -> dict[int, float]:
    return {
        e["step"]: e["loss"]
        for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if e["event"] == "train"
    }


def _setting(key: str, value) -> str:
    return f"{key}=[{value[0]}, {value[1]}]" if isinstance(value, tuple) else f"{key}={value}"


@pytest.fixture(scope="module")
def first_part(builtin_data_dir, tmp_path_factory):
    """The K-update run every resume starts from (copied per test), and its resume without any change."""
    root = tmp_path_factory.mktemp("resume_changes")
    make_trainer(recipe(K_STEPS), builtin_data_dir, root / "k").run()
    shutil.copytree(root / "k", root / "unchanged")
    unchanged = make_trainer(recipe(N_STEPS), builtin_data_dir, root / "unchanged", resume=True)
    unchanged.run()
    return root / "k", losses(root / "unchanged")


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CHANGES))
def test_allowed_change_on_resume_equals_switching_in_process(
    builtin_data_dir, tmp_path, monkeypatch, first_part, key
):
    import pilotrun.training.loop as loop_module

    value, switch = CHANGES[key]
    k_run, unchanged_losses = first_part
    original, holder = loop_module.set_learning_rates, []

    def switching_at_k(optimizer, step, schedule_cfg):
        if step == K_STEPS:
            switch(holder[0], optimizer, value)
        original(optimizer, step, schedule_cfg)

    monkeypatch.setattr(loop_module, "set_learning_rates", switching_at_k)
    straight = make_trainer(recipe(N_STEPS), builtin_data_dir, tmp_path / "a")
    holder.append(straight)
    straight.run()
    monkeypatch.setattr(loop_module, "set_learning_rates", original)

    shutil.copytree(k_run, tmp_path / "b")
    resumed = make_trainer(
        recipe(N_STEPS, (_setting(key, value),)),
        builtin_data_dir,
        tmp_path / "b",
        resume=True,
        allow_changes=[key],
    )
    resumed.run()

    assert losses(tmp_path / "b") == losses(tmp_path / "a")
    assert_exactly_equal(
        straight.session.raw_model.state_dict(), resumed.session.raw_model.state_dict(), "weights"
    )
    assert unchanged_losses[N_STEPS] != losses(tmp_path / "a")[N_STEPS]  # the change did matter


@pytest.mark.slow
def test_a_free_change_on_resume_is_recorded_and_listed_by_summarize_and_the_verdict(
    builtin_data_dir, tmp_path, capsys
):
    from pilotrun.commands.cli import main

    run_dir = tmp_path / "run"
    base = ["train", "--config", str(ROOT / "configs" / "smoke.yaml"), "--data", str(builtin_data_dir),
            "--run-dir", str(run_dir), "--set", "train.num_threads=1", "--set", "train.max_steps=3"]
    assert main(base) == 0
    capsys.readouterr()
    assert (
        main(
            [
                *base,
                "--set",
                "train.max_steps=6",
                "--set",
                "train.eval_every=2",
                "--set",
                "train.eval_batches=1",
                "--resume",
            ]
        )
        == 0
    )
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("recipe change")]
    assert said == [f"recipe change at resume: {key} from update 4 (a key a resume may change freely)"
                    for key in ("train.eval.batches 2 -> 1", "train.eval.every 3 -> 2",
                                "train.max_steps 3 -> 6")]
    run = json.loads((run_dir / "run.json").read_text())
    second = run["sessions"][1]["session_id"]
    assert run["allowed_changes"] == []
    assert run["free_changes"] == [
        {"session_id": second, "key": "train.eval.batches", "old": 2, "new": 1},
        {"session_id": second, "key": "train.eval.every", "old": 3, "new": 2},
        {"session_id": second, "key": "train.max_steps", "old": 3, "new": 6},
    ]
    capsys.readouterr()
    assert main(["summarize", str(run_dir)]) == 0
    listed = ("free changes on resume: train.eval.batches 2 -> 1 from update 4; train.eval.every 3 -> 2 from "
              "update 4")
    assert listed in capsys.readouterr().out
    main(["verdict", str(run_dir), "--no-resume-required"])
    (rule,) = [
        line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("recipe_changes")
    ]
    assert (
        "PASS" in rule
        and "free changes (no --allow-change needed): train.eval.batches 2 -> 1 from update 4" in rule
    ), rule
