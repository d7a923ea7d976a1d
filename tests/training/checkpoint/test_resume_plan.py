"""plan_resume decides a resume before anything is touched: which checkpoint, the effective recipe, the free
and allowed changes, world size; checkpoint_meta builds both sides of the comparison."""

from __future__ import annotations

import pytest
import torch

from pilotrun.common.errors import CheckpointError, ConfigError
from pilotrun.config import RunConfig, apply_overrides, config_from_dict, config_to_dict
from pilotrun.model.transformer import build_model
from pilotrun.optim.muon_adamw import build_optimizer
from pilotrun.optim.partition import partition_parameters, partition_table
from pilotrun.training.checkpoint.resume_plan import (
    checkpoint_meta,
    choose_checkpoint,
    plan_resume,
    plan_session,
    set_dotted,
)


def _config(*overrides: str) -> RunConfig:
    return config_from_dict(apply_overrides(config_to_dict(RunConfig()), list(overrides)))


def _meta(config: RunConfig, world_size: int = 1, sha: str = "a" * 64) -> dict:
    return checkpoint_meta(
        config,
        data_sha256=sha,
        data_dir="/data",
        world_size=world_size,
        software={"torch": "2"},
        hardware={"device": "cpu", "device_name": "x", "extra": 1},
        partition=[{"group": "g", "parameters": ["w"], "count": 4, "optimizer": "muon"}],
    )


def test_checkpoint_meta_keeps_the_compared_hardware_keys_and_adds_progress_when_given():
    config = _config()
    meta = _meta(config)
    assert meta["hardware"] == {
        "device": "cpu",
        "device_name": "x",
        "world_size": None,
        "torch_threads": None,
    }
    assert "counters" not in meta and meta["recipe"] == config_to_dict(config)
    with_progress = checkpoint_meta(
        config,
        data_sha256="s",
        data_dir="/d",
        world_size=2,
        software={},
        hardware={},
        partition=[],
        progress={"counters": {"step": 3}, "session_id": "s1"},
    )
    assert with_progress["counters"] == {"step": 3} and with_progress["session_id"] == "s1"


def test_choose_checkpoint_latest_or_named_else_refused():
    assert choose_checkpoint([10, 20], None, "ck") == 20
    assert choose_checkpoint([10, 20], 10, "ck") == 10
    with pytest.raises(CheckpointError, match="no committed checkpoint at that step"):
        choose_checkpoint([10, 20], 15, "ck")
    with pytest.raises(CheckpointError, match="no committed checkpoint in ck"):
        choose_checkpoint([], None, "ck")


def test_set_dotted_sets_recipe_keys_only():
    data = {"train": {"max_steps": 5}, "optim": {"muon": {"lr": 0.1}}}
    set_dotted(data, "train.max_steps", 9)
    set_dotted(data, "recipe.optim.muon.lr", 0.2)
    set_dotted(data, "world_size", 4)  # not a recipe key
    set_dotted(data, "optimizer.partition", [])
    assert data == {"train": {"max_steps": 9}, "optim": {"muon": {"lr": 0.2}}}


def test_plan_takes_the_checkpoints_recipe_with_free_and_allowed_changes_applied():
    saved = _config("train.max_steps=10", "optim.muon.lr=0.003")
    wanted = _config("train.max_steps=20", "optim.muon.lr=0.006")
    plan = plan_resume(wanted, checkpoint_step=10, saved_meta=_meta(saved), current_meta=_meta(wanted),
                       allow_changes=["optim.muon.lr"])
    assert plan.resuming and plan.checkpoint_step == 10
    assert config_to_dict(plan.config) == config_to_dict(wanted)
    assert plan.free_changes == [{"key": "train.max_steps", "old": 10, "new": 20}]
    assert plan.allowed_changes == [{"key": "optim.muon.lr", "old": 0.003, "new": 0.006}]


def test_the_checkpoints_skip_ranges_stay_in_force_and_a_resume_may_add_more():
    """A run's train.skip_data ranges (a user's, or an older run's rollbacks kept as batch ranges in its
    recipe) are stepped over after a resume too, whatever the command's recipe names; a range it adds joins
    them."""
    saved = _config("train.skip_data=[[16,3]]")
    plain = plan_resume(_config(), checkpoint_step=14, saved_meta=_meta(saved), current_meta=_meta(_config()),
                        allow_changes=[])
    assert plain.config.train.skip_data == [[16, 3]] and plain.free_changes == []
    more = _config("train.skip_data=[[40,2]]")
    added = plan_resume(
        more, checkpoint_step=14, saved_meta=_meta(saved), current_meta=_meta(more), allow_changes=[]
    )
    assert added.config.train.skip_data == [[16, 3], [40, 2]]
    assert added.free_changes == [{"key": "train.skip_data", "old": [[16, 3]], "new": [[16, 3], [40, 2]]}]


def test_a_run_that_said_train_tensorboard_resumes_with_the_trackers_the_command_loads_now():
    # A checkpoint recorded before the alias was folded; the command's recipe is loaded folded (or without
    # it).
    from pilotrun.config import loaded_recipe

    recorded = config_to_dict(RunConfig())
    recorded["train"]["log"]["tensorboard"] = True
    saved = config_from_dict(recorded)
    assert config_to_dict(saved) == recorded  # read back as recorded: not folded
    for overrides, trackers in ((["train.tensorboard=true"], ["tensorboard"]), ([], [])):
        wanted = loaded_recipe(apply_overrides(config_to_dict(RunConfig()), overrides))
        plan = plan_resume(wanted, checkpoint_step=10, saved_meta=_meta(saved), current_meta=_meta(wanted),
                           allow_changes=[])  # machine keys: free, nothing to allow
        assert (plan.config.train.log.tensorboard, plan.config.train.log.trackers) == (False, trackers)
        assert config_to_dict(plan.config) == config_to_dict(wanted)


def test_plan_refuses_an_unallowed_change_before_anything_is_built():
    saved, wanted = _config("train.seed=1"), _config("train.seed=2")
    with pytest.raises(CheckpointError, match="train.seed: 1 -> 2"):
        plan_resume(
            wanted, checkpoint_step=10, saved_meta=_meta(saved), current_meta=_meta(wanted), allow_changes=[]
        )


def test_plan_reconciles_world_size_first():
    saved, wanted = _config("train.batch_size=4"), _config("train.batch_size=2")
    with pytest.raises(CheckpointError, match="written by 1 rank"):
        plan_resume(wanted, checkpoint_step=1, saved_meta=_meta(saved, 1), current_meta=_meta(wanted, 2),
                    allow_changes=[])
    plan = plan_resume(wanted, checkpoint_step=1, saved_meta=_meta(saved, 1), current_meta=_meta(wanted, 2),
                       allow_changes=["world_size"])
    assert plan.config.train.batch_size == 2 and any("world size changed 1 -> 2" in n for n in plan.notes)
    assert [c["key"] for c in plan.allowed_changes] == ["world_size"]


def test_plan_session_fresh_and_resumed_paths():
    config = _config()
    never = lambda *a: pytest.fail("a fresh session reads no checkpoint")  # noqa: E731
    fresh = plan_session(config, resume=False, from_step=None, committed_steps=never, read_meta=never,
                         current_meta=never, allow_changes=[], root="ck")
    assert not fresh.resuming and fresh.config is config
    with pytest.raises(ConfigError, match="--from-step needs --resume"):
        plan_session(
            config,
            resume=False,
            from_step=3,
            committed_steps=never,
            read_meta=never,
            current_meta=never,
            allow_changes=[],
            root="ck",
        )
    read: list[int] = []
    resumed = plan_session(config, resume=True, from_step=None, committed_steps=lambda: [5, 7],
                           read_meta=lambda step: read.append(step) or _meta(config),
                           current_meta=lambda: _meta(config), allow_changes=[], root="ck")
    assert (
        resumed.checkpoint_step == 7 and read == [7] and resumed.free_changes == resumed.allowed_changes == []
    )


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("optim.router_optimizer=muon",),
        ("optim.muon.granularity=per_head",),
        ("optim.wd_norms=false", "model.q_lora_rank=16"),
    ],
)
def test_partition_table_from_the_model_alone_equals_the_optimizers(overrides):
    config = _config("model.vocab_size=256", *overrides)
    torch.manual_seed(0)
    model = build_model(config.model)
    from_model = partition_table(partition_parameters(model, config.optim))
    from_optimizer = partition_table(build_optimizer(model, config.optim).param_groups)
    assert from_model == from_optimizer and len(from_model) >= 3


def test_auto_takes_the_newest_that_verifies_and_names_those_passed_over():
    from pilotrun.training.checkpoint.resume_plan import choose_verified

    def verify(step):
        if step > 20:
            raise CheckpointError(f"checkpoint file step-{step}/model.pt does not match its recorded sha256")

    assert choose_verified([10, 20], verify, "R") == (20, [])
    step, notes = choose_verified([10, 20, 30, 40], verify, "R")
    assert step == 20 and len(notes) == 1
    assert "step 40 (" in notes[0] and "step 30 (" in notes[0] and "continuing from step 20" in notes[0]


def test_auto_refuses_when_none_verifies_rather_than_start_at_step_0():
    from pilotrun.training.checkpoint.resume_plan import choose_verified

    def verify(step):
        raise CheckpointError(f"step-{step} damaged")

    with pytest.raises(
        CheckpointError,
        match=r"none of the 2 committed .* in R verifies.*step 20 \(step-20 damaged\); "
        r"step 10 \(step-10 damaged\)",
    ):
        choose_verified([10, 20], verify, "R")
