"""RNG capture/restore: the next draws after a restore equal the draws that followed the capture, exactly."""

import random

import numpy as np
import pytest
import torch

from pilotrun.common.errors import CheckpointError
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.checkpoint.rng_state import capture_rng_state, restore_rng_state


def draw_from_every_generator() -> tuple:
    return (
        [random.random() for _ in range(5)],
        random.gauss(0.0, 1.0),
        np.random.rand(5).tolist(),
        np.random.normal(size=3).tolist(),
        torch.rand(7),
        torch.randint(0, 1000, (4,)),
    )


def assert_same_draws(a: tuple, b: tuple) -> None:
    assert a[0] == b[0] and a[1] == b[1] and a[2] == b[2] and a[3] == b[3]
    assert torch.equal(a[4], b[4]) and torch.equal(a[5], b[5])


def advance_generators_with_cached_gaussians() -> None:
    # Leave a cached Gaussian in both Python's and NumPy's generators: the part of the state most often lost.
    random.seed(11)
    random.gauss(0.0, 1.0)
    np.random.seed(12)
    np.random.standard_normal()  # legacy generator caches the second value of the pair
    torch.manual_seed(13)
    torch.rand(3)


def test_restore_gives_the_same_next_draws():
    advance_generators_with_cached_gaussians()
    state = capture_rng_state()
    expected = draw_from_every_generator()
    draw_from_every_generator()  # move everything further on
    notes = restore_rng_state(state)
    assert notes == []
    assert_same_draws(draw_from_every_generator(), expected)


def test_captured_state_is_a_copy():
    advance_generators_with_cached_gaussians()
    state = capture_rng_state()
    before = state["torch_cpu"].clone()
    torch.rand(100)
    assert torch.equal(state["torch_cpu"], before)


def test_round_trip_through_a_checkpoint_on_disk(tmp_path):
    # weights_only loading accepts the state: it is tensors, numbers and strings only.
    advance_generators_with_cached_gaussians()
    state = capture_rng_state()
    expected = draw_from_every_generator()
    Checkpointer(tmp_path, keep=1).save(3, {"rng": state}, {})
    draw_from_every_generator()
    loaded, _ = Checkpointer(tmp_path, keep=1).load()
    restore_rng_state(loaded["rng"])
    assert_same_draws(draw_from_every_generator(), expected)


def test_different_states_give_different_draws():
    # Guards the test above against a restore that silently does nothing.
    torch.manual_seed(1)
    state = capture_rng_state()
    torch.manual_seed(2)
    random.seed(2)
    np.random.seed(2)
    other = draw_from_every_generator()
    restore_rng_state(state)
    assert not torch.equal(draw_from_every_generator()[4], other[4])


def test_malformed_state_is_a_checkpoint_error():
    state = capture_rng_state()
    del state["numpy"]
    with pytest.raises(CheckpointError, match="numpy"):
        restore_rng_state(state)
    state = capture_rng_state()
    state["torch_cpu"] = torch.zeros(3, dtype=torch.float32)
    with pytest.raises(CheckpointError, match="torch_cpu"):
        restore_rng_state(state)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the note given when CUDA is absent")
def test_cuda_states_without_cuda_give_a_note():
    state = capture_rng_state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    notes = restore_rng_state(state)
    assert len(notes) == 1 and "CUDA" in notes[0]
