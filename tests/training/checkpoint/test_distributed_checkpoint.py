"""pilotrun/training/checkpoint/dcp_storage.py: collective DCP checkpoints on two gloo ranks, committed by the
marker rule."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from pilotrun.common.errors import CheckpointError
from pilotrun.run.marker import MARKER_NAME
from pilotrun.training import distributed as D
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.checkpoint.dcp_storage import load_model_and_optimizer_state, model_and_optimizer_state
from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer
from pilotrun.training.checkpoint.rng_state import capture_rng_state
from tests.training.test_distributed import _rank_entry, agent_store, run_ranks

# Every test here runs ranks as processes (a module fixture writes the two-rank checkpoint).
pytestmark = pytest.mark.slow


def _state_for_rank(rank: int, step: int) -> dict:
    torch.manual_seed(1000 + rank)  # per-rank generator positions, as after a few steps of dropout-like draws
    torch.rand(step)
    return {
        "model": {"w": torch.arange(12.0).reshape(3, 4) * step, "b": torch.full((4,), float(step))},
        "trainer": {"step": step, "tokens_seen": 512 * step, "loader": {"train": {"batch_index": 3 * step}}},
        "rng": capture_rng_state(),
    }


def _template() -> dict:
    return {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)},
            "trainer": {"step": -1, "tokens_seen": -1, "loader": {"train": {"batch_index": -1}}},
            "rng": capture_rng_state()}


def _save_load_worker(rank: int, root: str) -> None:
    """One spawn for several checks (process start-up dominates these tests): save and load a sharded
    checkpoint, read a single-process one, and refuse a damaged copy of the sharded one."""
    context = D.init_distributed("cpu")
    run_dir = Path(root) / "sharded"
    try:
        checkpointer = DistributedCheckpointer(run_dir, keep=2, context=context)
        for step in (1, 2, 3):
            checkpointer.save(step, _state_for_rank(rank, step), {"world_size": 2, "step": step})
        expected = _state_for_rank(rank, 3)
        torch.manual_seed(7)  # move the generator away, so the restored state is really restored
        state, meta = checkpointer.load(template=_template())
        state_no_template, _ = checkpointer.load(step=2)
        torch.save(
            {
                "state": state,
                "expected": expected,
                "meta": meta,
                "steps": checkpointer.committed_steps(),
                "no_template": state_no_template,
            },
            run_dir / f"result{rank}.pt",
        )

        single, _ = DistributedCheckpointer(Path(root) / "single", keep=2, context=context).load(
            template=_template()
        )
        torch.save(single, Path(root) / f"single_read{rank}.pt")

        damaged = Path(root) / "damaged"
        if rank == 0:
            shutil.copytree(run_dir, damaged)
            shard = damaged / "checkpoints" / "step-00000003" / "__1_0.distcp"
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        D.barrier(context)
        try:
            DistributedCheckpointer(damaged, keep=2, context=context).load(step=3, template=_template())
            message = ""
        except CheckpointError as exc:
            message = str(exc)
        (Path(root) / f"damaged_error{rank}.txt").write_text(message)

        # A crafted .metadata (its hash right in the marker) whose unpickling would create a file.
        crafted = Path(root) / "crafted"
        if rank == 0:
            shutil.copytree(run_dir, crafted)
            _plant_metadata_payload(crafted / "checkpoints" / "step-00000003", Path(root) / "payload-ran")
        D.barrier(context)
        try:
            DistributedCheckpointer(crafted, keep=2, context=context).load(step=3, template=_template())
            message = ""
        except CheckpointError as exc:
            message = str(exc)
        (Path(root) / f"crafted_error{rank}.txt").write_text(message)
    finally:
        D.shutdown_distributed(context)


class _TouchOnLoad:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (Path.touch, (Path(self.target),))


def _plant_metadata_payload(step_dir: Path, target: Path) -> None:
    payload = pickle.dumps(_TouchOnLoad(target))
    (step_dir / ".metadata").write_bytes(payload)
    marker = json.loads((step_dir / MARKER_NAME).read_text())
    marker["files"][".metadata"] = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}
    (step_dir / MARKER_NAME).write_text(json.dumps(marker))


@pytest.fixture(scope="module")
def two_rank_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("two_rank_run")
    single = DistributedCheckpointer(root / "single", keep=2)  # written by one process, read by two ranks
    assert isinstance(single.storage, type(single.torch_save_storage))
    single.save(4, _state_for_rank(0, 4), {"world_size": 1})
    run_ranks(_save_load_worker, str(root))
    return root


@pytest.fixture
def two_rank_copy(two_rank_root: Path, tmp_path: Path) -> Path:
    """The 2-rank run that saved steps 1, 2, 3 (keep=2) and loaded them back; a copy per test."""
    shutil.copytree(two_rank_root / "sharded", tmp_path / "run")
    return tmp_path / "run"


def test_two_ranks_save_sharded_commit_once_and_load_their_own_rng(two_rank_copy: Path) -> None:
    tmp_path = two_rank_copy
    results = [torch.load(tmp_path / f"result{r}.pt", weights_only=False) for r in (0, 1)]
    folder = tmp_path / "checkpoints" / "step-00000003"
    names = sorted(p.name for p in folder.iterdir())
    assert names == [".metadata", MARKER_NAME, "__0_0.distcp", "__1_0.distcp"]
    assert Checkpointer(tmp_path, keep=2).committed_steps() == [2, 3]  # keep=2 pruned step 1
    marker = Checkpointer(tmp_path, keep=2).verify(3).marker  # every file's hash checks out
    assert marker["storage"] == "torch_dcp" and sorted(marker["files"]) == [".metadata", "__0_0.distcp",
                                                                             "__1_0.distcp"]
    for rank, result in enumerate(results):
        assert result["steps"] == [2, 3] and result["meta"] == {"world_size": 2, "step": 3}
        assert result["state"]["trainer"] == {
            "step": 3,
            "tokens_seen": 1536,
            "loader": {"train": {"batch_index": 9}},
        }
        for key in ("w", "b"):
            assert torch.equal(result["state"]["model"][key], result["expected"]["model"][key])
        assert torch.equal(result["state"]["rng"]["torch_cpu"], result["expected"]["rng"]["torch_cpu"])
        assert result["state"]["rng"]["numpy"]["pos"] == result["expected"]["rng"]["numpy"]["pos"]
        assert torch.equal(result["no_template"]["model"]["w"], torch.arange(12.0).reshape(3, 4) * 2)
        assert torch.equal(
            result["no_template"]["rng"]["torch_cpu"], _state_for_rank(rank, 2)["rng"]["torch_cpu"]
        )
    assert not torch.equal(results[0]["state"]["rng"]["torch_cpu"], results[1]["state"]["rng"]["torch_cpu"])


def test_one_process_reads_a_two_rank_checkpoint_with_rank0_rng(two_rank_copy: Path) -> None:
    checkpointer = DistributedCheckpointer(two_rank_copy, keep=2)
    state, meta = checkpointer.load(template=_template())
    assert meta["step"] == 3 and state["trainer"]["step"] == 3
    assert torch.equal(state["model"]["w"], torch.arange(12.0).reshape(3, 4) * 3)
    assert torch.equal(state["rng"]["torch_cpu"], _state_for_rank(0, 3)["rng"]["torch_cpu"])


def test_two_ranks_read_a_single_process_checkpoint(two_rank_root: Path) -> None:
    for rank in (0, 1):
        state = torch.load(two_rank_root / f"single_read{rank}.pt", weights_only=False)
        assert torch.equal(state["model"]["w"], torch.arange(12.0).reshape(3, 4) * 4)
        assert state["trainer"]["step"] == 4


def test_a_damaged_shard_is_refused_on_every_rank(two_rank_root: Path) -> None:
    for rank in (0, 1):
        message = (two_rank_root / f"damaged_error{rank}.txt").read_text()
        assert "__1_0.distcp" in message and "sha256" in message and "--from-step 2" in message


def test_a_crafted_metadata_pickle_is_refused_on_every_rank_without_running(two_rank_root: Path) -> None:
    assert not (two_rank_root / "payload-ran").exists()
    for rank in (0, 1):
        message = (two_rank_root / f"crafted_error{rank}.txt").read_text()
        assert ".metadata" in message and "refused" in message, message


def _slow_second_save_worker(rank: int, run_dir: str) -> None:
    context = D.init_distributed("cpu")
    checkpointer = DistributedCheckpointer(run_dir, keep=3, context=context)
    checkpointer.save(1, _state_for_rank(rank, 1), {"step": 1})
    from tests.training.checkpoint.checkpoint_faults import delay_each_file

    delay_each_file(60)  # the next save stops after its shards are written, before the commit
    checkpointer.save(2, _state_for_rank(rank, 2), {"step": 2})


def test_ranks_killed_during_a_save_leave_no_committed_checkpoint(tmp_path: Path) -> None:
    store = agent_store()
    context = mp.start_processes(
        _rank_entry,
        args=(2, store.port, _slow_second_save_worker, (str(tmp_path),)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    root = tmp_path / "checkpoints"
    deadline = time.time() + 300  # a hang guard only: two spawned ranks import torch and open gloo first
    try:
        while time.time() < deadline:  # wait until the second save has written its shards into a temp folder
            temps = [p for p in root.glob(".tmp-step-00000002-*") if (p / ".metadata").is_file()]
            if temps:
                break
            time.sleep(0.1)
        assert temps, "the second save never reached its temp folder"
        time.sleep(0.5)
    finally:
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
        for process in context.processes:
            process.join(10)
    checkpointer = DistributedCheckpointer(tmp_path, keep=3)
    assert checkpointer.committed_steps() == [1]
    assert [p.name for p in checkpointer.uncommitted_folders()] == [temps[0].name]
    state, meta = checkpointer.load(template=_template())
    assert meta == {"step": 1} and state["trainer"]["step"] == 1
    checkpointer.save(5, _state_for_rank(0, 5), {"step": 5})  # the next save clears the leftover
    assert checkpointer.uncommitted_folders() == [] and checkpointer.committed_steps() == [1, 5]


# ---------------------------------------------------------------------------------------------- model +
# optimizer
class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.tanh(self.layers[0](x)))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))[rank * 2:rank * 2 + 2]
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _exact_resume_worker(rank: int, run_dir: str) -> None:
    context = D.init_distributed("cpu")
    try:
        for parallelism in ("ddp", "fsdp"):
            def build() -> tuple[nn.Module, torch.optim.Optimizer]:
                torch.manual_seed(0)
                model = D.wrap_model(_Blocks(), context, parallelism)  # noqa: B023 (called inside the loop)
                return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

            model, optimizer = build()
            uninterrupted = _train(model, optimizer, rank, range(6))
            model, optimizer = build()
            first = _train(model, optimizer, rank, range(3))
            model_state, optimizer_state = model_and_optimizer_state(model, optimizer)
            checkpointer = DistributedCheckpointer(Path(run_dir) / parallelism, keep=1, context=context)
            checkpointer.save(3, {"model": model_state, "optimizer": optimizer_state}, {})
            model, optimizer = build()  # a fresh process would start from here
            model_template, optimizer_template = model_and_optimizer_state(model, optimizer)
            state, _ = checkpointer.load(template={"model": model_template, "optimizer": optimizer_template})
            load_model_and_optimizer_state(model, optimizer, state["model"], state["optimizer"])
            resumed = first + _train(model, optimizer, rank, range(3, 6))
            (Path(run_dir) / f"{parallelism}_losses{rank}.txt").write_text(
                f"{uninterrupted!r}\n{resumed!r}\n"
            )
    finally:
        D.shutdown_distributed(context)


def test_model_and_optimizer_resume_through_dcp_bit_for_bit(tmp_path: Path) -> None:
    """DDP (replicated tensors, written once) and FSDP2 (DTensor shards, written by their owners): 3 steps,
    save, rebuild, load, 3 more steps give the same losses as 6 uninterrupted steps, bit for bit."""
    run_ranks(_exact_resume_worker, str(tmp_path))
    for parallelism in ("ddp", "fsdp"):
        for rank in (0, 1):
            uninterrupted, resumed = (tmp_path / f"{parallelism}_losses{rank}.txt").read_text().splitlines()
            assert uninterrupted == resumed  # the repr of every float: bit for bit
            assert len(set(eval(uninterrupted))) == 6  # it trained: six different losses
        assert (tmp_path / "fsdp" / "checkpoints" / "step-00000003" / "COMMITTED.json").is_file()
