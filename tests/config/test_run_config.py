"""The whole recipe: what a resume may change is read from the knobs, the lists once kept by hand."""

from pathlib import Path

from pilotrun.config import MACHINE_KEYS, RESUME_FREE_KEYS, RunConfig, config_to_dict, flatten
from pilotrun.config.knob import keys_on_resume
from pilotrun.config.renames import current_key

# The two lists as they were kept by hand in pilotrun/config.py before the knobs said it themselves.
HAND_KEPT_MACHINE_KEYS = (
    "train.num_threads",
    "train.profile.start_step", "train.profile.steps", "train.profile.top_operators",
    "train.profile.record_shapes", "train.profile.profile_memory", "train.profile.with_stack",
    "train.tensorboard", "train.trackers",
    "train.spike.replay",
    "train.downstream_tasks", "train.downstream_every", "train.downstream_limit",
    "train.checkpoint_mode",
)
HAND_KEPT_RESUME_FREE_KEYS = (
    *HAND_KEPT_MACHINE_KEYS,
    "model.activation_checkpointing", "optim.muon.distribute_newton_schulz",
    "train.max_steps", "train.log_every", "train.eval_every", "train.eval_batches", "train.checkpoint_every",
    "train.keep_checkpoints", "train.keep_every", "train.keep_steps", "train.max_consecutive_skips",
    "train.memory_budget_gb", "train.spike.max_rollbacks",
    "train.skip_data",
)


# Machine keys added since the lists were kept by hand: the checkpoint storage (how the same state is
# written).
ADDED_MACHINE_KEYS = ("train.checkpoint.storage",)


def test_the_resume_lists_read_from_the_knobs_equal_the_hand_kept_ones():
    # The hand-kept lists named the flat keys of recipe format 1: compared in today's names.
    hand_kept_machine = [current_key(k) for k in HAND_KEPT_MACHINE_KEYS] + list(ADDED_MACHINE_KEYS)
    hand_kept_free = [current_key(k) for k in HAND_KEPT_RESUME_FREE_KEYS] + list(ADDED_MACHINE_KEYS)
    assert sorted(MACHINE_KEYS) == sorted(hand_kept_machine)
    assert sorted(RESUME_FREE_KEYS) == sorted(hand_kept_free)
    assert len(set(RESUME_FREE_KEYS)) == len(RESUME_FREE_KEYS)
    # Every leaf key is one kind: a knob that says nothing is a recipe key, refused on resume unless allowed.
    recipe = set(keys_on_resume(RunConfig(), ("recipe",)))
    assert recipe.isdisjoint(RESUME_FREE_KEYS)
    assert recipe | set(RESUME_FREE_KEYS) == set(flatten(config_to_dict(RunConfig())))
    assert {"train.seed", "model.d_model", "optim.muon.lr"} <= recipe


def test_the_docs_list_every_key_free_on_resume():
    readme = (Path(__file__).resolve().parents[2] / "docs" / "UNATTENDED.md").read_text()
    section = readme[readme.index("### What a resume may change"):]
    section = section[:section.index("\n## ")]
    missing = [
        k for k in RESUME_FREE_KEYS if f"`{k}`" not in section and f"`{k.rsplit('.', 1)[0]}.*`" not in section
    ]
    assert not missing


