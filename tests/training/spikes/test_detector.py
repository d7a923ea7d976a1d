"""The spike judge without training (the bound itself: tests/training/spikes/test_bound.py): the window of
applied updates, non-finite values, the policies' actions (the rollback cap, no checkpoint to roll back to),
the skip ranges, and the checkpointed state."""

from __future__ import annotations

import math

import pytest
import torch

from pilotrun.config import SpikeConfig
from pilotrun.training.spikes.detector import (
    SpikeDetector,
    SpikeGate,
    agreed,
    gathered_values,
    per_rank_pairs,
    skip_ahead,
    skip_data_section,
    upcoming_batches,
)


def detector(**changes) -> SpikeDetector:
    config = SpikeConfig(**{"window": 10, "min_history": 4, "factor": 6.0, **changes})
    found = SpikeDetector(config)
    for loss, norm in [(3.0, 1.0), (3.1, 1.1), (2.9, 0.9), (3.0, 1.0), (3.05, 1.05)]:
        found.pending = (loss, norm)
        found.after_update(0, None)
    return found


def test_a_gradient_norm_must_also_reach_four_times_the_median_where_a_loss_need_not():
    found = detector()  # losses about 3.0, norms about 1.0, both with MAD 0.05
    assert found.judge(3.0, 3.9)[0] == [] and found.judge(3.0, 4.1)[0] == ["grad_norm"]
    assert found.judge(3.5, 1.0)[0] == ["loss"]


def test_on_fewer_tokens_per_update_the_gradient_norm_s_floor_grows_with_its_noise():
    """At 128 tokens per update (the smoke recipe) the floor is twice the 512-token one: a norm must exceed 7x
    the median (healthy 128-token runs reached 5.4x); at 512 tokens and more it is the 4x of the module."""
    small, large = (SpikeDetector(SpikeConfig(window=10, min_history=4), tokens) for tokens in (128, 4096))
    for found in (small, large):
        for loss, norm in [(3.0, 1.0), (3.1, 1.1), (2.9, 0.9), (3.0, 1.0), (3.05, 1.05)]:
            found.pending = (loss, norm)
            found.after_update(0, None)
    assert small.floor_shares == {"loss": 0.01, "grad_norm": 1.0} and large.floor_shares["grad_norm"] == 0.5
    assert large.judge(3.0, 5.4)[0] == ["grad_norm"] and small.judge(3.0, 5.4)[0] == []
    assert small.judge(3.0, 6.9)[0] == [] and small.judge(3.0, 7.1)[0] == ["grad_norm"]
    assert small.judge(3.5, 1.0)[0] == ["loss"]  # the loss's bound does not depend on the batch


def test_judge_flags_values_above_the_bound_and_non_finite_ones_from_the_start():
    found = detector()
    assert found.judge(3.1, 1.1) == ([], found.judge(3.1, 1.1)[1])
    signals, bounds = found.judge(3.0, 50.0)
    assert signals == ["grad_norm"] and set(bounds) == {"loss", "grad_norm"}
    assert found.judge(math.nan, 1.0)[0] == ["loss"]
    empty = SpikeDetector(SpikeConfig(min_history=4))
    assert empty.judge(1e9, 1e9) == ([], {})  # too little history: finite values are not judged
    assert empty.judge(math.inf, 1.0)[0] == ["loss"]


def test_only_applied_finite_updates_join_the_window_and_it_keeps_its_length():
    found = detector(window=3, min_history=1)
    assert list(found.history["loss"]) == [2.9, 3.0, 3.05]
    found.pending = (math.nan, 1.0)
    found.after_update(0, None)
    assert list(found.history["loss"]) == [2.9, 3.0, 3.05] and list(found.history["grad_norm"])[-1] == 1.0


ROLLBACK_RECORD = {"origin": "rollback", "spike_step": 17, "first_batch": 16, "batches": 3,
                   "documents": [{"pass": 0, "first": 40, "last": 41, "tokens": [2010, 2290]}],
                   "read": [{"pass": 0, "tokens": [2048, 2433], "documents": [40, 43]}]}


def test_state_round_trips_and_an_older_checkpoint_without_it_starts_empty():
    found = detector()
    found.rollbacks = 2
    found.skip_data = [ROLLBACK_RECORD]
    again = SpikeDetector(found.config)
    again.load_state_dict(found.state_dict())
    assert again.state_dict() == found.state_dict() and again.rollbacks == 2
    assert again.skip_data == [ROLLBACK_RECORD]
    assert isinstance(found.state_dict()["skip_data"], str)  # one plain value, whatever the storage
    again.load_state_dict(None)
    assert again.state_dict() == {"loss": [], "grad_norm": [], "rollbacks": 0, "skip_data": "[]"}
    assert SpikeDetector.state_optional
    # A checkpoint from before rollbacks kept their records: its ranges are its recipe's, and still stepped
    # over.
    older = {"loss": [3.0], "grad_norm": [1.0], "rollbacks": 1}
    again.load_state_dict(older)
    assert again.rollbacks == 1 and again.skip_data == []
    assert again.skip_ranges([[16, 3]]) == [[16, 3]]


def test_the_ranges_stepped_over_are_the_recipes_then_the_rollbacks():
    found = detector()
    found.skip_data = [ROLLBACK_RECORD, dict(ROLLBACK_RECORD, first_batch=30, batches=2)]
    assert found.skip_ranges([]) == [[16, 3], [30, 2]]
    assert found.skip_ranges([[4, 1]]) == [[4, 1], [16, 3], [30, 2]]
    assert upcoming_batches(15, 3, found.skip_ranges([])) == [15, 19, 20]


@pytest.mark.parametrize(("policy", "rollbacks", "can", "action", "reason"), [
    ("record", 0, True, "recorded", None), ("skip", 0, True, "skipped", "spike"),
    ("rollback", 0, True, "rollback", "spike"), ("rollback", 0, False, "skipped", "spike"),
    ("rollback", 3, True, "stopped", "spike")])
def test_the_gate_answers_by_policy(policy, rollbacks, can, action, reason):
    found = detector(policy=policy, max_rollbacks=3)
    found.rollbacks = rollbacks
    gate = SpikeGate(found, step=6, batches=[5], can_roll_back=can)
    assert gate(50.0, [50.0, 3.0]) == reason
    assert gate.verdict.action == action and gate.verdict.step == 6 and gate.verdict.batches == [5]
    fields = gate.verdict.fields(128)
    assert fields["skipped"] is (action != "recorded") and fields["tokens"] == 128 and fields["cause"] is None
    quiet = SpikeGate(found, step=6, batches=[5], can_roll_back=can)
    assert quiet(1.0, [1.0, 3.0]) is None and quiet.verdict is None and found.pending == (3.0, 1.0)


def test_the_gate_replays_before_it_answers():
    seen = []
    gate = SpikeGate(
        detector(), 6, [5], True, replay=lambda verdict: seen.append(verdict) or {"cause": "batch"}
    )
    gate(50.0, [50.0, 3.0])
    assert seen == [gate.verdict] and gate.verdict.fields(1)["cause"] == "batch"


def test_values_agreed_by_every_rank():
    values = gathered_values(torch.tensor(2.0), torch.tensor(6.0, dtype=torch.float64), 2, None).tolist()
    assert values == [2.0, 2.0, 3.0]
    assert per_rank_pairs([1.0, 3.0, 9.0, 4.0]) == [[1.0, 3.0], [9.0, 4.0]]
    assert agreed([[1.0, 3.0], [9.0, 4.0]]) == (9.0, 3.5)
    assert math.isnan(agreed([[1.0, 3.0], [math.nan, 4.0]])[0])


def test_skip_ranges_are_stepped_over():
    assert skip_ahead(3, []) == 3
    assert skip_ahead(5, [[5, 2], [7, 1]]) == 8
    assert skip_ahead(6, [[5, 2]]) == 7 and skip_ahead(4, [[5, 2]]) == 4
    assert upcoming_batches(4, 3, [[5, 2]]) == [4, 7, 8]


def test_run_json_describes_the_recipes_ranges_and_keeps_the_rollbacks_records(builtin_data_dir):
    """run.json's skip_data: a range the recipe names (a user's, or an older run's rollback kept as batches
    only) is described from the data when a session opens; a rollback's record is written as the trainer state
    holds it."""
    from pilotrun.data.reader import BatchLoader, open_dataset
    from pilotrun.data.skipped_documents import read_documents

    dataset = open_dataset(builtin_data_dir)
    loader = BatchLoader(dataset.split("train"), batch_size=4, seq_len=32)
    found = detector()
    found.skip_data = [ROLLBACK_RECORD]
    given, record = skip_data_section([[2, 3]], found, loader, dataset.eos_id)
    assert record == ROLLBACK_RECORD
    assert given == {"origin": "recipe", "first_batch": 2, "batches": 3,
                     "read": read_documents(loader, dataset.eos_id, 2, 3)}
    (read,) = given["read"]
    assert (
        read["pass"] == 0
        and read["tokens"] == [2 * 128, 5 * 128 + 1]
        and read["documents"][0] <= read["documents"][1]
    )


def test_the_loss_is_held_to_its_upper_tail_the_gradient_norm_to_its_floor():
    """A window of healthy updates whose losses have a heavy upper tail (one batch in six of harder text, as a
    small batch gives): the next hard batch is no spike, a noise document's loss still is."""
    found = SpikeDetector(SpikeConfig(window=50, min_history=20, factor=6.0))
    for i in range(50):
        found.pending = (6.0 + 0.01 * (i % 5 - 2) + (0.6 if i % 6 == 0 else 0.0), 1.0 + 0.01 * (i % 3))
        found.after_update(i, None)
    assert found.judge(7.4, 1.0)[0] == [] and found.judge(9.5, 1.0)[0] == ["loss"]
    assert found.judge(6.0, 4.1)[0] == ["grad_norm"]
