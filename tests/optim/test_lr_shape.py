"""The torch-free LR shape: the schedule the trainer sets (optim/schedule.py) from a recipe's plain fields."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pilotrun.optim import schedule
from pilotrun.optim.lr_shape import lr_multiplier


def shape(kind: str) -> SimpleNamespace:
    return SimpleNamespace(kind=kind, warmup_steps=10, horizon=110, min_lr_ratio=0.1, decay_fraction=0.2)


def test_the_trainer_sets_the_same_shape():
    assert schedule.lr_multiplier is lr_multiplier


@pytest.mark.parametrize(
    "kind, step, expected",
    [
        ("cosine", 0, 0.1),
        ("cosine", 60, 0.55),
        ("cosine", 200, 0.1),
        ("wsd", 50, 1.0),
        ("wsd", 99, 1.0 - 0.9 * 11 / 22),
        ("constant", 500, 1.0),
    ],
)
def test_a_recipe_dicts_fields_give_the_multiplier(kind, step, expected):
    assert lr_multiplier(step, shape(kind)) == pytest.approx(expected)
