"""pilotrun/training/checkpoint/retention.py and the checkpointer's pruning by it: the newest K, every N-th
step for good, protected steps never pruned (and remembered across sessions through the markers), and the
count the disk plan sizes."""

from __future__ import annotations

import json

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pilotrun.run.marker import MARKER_NAME
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.checkpoint.retention import (
    PROTECT_FINAL,
    PROTECT_ROLLBACK,
    doomed_steps,
    kept_at_most,
    merge_protected,
)


def test_the_tiers():
    steps = [10, 20, 30, 40, 50, 60]
    assert doomed_steps(steps, 60, keep=2) == [10, 20, 30, 40]
    assert doomed_steps(steps, 60, keep=2, keep_every=20) == [10, 30]  # 20 and 40 kept for good
    assert doomed_steps(steps, 60, keep=2, protected={10: PROTECT_ROLLBACK}) == [20, 30, 40]
    # After a resume from step 30: the later steps are another timeline's, whatever tier would keep them.
    assert doomed_steps(steps, 30, keep=2, keep_every=20, protected={50: "keep_steps"}) == [10, 40, 50, 60]


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 200), max_size=30), st.integers(1, 5), st.integers(0, 30),
       st.dictionaries(st.integers(0, 200), st.just("keep_steps"), max_size=5))
def test_pruning_never_removes_a_protected_step_nor_the_newest_k(committed, keep, keep_every, protected):
    newest = max(committed, default=0)
    doomed = set(doomed_steps(committed, newest, keep, keep_every, protected))
    assert not doomed & set(protected)
    assert not doomed & set(sorted(committed)[-keep:])
    assert all(step % keep_every for step in doomed) if keep_every else True


def test_kept_at_most_counts_the_tiers_by_max_steps():
    assert kept_at_most(1000, 50, keep=3) == 4  # the newest 3 and the final one
    assert kept_at_most(1000, 50, keep=3, keep_every=100) == 14  # + steps 100, 200, ..., 1000
    assert kept_at_most(1000, 30, keep=3, keep_every=100) == 4 + 1000 // 300  # only where the cadences meet
    assert kept_at_most(1000, 50, keep=3, protected=[7, 7, 9]) == 6


def test_merge_protected_reads_json_keys_and_ignores_anything_else():
    into = {5: PROTECT_FINAL}
    merge_protected(into, {"5": "keep_steps", "12": PROTECT_ROLLBACK, "x": "y", "13": 4})
    merge_protected(into, None)
    assert into == {5: PROTECT_FINAL, 12: PROTECT_ROLLBACK}


def _save(checkpointer: Checkpointer, step: int) -> None:
    checkpointer.save(step, {"model": {"w": torch.full((2,), float(step))}}, {"run_id": "r"})


def test_the_checkpointer_prunes_by_the_tiers_and_protection_outlives_the_session(tmp_path):
    first = Checkpointer(tmp_path, keep=2, keep_every=4, keep_steps=[1])
    for step in range(1, 8):
        if step == 3:
            first.protect(3, PROTECT_ROLLBACK)
        _save(first, step)
    assert first.committed_steps() == [1, 3, 4, 6, 7]
    marker = json.loads((tmp_path / "checkpoints" / "step-00000007" / MARKER_NAME).read_text())
    assert marker["protected"] == {"1": "keep_steps", "3": PROTECT_ROLLBACK}
    # A later session with plain settings still keeps what the markers protect; step 4 is no longer kept for
    # good.
    later = Checkpointer(tmp_path, keep=1)
    for step in range(8, 11):
        _save(later, step)
    assert later.committed_steps() == [1, 3, 10]
