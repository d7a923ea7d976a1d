"""pilotrun/training/distributed.py with two real gloo ranks on loopback (torch.multiprocessing, spawn).

Each multi-rank test starts two processes that set torchrun's environment variables themselves and call
`init_distributed`, so the code under test is exactly what runs under torchrun. Ranks write their results
with torch.save; the parent compares them. `run_ranks` is imported by the other test_distributed*.py files.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.distributed import TCPStore

from pilotrun.common.errors import CheckpointError, ConfigError
from pilotrun.training import distributed as D
from pilotrun.training.checkpoint.compatibility import reconcile_world_size


def run_on_main_process(context, function, *args):
    """Rank 0 calls `function`, the others get None: how the trainer's writers (run.json, metrics.jsonl) are
    confined to one process, checked here on a real context."""
    return function(*args) if context.is_main_process else None


def agent_store() -> TCPStore:
    """The rendezvous store, hosted by the test process as torchrun's agent hosts it: bound to a port the OS
    picked and held open, so no other process on the machine can take the port between choosing and using it
    (a free-port probe can race with the many tests that run at once)."""
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _rank_entry(rank: int, world_size: int, port: int, function: Callable[..., None], args: tuple) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       # connect to the test's store, as under torchrun
                       "TORCHELASTIC_USE_AGENT_STORE": "True"})
    torch.set_num_threads(1)
    function(rank, *args)


def run_ranks(function: Callable[..., None], *args: Any, world_size: int = 2) -> None:
    """Run `function(rank, *args)` in `world_size` fresh processes with torchrun's environment; an exception
    in any rank fails the caller."""
    store = agent_store()
    mp.start_processes(_rank_entry, args=(world_size, store.port, function, args), nprocs=world_size,
                       join=True, start_method="spawn")
    del store


# ---------------------------------------------------------------------------------------------- one process
def test_without_torchrun_env_is_single_process() -> None:
    context = D.init_distributed("cpu", environ={})
    assert context == D.DistributedContext(device="cpu")
    assert not context.is_distributed and context.is_main_process
    assert run_on_main_process(context, lambda x: x + 1, 41) == 42


def test_world_size_one_under_torchrun_opens_no_group() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    context = D.init_distributed("cpu", environ=env)
    assert context.world_size == 1 and context.backend is None
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("env, fragment", [
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "inconsistent"),
    ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK='x'"),
])
def test_bad_torchrun_env_is_one_clear_error(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        D.init_distributed("cpu", environ=env)


def test_a_fixed_gpu_index_under_torchrun_is_refused() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    with pytest.raises(ConfigError, match=r"train.device=cuda:0 .* every rank on one GPU"):
        D.init_distributed("cuda:0", environ=env)
    assert not torch.distributed.is_initialized()


def test_cuda_requested_without_cuda_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        D.resolve_device("cuda", 0)


def test_single_process_reductions_are_identity_copies() -> None:
    tokens = torch.tensor([[1.0, 2.0]])
    qk = torch.tensor([[3.0, float("nan")]])
    t, q = D.all_reduce_step_statistics(D.SINGLE_PROCESS, tokens, qk)
    assert torch.equal(t, tokens) and t is not tokens
    assert torch.equal(q.nan_to_num(-1), qk.nan_to_num(-1))
    assert D.mean_across_ranks(D.SINGLE_PROCESS, {"loss": 2.5}) == {"loss": 2.5}
    assert D.wrap_model(nn.Linear(2, 2), D.SINGLE_PROCESS).__class__ is nn.Linear


# ---------------------------------------------------------------------------------------------- two ranks
def _collectives_worker(rank: int, out_dir: str) -> None:
    context = D.init_distributed("cpu")
    try:
        assert context.world_size == 2 and context.rank == rank and context.backend == "gloo"
        # rank 0 / rank 1 counts; rank 1 has a NaN max logit in layer 1 head 0, rank 0 an inf in layer 0 head
        # 1
        tokens = torch.tensor([[1.0, 5.0, 0.0], [7.0, 0.0, 2.0]]) * (rank + 1)
        qk = torch.tensor([[1.5, float("inf")], [0.25, -float("inf")]]) if rank == 0 else \
            torch.tensor([[2.5, 3.0], [float("nan"), -float("inf")]])
        big = torch.tensor([2.0**24 - 1.0], dtype=torch.float64) * (rank + 1)
        t, q = D.all_reduce_step_statistics(context, tokens, qk)
        packed = D.all_reduce_packed(
            context, {"big": big, "ints": torch.tensor([rank, 10], dtype=torch.int64)}, "sum"
        )
        mean = D.mean_across_ranks(context, {"loss": 1.0 + rank, "other": 4.0 * rank})
        anyflag = D.any_across_ranks(context, rank == 1)
        noneflag = D.any_across_ranks(context, False)
        chosen = D.broadcast_object(context, {"run_id": f"from-rank-{rank}"})
        D.check_same_on_all_ranks(context, "config hash", "abc")
        try:
            D.check_same_on_all_ranks(context, "data identity", f"sha-{rank}")
            disagreement = ""
        except ConfigError as exc:
            disagreement = str(exc)
        written = run_on_main_process(context, lambda: "wrote")
        torch.manual_seed(0)
        replica = D.wrap_model(nn.Linear(3, 2), context, "ddp")
        checked = D.check_replicas_identical(context, replica)
        if rank == 1:  # one ulp on one element of one rank: the smallest possible drift
            with torch.no_grad():
                weight = D.unwrap_model(replica).weight
                weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
        try:
            D.check_replicas_identical(context, replica)
            drift = ""
        except D.ReplicasDivergedError as exc:
            drift = str(exc)
        D.check_same_run_on_all_ranks(context, {"train": {"seq_len": 32}}, "sha-data")
        same_run = []
        for recipe, data in (
            ({"train": {"seq_len": 32}}, f"sha-{rank}"),
            ({"train": {"seq_len": 32 + rank}}, "d"),
        ):
            try:
                D.check_same_run_on_all_ranks(context, recipe, data)
                same_run.append("")
            except ConfigError as exc:
                same_run.append(str(exc))
        torch.save(
            {
                "same_run": same_run,
                "tokens": t,
                "qk": q,
                "inputs_unchanged": torch.equal(tokens[0], torch.tensor([1.0, 5.0, 0.0]) * (rank + 1)),
                "packed": packed,
                "mean": mean,
                "any": anyflag,
                "none": noneflag,
                "chosen": chosen,
                "disagreement": disagreement,
                "written": written,
                "checked": checked,
                "drift": drift,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        D.shutdown_distributed(context)


@pytest.mark.slow
def test_two_ranks_agree_on_step_statistics(tmp_path: Path) -> None:
    run_ranks(_collectives_worker, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert torch.equal(r0["tokens"], torch.tensor([[3.0, 15.0, 0.0], [21.0, 0.0, 6.0]]))
    assert r0["tokens"].dtype == torch.float32
    expected_qk = torch.tensor([[2.5, float("inf")], [float("nan"), -float("inf")]])
    assert torch.equal(r0["qk"].isnan(), expected_qk.isnan())
    assert torch.equal(r0["qk"].nan_to_num(nan=7.0), expected_qk.nan_to_num(nan=7.0))
    for key in ("tokens", "qk"):  # bit-identical on both ranks, NaN positions included
        assert torch.equal(r0[key].view(torch.int32), r1[key].view(torch.int32))
    assert r0["packed"]["big"].item() == 3 * (2.0**24 - 1.0)  # exact beyond fp32's integer range
    assert torch.equal(r0["packed"]["ints"], torch.tensor([1, 20]))
    assert r0["mean"] == r1["mean"] == {"loss": 1.5, "other": 2.0}
    assert r0["any"] is True and r1["any"] is True and r0["none"] is False and r1["none"] is False
    assert r0["chosen"] == r1["chosen"] == {"run_id": "from-rank-0"}
    assert "data identity" in r0["disagreement"] and "rank 1: 'sha-1'" in r1["disagreement"]
    assert r0["inputs_unchanged"] and r1["inputs_unchanged"]
    assert r0["written"] == "wrote" and r1["written"] is None
    assert r0["checked"] == r1["checked"] == 2  # weight and bias
    for result in (r0, r1):  # another data folder or recipe on one rank: refused on every rank
        data_message, recipe_message = result["same_run"]
        assert "metadata_sha256" in data_message and "rank 1: 'sha-1'" in data_message
        assert recipe_message.startswith("ranks disagree on the recipe")
    assert r0["drift"] == r1["drift"] != "" and "'weight' on rank 1" in r0["drift"]


class _CountingModel(nn.Module):
    """Two blocks in `layers` (FSDP2 shards per block) and a non-persistent buffer that accumulates a per-rank
    statistic across forwards, as the MoE token counts do."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 8), nn.Linear(8, 3)])
        self.register_buffer("input_sum", torch.zeros((), dtype=torch.float64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.input_sum += x.detach().double().sum()
        return self.layers[1](torch.tanh(self.layers[0](x)))


def _global_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(123)
    return [torch.randn(4, 6, generator=generator) for _ in range(3)]  # 3 microbatches of 4 global rows


def _train_two_steps(
    model: nn.Module, batches_for_this_rank: list[torch.Tensor], sync_last_only: bool
) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for i, x in enumerate(batches_for_this_rank):
            with D.gradient_sync(model, sync=(i == len(batches_for_this_rank) - 1) or not sync_last_only):
                (model(x).square().mean() / len(batches_for_this_rank)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _wrap_worker(rank: int, out_dir: str, parallelism: str) -> None:
    context = D.init_distributed("cpu")
    try:
        torch.manual_seed(0)
        base = _CountingModel()
        model = D.wrap_model(base, context, parallelism)
        assert D.unwrap_model(model) is base
        assert D.is_fully_sharded(model) == (parallelism == "fsdp")
        shard = [x[rank * 2:(rank + 1) * 2] for x in _global_batches()]  # each rank: its 2 of the 4 rows
        _train_two_steps(model, shard, sync_last_only=True)
        if parallelism == "fsdp":
            weights = {k: v.full_tensor() for k, v in base.state_dict().items()}
        else:
            weights = {k: v.clone() for k, v in base.state_dict().items()}
        torch.save(
            {"weights": weights, "input_sum": base.input_sum.clone()}, Path(out_dir) / f"rank{rank}.pt"
        )
    finally:
        D.shutdown_distributed(context)


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_wrapped_two_rank_training_matches_one_process(tmp_path: Path, parallelism: str) -> None:
    """Two ranks with 2 rows each vs one process with all 4 rows: the same updates up to the order of the
    gradient reduction (tolerance 1e-6 relative: two fp32 adds, not identical), with bit-identical replicas;
    each rank's statistic buffer sums only its own rows (DDP must not broadcast buffers)."""
    run_ranks(_wrap_worker, str(tmp_path), parallelism)
    torch.manual_seed(0)
    reference = _CountingModel()
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    _train_two_steps(reference, _global_batches(), sync_last_only=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for name, expected in reference.state_dict().items():
        assert torch.equal(r0["weights"][name], r1["weights"][name]), name
        torch.testing.assert_close(r0["weights"][name], expected, rtol=1e-6, atol=1e-7)
        assert not torch.equal(expected, initial[name])  # it trained: the comparison is not vacuous
    for rank, result in enumerate((r0, r1)):  # each rank's own rows, seen in each of the 2 steps
        own_rows = sum(x[rank * 2:(rank + 1) * 2].double().sum() for x in _global_batches())
        assert result["input_sum"].item() == pytest.approx(2 * own_rows.item(), rel=1e-12)
    assert r0["input_sum"].item() != r1["input_sum"].item()


def test_wrap_model_rejects_unknown_parallelism() -> None:
    with pytest.raises(ConfigError, match="ddp or fsdp"):
        D.wrap_model(nn.Linear(1, 1), D.SINGLE_PROCESS, "tp")


def test_fsdp_with_fp16_is_refused_with_the_reason() -> None:
    two_ranks = D.DistributedContext(rank=0, world_size=2, backend="gloo")
    with pytest.raises(ConfigError, match="gradient shard"):
        D.wrap_model(nn.Linear(1, 1), two_ranks, "fsdp", precision="fp16")


# ---------------------------------------------------------------------------------------------- world-size
# change
def _meta(world_size: int, batch_size: int) -> dict:
    return {"world_size": world_size, "recipe": {"train": {"batch_size": batch_size, "seq_len": 32},
                                                 "model": {"d_model": 64}}}


def test_same_world_size_needs_no_reconciliation() -> None:
    saved = _meta(2, 4)
    assert reconcile_world_size(saved, _meta(2, 4), []) == (saved, [])


def test_world_size_change_is_refused_with_the_way_to_continue() -> None:
    with pytest.raises(CheckpointError, match=r"written by 2 rank\(s\), this run has 1.*train.batch_size=8.*"
                                              r"--allow-change world_size"):
        reconcile_world_size(_meta(2, 4), _meta(1, 4), [])
    with pytest.raises(CheckpointError, match="cannot be split evenly over 3 ranks"):
        reconcile_world_size(_meta(2, 4), _meta(3, 4), [])


def test_allowed_world_size_change_must_keep_the_global_batch() -> None:
    with pytest.raises(CheckpointError, match=r"global batch is 4 x 2 = 8 sequences.*batch_size=8"):
        reconcile_world_size(_meta(2, 4), _meta(1, 4), ["world_size"])
    saved = _meta(2, 4)
    adjusted, notes = reconcile_world_size(saved, _meta(1, 8), ["world_size"])
    assert adjusted["recipe"]["train"] == {"batch_size": 8, "seq_len": 32}
    assert saved["recipe"]["train"]["batch_size"] == 4  # the caller's meta is not modified
    assert adjusted["world_size"] == 2  # the world-size difference itself stays for the compatibility check
    assert len(notes) == 1 and "2 -> 1" in notes[0] and "not bit-identical" in notes[0]



def test_under_torchrun_s_agent_each_restart_of_the_group_has_its_own_keys():
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=30)
    assert D.restart_store({}, 2, timeout) is None
    assert D.restart_store({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "1"}, 2,
                           timeout) is None
    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)  # the agent's one store
    environ = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(agent.port),
    }
    first = D.restart_store({**environ, "TORCHELASTIC_RESTART_COUNT": "0"}, 2, timeout)
    second = D.restart_store({**environ, "TORCHELASTIC_RESTART_COUNT": "1"}, 2, timeout)
    first.set("rank_0", "address of the group that died")
    second.set("rank_0", "address of the restarted group")
    assert second.get("rank_0") == b"address of the restarted group"
    assert dist.PrefixStore("pilotrun/restart-0", agent).get("rank_0") == b"address of the group that died"
