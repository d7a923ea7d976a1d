"""Optimizer step time: Muon + AdamW against AdamW-only on the same CPU model, and Newton-Schulz's share.

Model: the "cpu" preset (the stability recipe's geometry) at a 4096-token vocabulary. Gradients come from one
real forward/backward of an 8 x 64 batch (the stability recipe's microbatch) and are kept fixed while each
optimizer steps repeatedly; the median of the timed repeats (CPU time of one torch thread) is reported. In the
same run the forward + backward time is measured, so the step can be put in proportion to a whole update.

Newton-Schulz's share is timed inside the real Muon+AdamW step (the module's NS function is wrapped with a
clock), and compared with a FLOP model: per matrix [A, B] (A <= B), 5 iterations of X X^T, Y Y and (.) X cost
5 (4 A^2 B + 2 A^3) flops, against roughly 6 * weights * tokens for forward + backward of that matrix. The
ratio grows as min(A, B) / tokens per update, which is why Muon is cheap at real batch sizes and not at a
CPU pilot's 512 tokens.
"""

from __future__ import annotations

import statistics
import time

import torch

import pilotrun.optim.muon_adamw as muon_module
from pilotrun.config import OptimConfig
from pilotrun.model.accounting import flops_per_token
from pilotrun.model.presets import model_preset
from pilotrun.model.transformer import build_model
from pilotrun.optim.muon_adamw import MuonAdamW, build_optimizer

VOCAB = 4096
BATCH, SEQ = 8, 64
LONG_SEQ = 512
REPEATS = 10
WARMUP = 2
# Target: Newton-Schulz is nothing but matmuls, so an implementation without waste should run it at a FLOP rate
# no lower than the model's own forward+backward (a mixed workload of matmuls, norms, routing and softmax) on
# the same thread. Its absolute share of the step is a property of the shapes and the batch (FLOP model above),
# not of the implementation, and is reported, not targeted.
TARGET_NS_RATE_OVER_FWD_BWD_RATE = 1.0

# CPU time of this thread, one torch thread: the CPU cores are shared with other jobs, and CPU time stays
# meaningful under contention where wall time does not.
clock = time.thread_time


def _model_with_grads(seed: int = 0):
    torch.manual_seed(seed)
    cfg = model_preset("cpu", vocab_size=VOCAB, init_std=0.02)
    model = build_model(cfg)
    model.train()
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    output = model(tokens[:, :-1], tokens[:, 1:])
    output.loss.backward()
    return model, cfg, tokens


def _median_seconds(fn, repeats: int = REPEATS) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def _ns_flops(optimizer) -> tuple[float, float]:
    """(NS flops per Muon step, forward+backward flops of the same matrices at BATCH*SEQ tokens)."""
    ns_flops = fwd_bwd = 0.0
    tokens = BATCH * SEQ
    for group in optimizer.param_groups:
        if not group["use_muon"]:
            continue
        for p in group["params"]:
            slices = p.size(0) if p.ndim == 3 else 1
            a, b = sorted((p.size(-2), p.size(-1)))
            ns_flops += slices * 5 * (4 * a * a * b + 2 * a**3)
            # routed experts see tokens * top_k / E tokens each on average
            seen = tokens * 2 / p.size(0) if p.ndim == 3 else tokens
            fwd_bwd += 6 * slices * a * b * seen
    return ns_flops, fwd_bwd


def run() -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure()
    finally:
        torch.set_num_threads(threads)


def _measure() -> str:
    model, cfg, tokens = _model_with_grads()

    def forward_backward():
        model.zero_grad(set_to_none=False)
        model(tokens[:, :-1], tokens[:, 1:]).loss.backward()

    fwd_bwd_seconds = _median_seconds(forward_backward, repeats=5)

    # The same model on 8x longer rows: the step's cost is fixed, forward+backward grows with the tokens.
    long_tokens = torch.randint(0, VOCAB, (BATCH, LONG_SEQ + 1), generator=torch.Generator().manual_seed(1))

    def forward_backward_long():
        model.zero_grad(set_to_none=False)
        model(long_tokens[:, :-1], long_tokens[:, 1:]).loss.backward()

    fwd_bwd_long_seconds = _median_seconds(forward_backward_long, repeats=3)
    model.zero_grad(set_to_none=False)
    forward_backward()  # the optimizers below step with the 8x64 batch's gradients

    muon_adamw = build_optimizer(model, OptimConfig())
    muon_seconds = _median_seconds(muon_adamw.step)

    # Newton-Schulz inside the real step: wrap the module's function with the same clock.
    ns_clock = {"seconds": 0.0, "calls": 0}
    original = muon_module.newton_schulz_orthogonalize

    def timed_ns(*args, **kwargs):
        start = clock()
        out = original(*args, **kwargs)
        ns_clock["seconds"] += clock() - start
        ns_clock["calls"] += 1
        return out

    muon_module.newton_schulz_orthogonalize = timed_ns
    try:
        steps = REPEATS
        start = clock()
        for _ in range(steps):
            muon_adamw.step()
        wrapped_step_seconds = (clock() - start) / steps
    finally:
        muon_module.newton_schulz_orthogonalize = original
    ns_seconds = ns_clock["seconds"] / steps
    ns_share = ns_seconds / wrapped_step_seconds

    all_params = [p for p in model.parameters() if p.requires_grad]
    torch_adamw = torch.optim.AdamW(all_params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    torch_adamw_seconds = _median_seconds(torch_adamw.step)
    torch_adamw_foreach = torch.optim.AdamW(all_params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    torch_adamw_foreach_seconds = _median_seconds(torch_adamw_foreach.step)
    ours_adamw_only = MuonAdamW([{"params": all_params, "use_muon": False, "lr": 3e-3, "weight_decay": 0.1}])
    ours_adamw_only_seconds = _median_seconds(ours_adamw_only.step)

    ns_flops, muon_fwd_bwd_flops = _ns_flops(muon_adamw)
    model_fwd_bwd_flops = flops_per_token(cfg, SEQ) * BATCH * SEQ
    ns_rate = ns_flops / ns_seconds
    fwd_bwd_rate = model_fwd_bwd_flops / fwd_bwd_seconds
    n_muon = sum(p.numel() for g in muon_adamw.param_groups if g["use_muon"] for p in g["params"])
    n_total = sum(p.numel() for p in all_params)
    met = ns_rate / fwd_bwd_rate >= TARGET_NS_RATE_OVER_FWD_BWD_RATE

    ms = 1e3
    lines = [
        "## Optimizer step: Muon + AdamW vs AdamW-only (cpu preset)",
        "",
        f"Model: `cpu` preset at vocab {VOCAB}, {n_total:,} weights ({n_muon:,} in Muon groups, the stacked experts"
        f" orthogonalised per expert slice). Gradients from one forward/backward of a {BATCH}x{SEQ} batch (the"
        f" stability recipe's microbatch), held fixed. Times are CPU seconds of one torch thread"
        f" (`time.thread_time`; robust to other jobs on the machine), median of {REPEATS} steps after {WARMUP}"
        " warm-up steps.",
        "",
        "| measurement | CPU ms per step | vs torch AdamW (default) |",
        "|---|---:|---:|",
        f"| Muon + AdamW (pilotrun MuonAdamW, real partition) | {muon_seconds * ms:.1f} |"
        f" {muon_seconds / torch_adamw_seconds:.2f}x |",
        f"| of which Newton-Schulz ({ns_clock['calls'] // steps} calls per step) | {ns_seconds * ms:.1f} |"
        f" {ns_share:.0%} of the same steps ({wrapped_step_seconds * ms:.1f} ms mean, timed in a separate run of"
        f" {steps} with Newton-Schulz instrumented; the row above is the median of uninstrumented steps) |",
        f"| AdamW-only, torch.optim.AdamW (CPU default: single-tensor) | {torch_adamw_seconds * ms:.1f} | 1.00x |",
        f"| AdamW-only, torch.optim.AdamW(foreach=True) | {torch_adamw_foreach_seconds * ms:.1f} |"
        f" {torch_adamw_foreach_seconds / torch_adamw_seconds:.2f}x |",
        f"| AdamW-only, pilotrun MuonAdamW with one AdamW group | {ours_adamw_only_seconds * ms:.1f} |"
        f" {ours_adamw_only_seconds / torch_adamw_seconds:.2f}x |",
        f"| forward + backward of the same {BATCH}x{SEQ} batch (for scale) | {fwd_bwd_seconds * ms:.1f} |"
        f" {fwd_bwd_seconds / torch_adamw_seconds:.2f}x |",
        f"| forward + backward of a {BATCH}x{LONG_SEQ} batch | {fwd_bwd_long_seconds * ms:.1f} |"
        f" {fwd_bwd_long_seconds / torch_adamw_seconds:.2f}x |",
        "",
        f"Muon + AdamW step / forward+backward: {muon_seconds / fwd_bwd_seconds:.2f} at {BATCH * SEQ} tokens per"
        f" update, {muon_seconds / fwd_bwd_long_seconds:.2f} at {BATCH * LONG_SEQ} tokens (the step does not depend"
        " on the tokens; this is a single-microbatch update, without gradient accumulation).",
        "",
        f"FLOP model: Newton-Schulz does {ns_flops / 1e9:.2f} GFLOP per step, forward+backward of the Muon"
        f" matrices about {muon_fwd_bwd_flops / 1e9:.2f} GFLOP at {BATCH * SEQ} tokens (ratio"
        f" {ns_flops / muon_fwd_bwd_flops:.2f}). NS cost is fixed per update while forward+backward grows with"
        " the tokens per update, so for these shapes the same model gives"
        f" {ns_flops / (muon_fwd_bwd_flops * 262144 / (BATCH * SEQ)):.2%} at 262,144 tokens per update"
        " (128 x 2048): Muon's overhead is a small-batch cost.",
        "",
        f"Achieved rates on this thread: Newton-Schulz {ns_rate / 1e9:.1f} GFLOP/s, the model's forward+backward"
        f" {fwd_bwd_rate / 1e9:.1f} GFLOP/s ({model_fwd_bwd_flops / 1e9:.2f} GFLOP by"
        " `accounting.flops_per_token`).",
        "",
        f"Target: Newton-Schulz runs at >= {TARGET_NS_RATE_OVER_FWD_BWD_RATE:.1f}x the forward+backward FLOP rate"
        f" (no waste around its matmuls). Measured {ns_rate / fwd_bwd_rate:.2f}x: {'met' if met else 'NOT met'}.",
        "",
        "Command: `python -m benchmarks.run_all bench_optim`",
    ]
    return "\n".join(lines) + "\n"
