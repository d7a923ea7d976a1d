"""A recipe as a command is given it: YAML + --set merging, and one clear error per bad input."""

import pytest

from pilotrun.common.errors import ConfigError
from pilotrun.config import (
    MACHINE_KEYS,
    RunConfig,
    check_allow_change_keys,
    config_from_dict,
    config_to_dict,
    flatten,
    load_run_config,
)


def test_yaml_and_overrides_merge(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  max_steps: 7\n  seq_len: 16\noptim:\n  muon:\n    lr: 0.01\n")
    config = load_run_config(
        path, ["train.max_steps=9", "optim.adamw.betas=[0.8, 0.9]", "train.precision=bf16"]
    )
    assert config.train.max_steps == 9
    assert config.train.seq_len == 16
    assert config.optim.muon.lr == 0.01
    assert config.optim.adamw.betas == [0.8, 0.9]
    assert config.train.precision == "bf16"


def test_integer_written_as_float_is_accepted(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("train:\n  max_steps: 1e3\n")
    assert load_run_config(path).train.max_steps == 1000


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("train.bogus=1", "unknown config key 'train.bogus'"),
        ("nosection.x=1", "unknown config key 'nosection'"),
        ("train.max_steps=abc", "train.max_steps' must be int"),
        ("train.precision=fp8", "train.precision must be one of"),
        ("model.top_k=9", "model.top_k (9) must be between 1"),
        ("model.top_k=1", "top_k must be >= 2 with a sigmoid router"),
        ("model.qk_rope_head_dim=7", "qk_rope_head_dim must be even"),
        ("train.seq_len=99999", "exceeds model.max_seq_len"),
        ("model.n_dense_layers=5", "n_dense_layers (5) must be between"),
        ("train.batch_size=0", "train.batch_size must be >= 1"),
        ("model.route_norm=yes please", "model.route_norm' must be bool"),
        ("optim.schedule.kind=linear", "optim.schedule.kind must be one of"),
    ],
)
def test_bad_input_is_one_clear_error(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_run_config(None, [override])
    assert fragment in str(info.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_run_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_run_config(bad)


def test_an_unknown_set_key_is_blamed_on_the_flag_with_the_nearest_known_key():
    with pytest.raises(ConfigError) as refused:
        load_run_config("stability", ["train.max_step=3"])
    message = str(refused.value)
    assert message.startswith("--set train.max_step: unknown config key 'train.max_step'; did you mean "
                              "'train.max_steps'?")
    assert "stability" not in message  # the recipe file is not at fault
    # In the recipe file itself, the file is named and the nearest key suggested too.
    with pytest.raises(ConfigError, match=r"unknown config key 'train.max_step'; did you mean 'max_steps'\?"):
        config_from_dict({"train": {"max_step": 3}})


def test_the_tensorboard_alias_is_folded_when_loaded_and_a_recorded_recipe_keeps_its_identity():
    from pilotrun.common.files import canonical_sha256
    from pilotrun.config import loaded_recipe

    # Loaded for a session (YAML, --set, a lock's recipe, the API): one list, the alias reads back false.
    folded = load_run_config(None, ["train.log.tensorboard=true", "train.log.trackers=[wandb]"])
    assert (folded.train.log.trackers, folded.train.log.tensorboard) == (["tensorboard", "wandb"], False)
    # folding is idempotent
    assert config_to_dict(loaded_recipe(config_to_dict(folded))) == config_to_dict(folded)
    # Read back from a record (run.json, a checkpoint, a lock): byte for byte, so its sha256 is the one
    # recorded, for a recipe that said true as for every recipe that never did.
    for said in (True, False):
        recorded = config_to_dict(RunConfig())
        recorded["train"]["log"]["tensorboard"] = said
        assert config_to_dict(config_from_dict(recorded)) == recorded
        assert canonical_sha256(config_to_dict(config_from_dict(recorded))) == canonical_sha256(recorded)
    # A session loaded from such a record (a lock's recipe) differs from it in machine keys only: free on
    # resume and outside a lock's comparison (tests/run/test_recipe_lock.py,
    # tests/training/checkpoint/test_resume_plan.py).
    recorded = config_to_dict(RunConfig())
    recorded["train"]["log"].update(tensorboard=True, trackers=["wandb"])
    now, before = flatten(config_to_dict(loaded_recipe(recorded))), flatten(recorded)
    changed = {key for key in now if now[key] != before[key]}
    assert changed == {"train.log.tensorboard", "train.log.trackers"} and changed <= set(MACHINE_KEYS)


@pytest.mark.parametrize(("flag", "named"), [
    ("optim.muon.lr=fast", "config key 'optim.muon.lr' must be float, got fast"),
    ("optim.muon.lr=-1", "optim.muon.lr must be >= 0"),
    ("model.top_k=9", "model.top_k (9) must be between 1"),
])
def test_a_set_mistake_is_blamed_on_the_flag_not_the_recipe_file(tmp_path, capsys, flag, named):
    from pilotrun.commands.cli import main

    recipe = tmp_path / "my.yaml"
    recipe.write_text("model: {d_model: 96}\n")
    for command in (["config"], ["train", "--data", str(tmp_path / "d"), "--run-dir", str(tmp_path / "r")]):
        assert main([*command, "--config", str(recipe), "--set", flag]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"pilotrun: error: --set {flag}: " + err[0].split(": ", 3)[3]], err
        assert named in err[0] and "my.yaml" not in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my.yaml"]  # nothing written
    # A mistake in the file itself is still the file's.
    recipe.write_text("model: {d_model: fast}\n")
    assert main(["config", "--config", str(recipe), "--set", "optim.muon.lr=0.01"]) == 2
    assert f"{recipe}: config key 'model.d_model' must be int" in capsys.readouterr().err


def test_a_set_mistake_on_a_frozen_recipe_is_blamed_on_the_flag(tmp_path, capsys):
    import json

    from pilotrun.commands.cli import main
    from tests.run.test_recipe_lock import _lock

    lock = tmp_path / "lock.json"
    lock.write_text(json.dumps(_lock(recipe=config_to_dict(load_run_config("smoke")))))
    assert (
        main(
            [
                "train",
                "--frozen",
                str(lock),
                "--data",
                str(tmp_path / "d"),
                "--run-dir",
                str(tmp_path / "r"),
                "--set",
                "optim.muon.lr=fast",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "pilotrun: error: --set optim.muon.lr=fast: config key 'optim.muon.lr' must be float, got fast"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock.json"]


def test_an_unknown_allow_change_key_is_refused_with_the_nearest_known_key():
    check_allow_change_keys(["train.max_steps", "recipe.optim.muon.lr", "train.eval_every", "world_size",
                             "data.metadata_sha256", "data.mixture.weights", "code", "optimizer.partition"])
    with pytest.raises(ConfigError, match=r"--allow-change train.max_step: no such key; did you mean "
                                          r"'train.max_steps'\?"):
        check_allow_change_keys(["train.max_step"])
    with pytest.raises(ConfigError, match=r"did you mean 'data.mixture.weights'\?"):
        check_allow_change_keys(["data.mixture.weigths"])
