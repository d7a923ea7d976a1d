"""Model benchmarks: routed MoE layer vs a dense FFN of the same active size, and whole-model step throughput.

1. One MoE FFN layer (grouped, sorted, loop and dense_ref dispatch; with and without the compiled CPU kernels)
   forward + backward against a dense SwiGLU whose hidden width equals the MoE's active expert width
   ((K + shared) * F), on the same tokens, interleaved repetitions in one process, median CPU times. Targets:
   the default layer (grouped dispatch, CPU kernels on) <= 1.5x the dense FFN on the CPU, and <= 1.2x at the
   cpu preset and 512 tokens (the stability recipe's microbatch).
2. A model step (forward + backward, no optimizer) of the `tiny` and `cpu` presets: tokens/s and peak memory.
   Each size runs in its own subprocess so that its peak resident set belongs to it alone
   (`environment.peak_resident_mb`: VmHWM, not ru_maxrss, which carries the parent's peak across exec).

Run: `python -m benchmarks.run_all bench_model`.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch

THREADS = 1  # see the note in the section: a shared 2-core machine makes multi-threaded small matmuls erratic


def cpu_seconds(function) -> float:
    """CPU time of this process for one call: with one intra-op thread it is the work done, and unlike wall
    time it does not count the time other jobs on a shared machine held the core."""
    started = time.process_time()
    function()
    return time.process_time() - started


MOE_REPETITIONS = 30
TARGET_MOE_OVER_DENSE_AT_512 = 1.2


def moe_versus_dense(tokens: int, repetitions: int = MOE_REPETITIONS) -> dict:
    from pilotrun.model.moe import MoE, SwiGLU
    from pilotrun.model.presets import model_preset

    cfg = model_preset("cpu", vocab_size=4096)
    torch.manual_seed(0)
    dense = SwiGLU(cfg.d_model, (cfg.top_k + cfg.n_shared_experts) * cfg.moe_hidden)
    layers = {"dense": dense}

    class GroupedMatmulExperts(MoE):
        """The default layer with its experts in PyTorch operators (grouped_mm, silu, mul, the combine kernel,
        the shared SwiGLU) after the compiled routing: the default before the experts kernel, to show what it
        saves."""

        def experts_kernel_applies(self, flat, gate_weights):
            return False

    # name: (moe_impl, cpu_kernels). grouped = the default layer: on the CPU in fp32 its router and routing,
    # and its routed and shared experts, run as the two compiled operators; grouped_pytorch is the same
    # dispatch in PyTorch operators only.
    variants = {"grouped": ("grouped", True), "grouped_mm_experts": ("grouped", True),
                "grouped_pytorch": ("grouped", False), "sorted": ("sorted", True), "loop": ("loop", True),
                "dense_ref": ("dense_ref", True)}
    for name, (impl, cpu_kernels) in variants.items():
        torch.manual_seed(0)
        moe = (GroupedMatmulExperts if name == "grouped_mm_experts" else MoE)(
            cfg.d_model, cfg.moe_hidden, cfg.n_routed_experts, cfg.n_shared_experts, cfg.top_k, moe_impl=impl,
            cpu_kernels=cpu_kernels)
        with torch.no_grad():
            for parameter in moe.parameters():
                parameter.normal_(0, 0.02)
        layers[name] = moe
    # The input needs a gradient, as every FFN input in the model does (it is the residual stream).
    x = torch.randn(
        max(tokens // 64, 1), min(tokens, 64), cfg.d_model, generator=torch.Generator().manual_seed(1)
    )
    x.requires_grad_(True)
    upstream = torch.randn_like(x)

    def step(layer):
        def run():
            x.grad = None
            layer.zero_grad(set_to_none=True)
            output = layer(x)
            output = output[0] if isinstance(output, tuple) else output
            output.backward(upstream)
        return run

    runners = {name: step(layer) for name, layer in layers.items()}
    runners["floor"] = step_without_routing(layers["grouped"], x, upstream)
    for run in runners.values():  # warm-up
        run()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    ratios: dict[str, list[float]] = {name: [] for name in runners if name != "dense"}
    for repetition in range(repetitions):
        # Each variant is timed right after its own dense run (pairs), and the pair order alternates, so
        # drifting load and cache state from the previous variant hit both sides of every ratio alike.
        for name, run in runners.items():
            if name == "dense":
                continue
            pair = [runners["dense"], run] if repetition % 2 == 0 else [run, runners["dense"]]
            first, second = cpu_seconds(pair[0]), cpu_seconds(pair[1])
            dense_time, variant_time = (first, second) if repetition % 2 == 0 else (second, first)
            samples["dense"].append(dense_time)
            samples[name].append(variant_time)
            ratios[name].append(variant_time / dense_time)
    active = {name: sum(p.numel() for n, p in layer.named_parameters()
                        if "experts." not in n or "shared" in n) for name, layer in layers.items()}
    one_expert = 3 * cfg.moe_hidden * cfg.d_model
    active_moe = active["grouped"] + cfg.top_k * one_expert
    return {"tokens": tokens, "median_s": {name: statistics.median(v) for name, v in samples.items()},
            "ratio": {name: statistics.median(v) for name, v in ratios.items()},
            "active_dense": active["dense"], "active_moe": active_moe}


def step_without_routing(moe, x: torch.Tensor, upstream: torch.Tensor):
    """A lower bound for any routing optimization: the default layer's experts operator (gather, the routed
    and shared SwiGLUs, combine) on a routing computed once beforehand (no router matmul, top-k, balance loss,
    statistics or sort in the timed step). Not a usable layer: nothing trains the router."""
    from pilotrun.model.moe import sorted_layout

    flat = x.detach().reshape(-1, x.shape[-1])
    with torch.no_grad():
        indices, weights, _, _ = moe.gate(flat)
    layout = sorted_layout(indices, moe.n_routed_experts)
    weights.requires_grad_(True)  # as the router's weights are: the combine computes their gradient
    fused = moe.experts_kernel_applies(flat, weights)

    def run():
        x.grad = None
        moe.zero_grad(set_to_none=True)
        tokens = x.reshape(-1, x.shape[-1])
        if fused:  # routed and shared experts in the one operator, as the layer runs them
            output = moe.experts.forward_fused(tokens, weights, layout, moe.shared_experts)
        else:
            output = moe.experts.forward_grouped(tokens, indices, weights, layout) + moe.shared_experts(
                tokens
            )
        output.reshape(x.shape).backward(upstream)
    return run


def moe_time_breakdown(tokens: int = 512, repetitions: int = MOE_REPETITIONS) -> dict:
    """Where the default layer's time goes at `tokens`: its parts timed alone, forward + backward each,
    interleaved with the whole layer and the dense FFN (medians of CPU time): the routing (the router
    operator: router matmul, routing, statistics, and its backward with the balance term's gradient) and the
    experts operator on a fixed routing (routed and shared experts; and, for comparison, the same operator
    without the shared experts). What the parts do not cover is the layer's glue (the reshapes, the sum of the
    two input gradients, the autograd graph between them)."""
    from pilotrun.model.moe import MoE, SwiGLU
    from pilotrun.model.presets import model_preset

    cfg = model_preset("cpu", vocab_size=4096)
    torch.manual_seed(0)
    dense = SwiGLU(cfg.d_model, (cfg.top_k + cfg.n_shared_experts) * cfg.moe_hidden)
    moe = MoE(cfg.d_model, cfg.moe_hidden, cfg.n_routed_experts, cfg.n_shared_experts, cfg.top_k)
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.normal_(0, 0.02)
    moe.train()
    x = torch.randn(
        max(tokens // 64, 1), min(tokens, 64), cfg.d_model, generator=torch.Generator().manual_seed(1)
    )
    x.requires_grad_(True)
    upstream = torch.randn_like(x)
    flat = x.detach().reshape(-1, cfg.d_model).requires_grad_(True)
    flat_upstream = upstream.reshape(-1, cfg.d_model)
    with torch.no_grad():
        routing = moe.route(flat.detach(), x.shape[0])
    gate_weights = routing.weights.detach().requires_grad_(True)

    def whole():
        x.grad = None
        moe.zero_grad(set_to_none=True)
        moe(x)[0].backward(upstream)

    def dense_ffn():
        x.grad = None
        dense.zero_grad(set_to_none=True)
        dense(x).backward(upstream)

    def routing_only():
        flat.grad = None
        moe.zero_grad(set_to_none=True)
        # records the statistics, as the layer's training forward does
        routed = moe.route(flat, x.shape[0], True)
        (routed.weights.sum() + routed.balance_value).backward()

    def experts(shared):
        def run():
            flat.grad = gate_weights.grad = None
            moe.zero_grad(set_to_none=True)
            moe.experts.forward_fused(flat, gate_weights, routing.layout, shared).backward(flat_upstream)
        return run

    parts = {
        "dense": dense_ffn,
        "whole": whole,
        "routing": routing_only,
        "experts": experts(moe.shared_experts),
        "routed_experts": experts(None),
    }
    if not (routing.fused and moe.experts_kernel_applies(flat, gate_weights)):  # no compiled kernels here
        return {}
    for run in parts.values():
        run()
    samples: dict[str, list[float]] = {name: [] for name in parts}
    for repetition in range(repetitions):
        for name, run in (parts.items() if repetition % 2 == 0 else reversed(parts.items())):
            samples[name].append(cpu_seconds(run))
    return {name: statistics.median(values) for name, values in samples.items()}


def matmul_rates(repetitions: int = 200) -> dict:
    """GFLOP/s of one BLAS product (torch.mm, x @ W^T as the forward runs it) at the dense FFN's forward shape
    (512 x 128 by 128 x 384) and at one routed expert's (a ~128-row segment: 128 x 128 by 128 x 128): the
    experts do the dense FFN's FLOPs in products this small, which the BLAS runs at a lower rate whatever the
    code around it."""
    rates = {}
    for name, (rows, width, hidden) in {"dense": (512, 128, 384), "expert_segment": (128, 128, 128)}.items():
        a, weight = torch.randn(rows, width), torch.randn(hidden, width)
        out = torch.empty(rows, hidden)
        for _ in range(10):
            torch.mm(a, weight.t(), out=out)
        def products(a=a, weight=weight, out=out):
            for _ in range(repetitions):
                torch.mm(a, weight.t(), out=out)

        samples = [2 * rows * width * hidden * repetitions / cpu_seconds(products) / 1e9 for _ in range(5)]
        rates[name] = statistics.median(samples)
    return rates


def max_logit_tracker_cost(batch: int, seq: int, repetitions: int = 10) -> dict:
    """MLA forward + backward with sdpa, with the chunked max-logit pass (training mode) and without it
    (eval mode: identical autograd work, no tracker), plus eager attention; gpu-100m attention shapes."""
    from pilotrun.model.mla import MLA
    from pilotrun.model.rope import build_rope_table

    torch.manual_seed(0)
    mla = MLA(512, 8, 0, 128, 64, 32, 64)
    x = torch.randn(batch, seq, 512) * 0.5
    cos, sin = build_rope_table(32, seq, 10000.0)
    upstream = torch.randn(batch, seq, 512)

    def run(impl: str, training: bool):
        def go():
            mla.attn_impl = impl
            mla.train(training)
            mla.zero_grad(set_to_none=True)
            mla(x, cos, sin).backward(upstream)
        return go

    variants = {"sdpa_without_tracker": run("sdpa", False), "sdpa_with_tracker": run("sdpa", True),
                "eager": run("eager", True)}
    for go in variants.values():
        go()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for repetition in range(repetitions):
        order = list(variants.items()) if repetition % 2 == 0 else list(reversed(variants.items()))
        for name, go in order:
            samples[name].append(cpu_seconds(go))
    return {
        "batch": batch,
        "seq": seq,
        "median_s": {name: statistics.median(v) for name, v in samples.items()},
    }


STEP_SCRIPT = r"""
import json, os, sys, time, torch
from pilotrun.model.presets import model_preset
from pilotrun.model.transformer import build_model
torch.set_num_threads(int(sys.argv[1]))
preset = sys.argv[2]
vocab, batch, seq, steps = (int(arg) for arg in sys.argv[3:7])
recompute = sys.argv[7] == "1"
torch.manual_seed(0)
geometry = model_preset(preset, vocab_size=vocab, max_seq_len=seq, activation_checkpointing=recompute)
model = build_model(geometry)
tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
inputs, targets = tokens[:, :-1], tokens[:, 1:]
saved = {}
def pack(tensor):  # bytes autograd keeps for backward, each storage once
    storage = tensor.untyped_storage()
    saved[storage.data_ptr()] = storage.nbytes()
    return tensor
def step():
    model.zero_grad(set_to_none=True)
    model(inputs, targets).loss.backward()
with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
    step()
from pilotrun.training.environment import peak_resident_mb
rss_before_mb = peak_resident_mb()
wall, cpu = [], []
for _ in range(steps):
    w, c = time.perf_counter(), time.process_time(); step()
    wall.append(time.perf_counter() - w); cpu.append(time.process_time() - c)
wall.sort(); cpu.sort()
print(json.dumps({"wall_s": wall[len(wall) // 2], "cpu_s": cpu[len(cpu) // 2],
                  "peak_rss_mb": peak_resident_mb(), "rss_after_first_step_mb": rss_before_mb,
                  "saved_for_backward_mb": sum(saved.values()) / 2**20,
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "load_average": os.getloadavg()[0]}))
"""


def activation_checkpointing_cost(batch: int = 8, seq: int = 256, rounds: int = 8) -> float:
    """CPU time of a `cpu` preset forward + backward with activation checkpointing over one without, the two
    models (same weights) interleaved in this process, median of paired ratios: separate subprocess medians
    moved by +-15% between runs on this machine, more than the effect."""
    from pilotrun.model.presets import model_preset
    from pilotrun.model.transformer import build_model

    models = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        models[recompute] = build_model(model_preset("cpu", vocab_size=4096, max_seq_len=seq,
                                                     activation_checkpointing=recompute))
    tokens = torch.randint(0, 4096, (batch, seq + 1), generator=torch.Generator().manual_seed(0))

    def step(recompute: bool):
        def run():
            models[recompute].zero_grad(set_to_none=True)
            models[recompute](tokens[:, :-1], tokens[:, 1:]).loss.backward()
        return cpu_seconds(run)

    for _ in range(2):
        step(False), step(True)
    ratios = []
    for index in range(rounds):
        first, second = (False, True) if index % 2 == 0 else (True, False)
        times = {first: step(first), second: step(second)}
        ratios.append(times[True] / times[False])
    return statistics.median(ratios)


def model_step(preset: str, vocab: int, batch: int, seq: int, steps: int, recompute: bool = False) -> dict:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            STEP_SCRIPT,
            str(THREADS),
            preset,
            str(vocab),
            str(batch),
            str(seq),
            str(steps),
            "1" if recompute else "0",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    figures["tokens_per_cpu_s"] = batch * seq / figures["cpu_s"]
    figures["tokens_per_wall_s"] = batch * seq / figures["wall_s"]
    return figures


def run() -> str:
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        # 512 tokens (the stability microbatch) sits near the target, so it is measured three times, each with
        # its own warm-up; the table shows the median one and the text all three.
        repeated = sorted((moe_versus_dense(512) for _ in range(3)), key=lambda c: c["ratio"]["grouped"])
        comparisons = [moe_versus_dense(64), repeated[1], moe_versus_dense(2048), moe_versus_dense(4096)]
        breakdown = moe_time_breakdown(512)
        rates = matmul_rates()
        tracker = [max_logit_tracker_cost(batch, seq) for batch, seq in ((4, 256), (1, 1024))]
        steps = [
            ("tiny", 256, 4, 32, 30, False),
            ("cpu", 4096, 8, 64, 15, False),
            ("cpu", 4096, 8, 256, 8, False),
            ("cpu", 4096, 8, 256, 8, True),
        ]
        step_figures = [
            (preset, vocab, batch, seq, recompute, model_step(preset, vocab, batch, seq, count, recompute))
            for preset, vocab, batch, seq, count, recompute in steps
        ]
        recompute_time_ratio = activation_checkpointing_cost()
    finally:
        torch.set_num_threads(previous_threads)

    lines = [
        "## Model: MoE layer vs dense FFN, and model step throughput",
        "",
        f"Measured with {THREADS} intra-op thread (`torch.set_num_threads({THREADS})`): on this shared "
        "2-core "
        "machine two OpenMP threads made small matmuls erratic (a 4096x64x8 matmul took 16 ms with two "
        "threads and 0.1 ms with one while other jobs ran).",
        "",
        "### MoE FFN layer forward + backward vs a dense SwiGLU of the same active width",
        "`cpu` preset shapes: d 128, 8 routed experts of width 128 + 1 shared, top-2 (active expert width "
        "384); the dense FFN has hidden width 384. Same input tokens, which need a gradient as in the model; "
        f"router statistics on (training mode); {MOE_REPETITIONS} repetitions, each variant timed in a pair "
        "with a dense run "
        "(order alternating); CPU time of this process (robust to other jobs on the machine, unlike wall "
        "time); ratio = median of the per-pair ratios. 512 tokens is the stability recipe's microbatch.",
        "",
        "| tokens | dense FFN ms | MoE default (grouped, CPU kernels) ms | ratio | "
        "grouped_mm experts, kernel routing ms | ratio | grouped, PyTorch only ms | ratio | sorted ms | "
        "ratio | "
        "loop ms | ratio | dense_ref ms | ratio | floor: default without routing ms | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    met_at = []
    for c in comparisons:
        t, r = c["median_s"], c["ratio"]
        if r["grouped"] <= 1.5:
            met_at.append(c["tokens"])
        lines.append(
            f"| {c['tokens']} | {t['dense'] * 1e3:.2f} | "
            + " | ".join(
                f"{t[impl] * 1e3:.2f} | {r[impl]:.2f}x" if impl in t else "n/a | n/a"
                for impl in (
                    "grouped",
                    "grouped_mm_experts",
                    "grouped_pytorch",
                    "sorted",
                    "loop",
                    "dense_ref",
                    "floor",
                )
            )
            + " |"
        )
    small, c = comparisons[0], comparisons[1]
    fixed_ms = (small["median_s"]["grouped"] - small["median_s"]["dense"]) * 1e3
    target = TARGET_MOE_OVER_DENSE_AT_512
    within_target = sum(r["ratio"]["grouped"] <= target for r in repeated)
    lines += [
        "",
        f"Active parameters: dense FFN {c['active_dense']:,}; MoE {c['active_moe']:,} (the same expert "
        f"weights plus the router's {c['active_moe'] - c['active_dense']:,}).",
        "Target: the default MoE dispatch (grouped) <= 1.5x the dense FFN. "
        + (
            "**Met at every token count above.**"
            if len(met_at) == len(comparisons)
            else (
                f"**Met at {', '.join(map(str, met_at))} tokens; not met at " if met_at else "**Not met at "
            )
            + f"{', '.join(str(c['tokens']) for c in comparisons if c['tokens'] not in met_at)} tokens.**"
        )
        + " At 512 tokens, three independent measurements gave "
        + ", ".join(f"{c['ratio']['grouped']:.2f}x" for c in repeated)
        + f" ({sum(c['ratio']['grouped'] <= 1.5 for c in repeated)} of 3 within the target; the table shows "
        "the median one).",
        f"Target at the cpu preset and 512 tokens: <= {target:.1f}x the dense FFN: "
        + ("**met**" if c["ratio"]["grouped"] <= target else "**NOT met**")
        + f" ({c['ratio']['grouped']:.2f}x, the median of the three runs "
        + ", ".join(f"{r['ratio']['grouped']:.2f}x" for r in repeated)
        + f"; {within_target} of 3 within it). The floor ({c['ratio']['floor']:.2f}x) bounds what any "
          "routing "
        "change alone can reach.",
        "The default layer (`grouped` dispatch, `model.cpu_kernels` on) runs on the CPU in fp32 as two "
        "compiled operators each way (`pilotrun/model/moe_kernels.cpp`), whose backward are autograd nodes "
        "in "
        "C++ (no Python in either direction): the router (the router matmul, top-k, gate normalization, "
        "balance term and its scaling, router statistics, sort by expert) and the experts (gather, each "
        "routed expert's SwiGLU as BLAS calls on its segment, the shared experts' SwiGLU on all tokens, the "
        "gate-weighted combine with the shared output added, and the backward of all of it, the input "
        "gradient summed by the BLAS); the layer output equals the PyTorch `grouped` dispatch's bit for bit. "
        "`grouped_mm experts, kernel routing` is the compiled router with the experts in PyTorch operators "
        "(one `grouped_mm` per projection, silu and mul, the combine kernel, the shared SwiGLU and the add): "
        "what the experts operator saves. `grouped, PyTorch only` has no compiled kernel at all "
        "(`model.cpu_kernels: false`, also what CUDA runs). `sorted`, `loop` and `dense_ref` use the "
        "compiled "
        "router with PyTorch experts. The floor is a lower bound for any faster routing: the default layer's "
        "experts operator on a routing computed before the timed step (no router, top-k, balance loss, "
        "statistics or sort).",
    ]
    if breakdown:
        b = breakdown
        covered = b["routing"] + b["experts"]
        lines += [
            "",
            "Where the default layer's time goes at 512 tokens (each part forward + backward, timed alone "
            "and interleaved with the whole layer, medians of CPU time; `moe_time_breakdown`):",
            "",
            "| part | CPU ms | share of the whole layer | vs the dense FFN |",
            "|---|---:|---:|---:|",
        ]
        for name, label in (
            ("routing", "router operator (router matmul, routing, statistics), and backward"),
            ("experts", "experts operator (gather, 8 routed + 1 shared SwiGLU, combine), and backward"),
            ("routed_experts", "for comparison: the experts operator without the shared expert"),
            ("whole", "the whole layer"),
            ("dense", "dense FFN of the same active width"),
        ):
            lines.append(f"| {label} | {b[name] * 1e3:.2f} | {b[name] / b['whole']:.0%} | "
                         f"{b[name] / b['dense']:.2f}x |")
        lines += [
            "",
            f"The router and experts operators add up to {covered / b['whole']:.0%} of the layer; the "
            f"experts operator does the dense FFN's matmul FLOPs and takes {b['experts'] / b['dense']:.2f}x "
            f"its time, the routing adds {b['routing'] / b['dense']:.2f}x of it on top.",
        ]
    lines += [
        "",
        "Where the CPU kernels pay and where not. They pay where the count of operators and autograd "
        f"nodes dominates: at 512 tokens the default layer takes {c['ratio']['grouped']:.2f}x the dense FFN "
        f"against {c['ratio']['grouped_pytorch']:.2f}x for the same dispatch in PyTorch operators and "
        f"{c['ratio']['grouped_mm_experts']:.2f}x with the compiled router but PyTorch experts; at "
        f"{comparisons[-1]['tokens']} tokens {comparisons[-1]['ratio']['grouped']:.2f}x against "
        f"{comparisons[-1]['ratio']['grouped_pytorch']:.2f}x. What "
        "they cannot remove: (1) the experts' matmuls are small: one BLAS product at a routed expert's shape "
        f"(128 x 128 by 128 x 128) runs at {rates['expert_segment']:.0f} GFLOP/s against "
        f"{rates['dense']:.0f} GFLOP/s at the dense FFN's (512 x 128 by 128 x 384) (`matmul_rates`), and the "
        "forward must make the same BLAS calls as the PyTorch dispatch to equal it bit for bit; (2) at "
        f"{small['tokens']} tokens, where the matmuls cost little, the MoE layer takes {fixed_ms:.1f} ms "
        "more "
        "than the dense FFN: per-call costs (the two operators and their autograd nodes, 8 experts x 9 "
        "segment matmuls, the gather, combine and elementwise passes) that do not shrink with the token "
        "count; (3) every operator costs more when the work before it has evicted its code and data from the "
        "caches"
        + (
            f": the whole layer comes out at {breakdown['whole'] / breakdown['dense']:.2f}x the dense FFN in "
            "the breakdown, timed among its own parts, against the table's "
            f"{c['ratio']['grouped']:.2f}x, timed among the other variants"
            if breakdown
            else ""
        )
        + "; the fewer operators a layer has, the less it pays for this. Elsewhere the kernels do not run at "
        "all: CUDA, autocast (bf16/fp16 experts stay with `grouped_mm`), torch.compile tracing, a Python "
        "dispatch mode such as the FLOP counter, group-limited routing.",
        "Tried in this project and not kept, each measured against `sorted`: one Python autograd function "
        "with preallocated segment buffers and a hand-written backward (no faster, and slower at 2048 "
        "tokens: "
        "its large fresh buffers page-fault), W1|W3 fused into one matmul per expert (slower: strided "
        "halves), "
        "a padded batched-matmul dispatch (5% faster at 512 tokens, slower at 2048, and its padding grows "
        "with "
        "load imbalance; CPU `bmm` runs its batch as separate GEMMs, so it saves no call overhead). Measured "
        "against the kept routing kernel: its outputs as views of two allocations instead of eight (slower: "
        "making the views cost more than the allocations), an inline series log for the entropy statistic "
        "instead of PyTorch's vectorized log (slower), a branch-free top-k selection (slower than the "
        "branching one).",
        "",
        "### Cost of the max-logit tracker with sdpa (QK-Clip input)",
        "One MLA layer with gpu-100m attention shapes (d 512, 8 heads, d_qk 96, d_v 64, r_kv 128), forward + "
        "backward, median CPU time. The tracker is a chunked, no-grad Q K^T over the causal triangle; eval "
        "mode skips it.",
        "",
        "| batch x seq | sdpa without tracker ms | sdpa with tracker ms | tracker overhead | eager ms |",
        "|---|---|---|---|---|",
    ]
    for c in tracker:
        t = c["median_s"]
        lines.append(
            f"| {c['batch']} x {c['seq']} | {t['sdpa_without_tracker'] * 1e3:.1f} | "
            f"{t['sdpa_with_tracker'] * 1e3:.1f} | "
            f"{(t['sdpa_with_tracker'] / t['sdpa_without_tracker'] - 1) * 100:+.0f}% | "
            f"{t['eager'] * 1e3:.1f} |"
        )
    lines += [
        "",
        "The whole layer (projections included) is timed, so the overhead is relative to the layer, not "
        "to the attention product alone; on a GPU the flash kernels make attention cheaper and the "
        "relative cost of the extra product higher (not measured here: no GPU in this run).",
    ]
    lines += [
        "",
        "### Model step (forward + backward, no optimizer)",
        "",
        "Each row in its own fresh process. Median over the steps; CPU time is this process's (one thread), "
        "wall "
        "time includes waiting for the core. Memory: bytes autograd saved for backward (each storage once), "
        "and the subprocess's peak resident set (VmHWM of its own address space: the imported libraries "
        "included, the parent benchmark process not).",
        "",
        "| preset | parameters | batch x seq | activation checkpointing | CPU ms/step | tokens per CPU-s | "
        "wall ms/step | tokens per wall-s | saved for backward MB | peak RSS MB | load average |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for preset, vocab, batch, seq, recompute, f in step_figures:
        lines.append(
            f"| {preset} (vocab {vocab}) | {f['parameters']:,} | {batch} x {seq} | "
            f"{'on' if recompute else 'off'} | "
            f"{f['cpu_s'] * 1e3:.1f} | {f['tokens_per_cpu_s']:,.0f} | {f['wall_s'] * 1e3:.1f} | "
            f"{f['tokens_per_wall_s']:,.0f} | {f['saved_for_backward_mb']:.1f} | {f['peak_rss_mb']:.0f} | "
            f"{f['load_average']:.1f} |"
        )
    plain, recomputed = step_figures[-2][5], step_figures[-1][5]
    lines += [
        "",
        "Activation checkpointing (`model.activation_checkpointing: true`, cpu 8 x 256, the last two rows, "
        f"side by side): {recomputed['saved_for_backward_mb'] / plain['saved_for_backward_mb']:.2f}x the "
        "bytes "
        f"autograd keeps for backward, {recomputed['peak_rss_mb'] / plain['peak_rss_mb']:.2f}x the peak "
        "resident "
        "set (which includes ~250 MB of libraries and the weights; glibc keeps freed memory, so the saving "
        "hardly "
        f"shows there on the CPU), {recompute_time_ratio:.2f}x the CPU time of a step (each block's forward "
        "runs again in backward; the two models interleaved in one process, median of 8 paired ratios, "
        "since the rows' separate processes are too noisy for this ratio). With it on, the saved bytes "
        "are each block's input plus the model's embedding and head; the block internals are rebuilt in "
        "backward, where torch's checkpoint keeps them outside this count.",
    ]
    cpu_wide = step_figures[-2][5]
    lines += [
        "",
        f"At the measured CPU rate the `cpu` preset needs {300 * 2048 / cpu_wide['tokens_per_cpu_s']:.0f} s "
        "of model forward + backward for 300 updates of 2,048 tokens on one free core (optimizer time not "
        "included; see bench_optim).",
        "",
        "Command: `python -m benchmarks.run_all bench_model`",
    ]
    return "\n".join(lines) + "\n"
