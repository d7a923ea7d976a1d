"""Muon + AdamW, global-norm clipping and QK-Clip under data parallelism: two real gloo ranks (DDP, and FSDP2
where every parameter is a row-sharded DTensor) against one process that sees the whole batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from pilotrun.config import ModelConfig, OptimConfig
from pilotrun.model.diagnostics import collect_step_statistics, reset_step_statistics
from pilotrun.model.transformer import build_model
from pilotrun.optim.muon_adamw import build_optimizer
from pilotrun.optim.qk_clip import apply_qk_clip
from pilotrun.training import distributed as D
from pilotrun.training.precision import apply_update, build_grad_scaler
from tests.training.test_distributed import run_ranks

STEPS = 3
TAU = 1.5  # init_std 0.1 gives max logits of about 1.2-1.7: some heads clip, some do not
GRAD_CLIP = 0.05  # small enough that clipping acts
PARALLELISMS = ("ddp", "fsdp")


def _global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(100 + step))


def _train(model, rows: slice, context, distribute_newton_schulz: bool = False) -> dict:
    from pilotrun.optim import muon_adamw

    optimizer = build_optimizer(model, OptimConfig())
    if distribute_newton_schulz:
        optimizer.distribute_orthogonalization(context.rank, context.world_size)
    calls = []
    original = muon_adamw.newton_schulz_orthogonalize
    muon_adamw.newton_schulz_orthogonalize = lambda *args: calls.append(1) or original(*args)
    scaler = build_grad_scaler("fp32", "cpu")
    raw = D.unwrap_model(model)
    record = {"clipped": [], "grad_norm": [], "was_clipped": []}
    model.train()
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        reset_step_statistics(raw)
        tokens = _global_batch(step)[rows]
        model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
        tokens_per_expert, qk_max_logit = collect_step_statistics(raw)
        if context is not None:
            tokens_per_expert, qk_max_logit = D.all_reduce_step_statistics(
                context, tokens_per_expert, qk_max_logit
            )
        outcome = apply_update(model, optimizer, scaler, GRAD_CLIP)
        assert outcome.applied
        record["grad_norm"].append(outcome.grad_norm)
        record["was_clipped"].append(outcome.clipped)
        record["clipped"].append(apply_qk_clip(raw, qk_max_logit, TAU).clipped)
    weights = {}
    for name, value in raw.state_dict().items():
        weights[name] = value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
    record["weights"] = weights
    record["newton_schulz_calls"] = len(calls)
    muon_adamw.newton_schulz_orthogonalize = original
    return record


def _worker(rank: int, out_dir: str) -> None:
    context = D.init_distributed("cpu")
    try:
        for parallelism in PARALLELISMS:  # one pair of processes for both: spawning is the slow part
            torch.manual_seed(0)
            model = D.wrap_model(build_model(ModelConfig(vocab_size=256, init_std=0.1)), context, parallelism)
            # FSDP2 really hands the optimizer and QK-Clip row-sharded DTensors (the path under test)
            assert all(isinstance(p, DTensor) == (parallelism == "fsdp") for p in model.parameters())
            record = _train(model, slice(2 * rank, 2 * rank + 2), context)
            torch.save(record, Path(out_dir) / f"{parallelism}-rank{rank}.pt")
        # DDP with Newton-Schulz shared out across the ranks (MuonAdamW.distribute_orthogonalization)
        torch.manual_seed(0)
        model = D.wrap_model(build_model(ModelConfig(vocab_size=256, init_std=0.1)), context, "ddp")
        record = _train(model, slice(2 * rank, 2 * rank + 2), context, distribute_newton_schulz=True)
        torch.save(record, Path(out_dir) / f"ddp_shared_ns-rank{rank}.pt")
    finally:
        D.shutdown_distributed(context)


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path: Path) -> None:
    run_ranks(_worker, str(tmp_path))
    torch.manual_seed(0)
    reference_model = build_model(ModelConfig(vocab_size=256, init_std=0.1))
    initial = {k: v.clone() for k, v in reference_model.state_dict().items()}
    reference = _train(reference_model, slice(0, 4), None)
    assert all(reference["was_clipped"])
    assert any(bool(c.any()) for c in reference["clipped"]) and not all(
        bool(c.all()) for c in reference["clipped"]
    )
    for parallelism in PARALLELISMS:
        ranks = [torch.load(tmp_path / f"{parallelism}-rank{r}.pt", weights_only=False) for r in (0, 1)]
        for record in ranks:
            assert record["was_clipped"] == reference["was_clipped"]
            assert [torch.equal(a, b) for a, b in zip(record["clipped"], reference["clipped"])] == [
                True
            ] * STEPS
            assert record["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
        for name, expected in reference["weights"].items():
            # replicas agree bit for bit; against one process only up to the gradient reduction's summation
            # order
            assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), (parallelism, name)
            torch.testing.assert_close(ranks[0]["weights"][name], expected, rtol=1e-4, atol=1e-6,
                                       msg=f"{parallelism} {name}")
            if name.endswith("weight") or ".experts." in name:
                assert not torch.equal(expected, initial[name]), name  # it trained: not a vacuous comparison
    # Shared-out Newton-Schulz: each rank orthogonalized only part of the matrices, and the result is the
    # replicated DDP update bit for bit.
    shared = [torch.load(tmp_path / f"ddp_shared_ns-rank{r}.pt", weights_only=False) for r in (0, 1)]
    replicated = [torch.load(tmp_path / f"ddp-rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert sum(record["newton_schulz_calls"] for record in shared) == replicated[0]["newton_schulz_calls"]
    assert all(0 < record["newton_schulz_calls"] < replicated[0]["newton_schulz_calls"] for record in shared)
    for rank in (0, 1):
        for name, expected in replicated[0]["weights"].items():
            assert torch.equal(shared[rank]["weights"][name], expected), (rank, name)
