"""Resume compatibility: free keys pass, every other difference is refused by name, allowed ones are
returned."""

import copy

import pytest

from pilotrun.common.errors import CheckpointError
from pilotrun.config import RunConfig, config_to_dict
from pilotrun.training.checkpoint.compatibility import check_resume_compatibility


def run_meta() -> dict:
    return {
        "recipe": config_to_dict(RunConfig()),
        "data": {"dir": "/data/edu", "metadata_sha256": "a" * 64},
        "world_size": 1,
        "optimizer": {
            "partition": [
                {
                    "group": "muon_matrices",
                    "parameters": ["layers.0.attn.wq.weight"],
                    "count": 1,
                    "optimizer": "muon",
                    "lr": 0.003,
                    "weight_decay": 0.1,
                },
                {
                    "group": "adamw_other",
                    "parameters": ["embed.weight", "head.weight"],
                    "count": 2,
                    "optimizer": "adamw",
                    "lr": 0.003,
                    "weight_decay": 0.1,
                },
            ]
        },
        "software": {"python": "3.11.9", "torch": "2.13.0+cpu", "numpy": "2.4.6", "pilotrun": "0.1.0"},
        "hardware": {"device": "cpu", "device_name": "x86_64", "cpu_count": 2},
        "counters": {"step": 10, "tokens_seen": 1280},
    }


def changed(path: str, value) -> dict:
    meta = run_meta()
    node = meta
    parts = path.split(".")
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = value
    return meta


def test_identical_meta_is_compatible_with_nothing_to_report():
    report = check_resume_compatibility(run_meta(), run_meta())
    assert report.free_changes == [] and report.allowed_changes == [] and report.warnings == []


def test_counters_and_data_dir_may_differ():
    current = changed("counters.step", 0)
    current["data"]["dir"] = "/elsewhere/edu"  # the same data moved: identity is the hash, not the path
    assert check_resume_compatibility(run_meta(), current).free_changes == []


@pytest.mark.parametrize("key,value", [
    ("recipe.train.max_steps", 500), ("recipe.train.log.every", 3), ("recipe.train.eval.every", 7),
    ("recipe.train.checkpoint.every", 11), ("recipe.train.checkpoint.keep", 9),
])
def test_free_keys_change_without_ceremony(key, value):
    report = check_resume_compatibility(run_meta(), changed(key, value))
    assert [c["key"] for c in report.free_changes] == [key.removeprefix("recipe.")]
    assert report.free_changes[0]["new"] == value


@pytest.mark.parametrize("key,value,named", [
    ("recipe.model.d_model", 128, "model.d_model"),
    ("recipe.model.balance", "seq", "model.balance"),
    ("recipe.optim.muon.lr", 0.01, "optim.muon.lr"),
    ("recipe.optim.adamw.betas", [0.9, 0.99], "optim.adamw.betas"),
    ("recipe.optim.qk_clip.tau", 50.0, "optim.qk_clip.tau"),
    ("recipe.train.batch_size", 8, "train.batch_size"),
    ("recipe.train.seq_len", 64, "train.seq_len"),
    ("recipe.train.gradient_accumulation_steps", 2, "train.gradient_accumulation_steps"),
    ("recipe.train.precision", "bf16", "train.precision"),
    ("recipe.train.seed", 1, "train.seed"),
    ("world_size", 2, "world_size"),
    ("data.metadata_sha256", "b" * 64, "data.metadata_sha256"),
])
def test_each_incompatible_change_is_refused_by_name(key, value, named):
    with pytest.raises(CheckpointError) as caught:
        check_resume_compatibility(run_meta(), changed(key, value))
    message = str(caught.value)
    assert f"{named}: " in message and "1 incompatible difference" in message
    assert "\n" not in message


def test_partition_change_is_refused_naming_the_group():
    current = run_meta()
    current["optimizer"]["partition"][1]["parameters"] = ["embed.weight"]
    current["optimizer"]["partition"][1]["count"] = 1
    with pytest.raises(CheckpointError, match=r"optimizer\.partition: group adamw_other count 2 -> 1"):
        check_resume_compatibility(run_meta(), current)


@pytest.mark.parametrize("damage", [None, 3, "text"])
def test_a_damaged_partition_row_in_a_marker_is_refused_naming_it_not_raised(damage):
    # A committed marker edited or damaged on disk: a partition row that is no object is a difference to
    # refuse in one line, never an AttributeError out of the comparison.
    saved = run_meta()
    saved["optimizer"]["partition"][1] = damage
    damaged_row = r"optimizer\.partition: group #1 \(damaged\) removed; group adamw_other added"
    with pytest.raises(CheckpointError, match=damaged_row):
        check_resume_compatibility(saved, run_meta())
    saved["optimizer"]["partition"] = damage
    no_rows = r"optimizer\.partition: group adamw_other added; group muon_matrices added"
    with pytest.raises(CheckpointError, match=no_rows):
        check_resume_compatibility(saved, run_meta())


def test_every_difference_is_listed_at_once():
    current = changed("recipe.train.batch_size", 8)
    current["world_size"] = 4
    current["data"]["metadata_sha256"] = "c" * 64
    current["recipe"]["train"]["max_steps"] = 999  # free: must not appear among the refusals
    with pytest.raises(CheckpointError) as caught:
        check_resume_compatibility(run_meta(), current)
    message = str(caught.value)
    assert "3 incompatible difference(s)" in message
    for named in ("train.batch_size: 4 -> 8", "world_size: 1 -> 4", "data.metadata_sha256"):
        assert named in message
    assert "max_steps" not in message


def test_other_data_asks_whether_this_is_the_right_run_folder_instead_of_offering_to_allow_it():
    current = run_meta()
    current["data"]["metadata_sha256"] = "c" * 64
    current["recipe"]["optim"]["schedule"]["horizon"] = 77  # as another run's recipe would differ too
    with pytest.raises(CheckpointError) as caught:
        check_resume_compatibility(run_meta(), current)
    message = str(caught.value)
    assert "data.metadata_sha256" in message and "is this the right run folder" in message
    assert "--allow-change" not in message


def test_allowed_change_is_accepted_and_returned_for_the_record():
    current = changed("recipe.optim.muon.lr", 0.01)
    current["recipe"]["train"]["max_steps"] = 400
    report = check_resume_compatibility(run_meta(), current, allowed=["optim.muon.lr"])
    assert report.allowed_changes == [{"key": "optim.muon.lr", "old": 0.003, "new": 0.01}]
    assert [c["key"] for c in report.free_changes] == ["train.max_steps"]


def test_allowing_one_change_still_refuses_the_others():
    current = changed("recipe.optim.muon.lr", 0.01)
    current["recipe"]["train"]["precision"] = "fp16"
    with pytest.raises(CheckpointError, match="train.precision") as caught:
        check_resume_compatibility(run_meta(), current, allowed=["optim.muon.lr"])
    assert "optim.muon.lr" not in str(caught.value)


def test_shape_changing_model_keys_cannot_be_allowed():
    with pytest.raises(CheckpointError, match="model.n_layers: 2 -> 3 .cannot be allowed"):
        check_resume_compatibility(
            run_meta(), changed("recipe.model.n_layers", 3), allowed=["model.n_layers"]
        )


def test_numerics_software_and_hardware_changes_are_warnings():
    current = changed("software.torch", "2.14.0")
    current["hardware"]["device_name"] = "NVIDIA H100"
    current["software"]["pilotrun"] = "0.2.0"  # not numerics-relevant by itself: no warning
    report = check_resume_compatibility(run_meta(), current)
    assert len(report.warnings) == 2
    assert "software.torch" in report.warnings[0] and "bit-exact" in report.warnings[0]
    assert "hardware.device_name" in report.warnings[1]
    assert [c["key"] for c in report.not_exact] == ["software.torch", "hardware.device_name"]


def test_another_thread_count_is_where_bit_exactness_is_no_longer_promised():
    """The thread count may decide the order of a reduction's additions: a warning, and a `not_exact` change
    that run.json records. A checkpoint that never recorded its thread count is not held to one."""
    saved = run_meta()
    saved["hardware"]["torch_threads"] = 1
    current = run_meta()
    current["hardware"]["torch_threads"] = 2
    report = check_resume_compatibility(saved, current)
    assert report.not_exact == [{"key": "hardware.torch_threads", "old": 1, "new": 2}]
    assert "hardware.torch_threads changed (1 -> 2)" in report.warnings[0]
    assert check_resume_compatibility(saved, saved).not_exact == []
    assert check_resume_compatibility(run_meta(), current).not_exact == []  # written before threads were kept


def test_an_allow_change_that_matches_nothing_is_a_warning():
    report = check_resume_compatibility(run_meta(), run_meta(), allowed=["train.batch_size"])
    assert report.warnings == ["--allow-change train.batch_size: no such difference, nothing to allow"]


def test_a_missing_section_counts_as_a_difference():
    saved = copy.deepcopy(run_meta())
    del saved["data"]
    with pytest.raises(CheckpointError, match="data.metadata_sha256: <absent> -> "):
        check_resume_compatibility(saved, run_meta())
