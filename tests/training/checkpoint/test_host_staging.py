"""pilotrun/training/checkpoint/host_staging.py: the staged copy equals the state bit for bit, owns its memory
(the loop may change the state at once), reuses its host buffers from one save to the next, says which
states it does not stage, and leaves the stable tensors (and only those) to its staging thread."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch

from pilotrun.training.checkpoint import host_staging
from pilotrun.training.checkpoint.host_staging import HostCopyStager, stages


def a_state() -> dict:
    return {
        "model": {"w": torch.randn(33, 17), "b": torch.randn(5, dtype=torch.float64).to(torch.bfloat16)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "momentum": torch.randn(4, 6)}},
                      "param_groups": [{"lr": 0.02, "params": [0]}]},
        "rng": torch.arange(7, dtype=torch.uint8),
        "empty": torch.empty(0, 3),
        "trainer": {"step": 3, "cursor": [1, 2]},
    }


def assert_same(left, right) -> None:
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor) and left.dtype == right.dtype and torch.equal(left, right)
    elif isinstance(left, dict):
        assert left.keys() == right.keys()
        for key in left:
            assert_same(left[key], right[key])
    elif isinstance(left, (list, tuple)):
        assert type(left) is type(right) and len(left) == len(right)
        for one, other in zip(left, right):
            assert_same(one, other)
    else:
        assert left == right


def test_the_staged_copy_equals_the_state_and_owns_its_memory():
    state = a_state()
    before = {"w": state["model"]["w"].clone(), "rng": state["rng"].clone()}
    stager = HostCopyStager()
    staged = stager.stage(state)
    assert_same(state, staged)
    assert staged["model"]["w"].data_ptr() != state["model"]["w"].data_ptr()
    state["model"]["w"].add_(1.0)  # the loop trains on at once
    state["rng"].fill_(0)
    state["trainer"]["cursor"].append(3)
    assert torch.equal(staged["model"]["w"], before["w"]) and torch.equal(staged["rng"], before["rng"])
    assert staged["trainer"] == {"step": 3, "cursor": [1, 2]}
    assert stager.should_synchronize_after_execute is False


def test_the_host_buffers_are_reused_and_refilled_at_the_next_save():
    state = a_state()
    stager = HostCopyStager()
    first = stager.stage(state)
    pointer = first["model"]["w"].data_ptr()
    state["model"]["w"].mul_(3.0)
    state["optimizer"]["state"][0]["momentum"] = torch.randn(4, 7)  # a changed shape gets a new buffer
    second = stager.stage(state)
    assert second["model"]["w"].data_ptr() == pointer
    assert_same(state, second)
    stager.close()  # the session's end: the buffers are released; a later save allocates again
    assert_same(state, stager.stage(state))


def test_a_non_contiguous_tensor_is_staged_as_its_values():
    base = torch.randn(6, 8)
    state = {"t": base.t(), "s": base[:, ::2]}
    staged = HostCopyStager().stage(state)
    assert torch.equal(staged["t"], base.t()) and torch.equal(staged["s"], base[:, ::2])


def test_only_states_of_plain_tensors_are_staged_here():
    class Sharded(torch.Tensor):
        pass

    assert stages(a_state()) and stages({"p": torch.nn.Parameter(torch.ones(2))})
    assert not stages({"model": {"w": torch.ones(2).as_subclass(Sharded)}})
    assert not stages({"list": [1, (torch.ones(1).as_subclass(Sharded),)]})



def storages(*tensors: torch.Tensor) -> frozenset[int]:
    return frozenset(tensor.untyped_storage().data_ptr() for tensor in tensors)


def test_stable_tensors_are_copied_by_the_staging_thread_and_the_rest_at_once(monkeypatch):
    state = a_state()
    before = {"w": state["model"]["w"].clone(), "rng": state["rng"].clone()}
    momentum = state["optimizer"]["state"][0]["momentum"]
    released, copy_later = threading.Event(), host_staging.copy_later

    def held(pairs, staged, future):
        assert {source.data_ptr() for _, source in pairs} == {state["model"]["w"].data_ptr(),
                                                               momentum.data_ptr()}
        released.wait()
        copy_later(pairs, staged, future)

    monkeypatch.setattr(host_staging, "copy_later", held)
    future = HostCopyStager().stage_deferring(state, storages(state["model"]["w"], momentum))
    assert isinstance(future, Future) and not future.done()
    state["rng"].fill_(0)  # not stable: copied before the call returned
    state["trainer"]["cursor"].append(3)
    released.set()
    staged = future.result()
    state["model"]["w"].add_(1.0)  # the optimizer steps once the copy is done
    assert torch.equal(staged["model"]["w"], before["w"]) and torch.equal(staged["rng"], before["rng"])
    assert torch.equal(staged["optimizer"]["state"][0]["momentum"], momentum)
    assert staged["trainer"] == {"step": 3, "cursor": [1, 2]}


def test_with_nothing_stable_in_the_state_everything_is_copied_at_once():
    state = a_state()
    staged = HostCopyStager().stage_deferring(state, storages(torch.ones(3)))
    assert isinstance(staged, dict)
    assert_same(state, staged)


def test_a_failed_staging_copy_fails_the_future(monkeypatch):
    def failing(buffer, source):
        raise OSError("copy failed")

    monkeypatch.setattr(host_staging, "copy_bytes", failing)
    state = {"w": torch.randn(4, 4)}
    future = HostCopyStager().stage_deferring(state, storages(state["w"]))
    with pytest.raises(OSError, match="copy failed"):
        future.result()
