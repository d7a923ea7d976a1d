"""Optimizer step time: Muon + AdamW against AdamW-only on the same CPU model, Newton-Schulz's share, and the
whole step against torch.optim.Muon + torch.optim.AdamW doing the same work in the same process.

Model: the "cpu" preset (the stability recipe's geometry) at a 4096-token vocabulary. Gradients come from one
real forward/backward of an 8 x 64 batch (the stability recipe's microbatch) and are kept fixed while each
optimizer steps repeatedly; the median of the timed repeats (CPU time of one torch thread) is reported. In the
same run the forward + backward time is measured, so the step can be put in proportion to a whole update.

Newton-Schulz's share is timed inside the real Muon+AdamW step (the module's NS function is wrapped with a
clock), and compared with a FLOP model: per matrix [A, B] (A <= B), 5 iterations of X X^T, Y Y and (.) X cost
5 (4 A^2 B + 2 A^3) flops, against roughly 6 * weights * tokens for forward + backward of that matrix. The
ratio grows as min(A, B) / tokens per update, which is why Muon is cheap at real batch sizes and not at a
CPU pilot's 512 tokens.

With `--nanochat PATH` (run_all), pilotrun's Muon step is also timed against nanochat's own MuonAdamW, whose
fused Muon step nanochat compiles, on identical matrices at the stability and the large size
(nanochat_subsection); without the flag nothing of nanochat is imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import statistics
import time
from pathlib import Path

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
PEER_PAIRS = 30  # alternating pilotrun / torch.optim.Muon steps: their difference is a few percent at most
# Target of the whole step (Muon + AdamW) against torch.optim.Muon + torch.optim.AdamW doing the same work.
TARGET_STEP_OVER_TORCH = 1.0
# Target: Newton-Schulz is nothing but matmuls, so an implementation without waste should run it at a FLOP
# rate no lower than the model's own forward+backward (a mixed workload of matmuls, norms, routing and
# softmax) on the same thread. Its absolute share of the step is a property of the shapes and the batch (FLOP
# model above), not of the implementation, and is reported, not targeted.
TARGET_NS_RATE_OVER_FWD_BWD_RATE = 1.0

# CPU time of this process, one torch thread: the CPU cores are shared with other jobs, and CPU time stays
# meaningful under contention where wall time does not.
clock = time.process_time


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


def torch_muon_with_fp32_newton_schulz():
    """torch.optim.Muon's own step with its Newton-Schulz function's single cast `grad.bfloat16()` changed to
    `grad.float()` (its source, edited as text at run time, everything else torch's): torch has no fp32
    option, and this is the fp32 peer pilotrun's CPU default must be compared with. Returns a context
    manager."""
    import contextlib
    import inspect
    import textwrap

    import torch.optim._muon as torch_muon

    source = textwrap.dedent(inspect.getsource(torch_muon._zeropower_via_newtonschulz))
    if source.count("grad.bfloat16()") != 1:
        raise RuntimeError(
            "torch.optim.Muon's Newton-Schulz changed: its bfloat16 cast is not where expected"
        )
    namespace = dict(vars(torch_muon))
    exec(source.replace("grad.bfloat16()", "grad.float()"), namespace)  # noqa: S102 (torch's own source)

    @contextlib.contextmanager
    def patched():
        original = torch_muon._zeropower_via_newtonschulz
        torch_muon._zeropower_via_newtonschulz = namespace["_zeropower_via_newtonschulz"]
        try:
            yield
        finally:
            torch_muon._zeropower_via_newtonschulz = original

    return patched()


def newton_schulz_fp64_reference(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic iteration written out in fp64 from its definition (normalise by the Frobenius norm, then
    x <- a x + (b G + c G^2) x with G = x x^T, on the short side): the exact answer both bf16 versions
    approximate."""
    a, b, c = muon_module.NEWTON_SCHULZ_COEFFICIENTS
    x = matrix.double()
    if x.shape[0] > x.shape[1]:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if matrix.shape[0] > matrix.shape[1] else x


def compare_with_torch_muon(model) -> dict:
    """pilotrun's Muon step (Muon groups only, fp32 NS) against torch.optim.Muon (fp32 NS) on the same
    matrices and gradients, matched conventions: Nesterov momentum 0.95, 5 quintic steps, the same
    coefficients, weight decay 0.1 decoupled, update scale 0.2 sqrt(max(A, B)) (torch's
    adjust_lr_fn="match_rms_adamw"). Each routed-expert stack [E, A, B] is E separate 2-D parameters for torch
    (it takes 2-D only), one 3-D parameter for pilotrun (orthogonalised per slice, the same matrices).
    Momentum forms differ (torch's EMA, pilotrun's sum): Newton-Schulz normalises its input, so the direction
    is the same to rounding. Alternating steps, CPU time, the median of per-pair ratios."""
    groups = [dict(g, params=list(g["params"])) for g in build_optimizer(model, OptimConfig()).param_groups
              if g["use_muon"]]
    ours_params = [p.detach().clone().requires_grad_(True) for g in groups for p in g["params"]]
    for q, p in zip(ours_params, [p for g in groups for p in g["params"]], strict=True):
        q.grad = p.grad.detach().clone()
    ours = MuonAdamW([{"params": ours_params, "use_muon": True, "lr": 3e-3, "weight_decay": 0.1,
                       "ns_dtype": "float32"}])
    theirs_params = []
    for q in ours_params:
        for matrix, grad in zip(q.detach().reshape(-1, *q.shape[-2:]), q.grad.reshape(-1, *q.shape[-2:]),
                                strict=True):
            leaf = matrix.clone().requires_grad_(True)
            leaf.grad = grad.clone()
            theirs_params.append(leaf)
    theirs = torch.optim.Muon(
        theirs_params,
        lr=3e-3,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        adjust_lr_fn="match_rms_adamw",
    )
    start_weights = torch.cat([q.detach().reshape(-1) for q in ours_params])
    ratios, ours_times, theirs_times = [], [], []
    with torch_muon_with_fp32_newton_schulz():
        for index in range(WARMUP + PEER_PAIRS):
            timed = []
            for optimizer in ((ours, theirs) if index % 2 == 0 else (theirs, ours)):
                start = clock()
                optimizer.step()
                timed.append((optimizer, clock() - start))
            ours_time = next(t for o, t in timed if o is ours)
            theirs_time = next(t for o, t in timed if o is theirs)
            if index >= WARMUP:
                ours_times.append(ours_time)
                theirs_times.append(theirs_time)
                ratios.append(ours_time / theirs_time)
    # Both took the same steps from the same weights and gradients: how far apart did they end, relative to
    # how far they moved?
    ours_now = torch.cat([q.detach().reshape(-1) for q in ours_params])
    theirs_now = torch.cat([q.detach().reshape(-1) for q in theirs_params])
    agreement = float((ours_now - theirs_now).abs().max() / (ours_now - start_weights).abs().max())

    # Newton-Schulz alone, bf16 vs an fp64 reference, on every Muon matrix's gradient (relative Frobenius
    # error).
    matrices = [m for q in ours_params for m in q.grad.reshape(-1, *q.shape[-2:])]
    import torch.optim._muon as torch_muon

    def worst_error(orthogonalize) -> tuple[float, float]:
        """(worst, median) relative Frobenius error over the matrices."""
        errors = []
        for matrix in matrices:
            exact = newton_schulz_fp64_reference(matrix)
            errors.append(float((orthogonalize(matrix).double() - exact).norm() / exact.norm()))
        return max(errors), statistics.median(errors)

    ours_bf16 = worst_error(lambda m: muon_module.newton_schulz_orthogonalize(m, 5, torch.bfloat16))
    theirs_bf16 = worst_error(lambda m: torch_muon._zeropower_via_newtonschulz(
        m, muon_module.NEWTON_SCHULZ_COEFFICIENTS, 5, 1e-7))
    ours_fp32 = worst_error(lambda m: muon_module.newton_schulz_orthogonalize(m, 5, torch.float32))

    # The largest stack the step builds (every Muon matrix of the most common short-side-first shape, across
    # parameters and groups): one chain over the whole stack, the chunks pilotrun runs, one 2-D chain per
    # matrix.
    by_shape: dict[tuple, list] = {}
    for matrix in matrices:
        wide = matrix if matrix.shape[0] <= matrix.shape[1] else matrix.T
        by_shape.setdefault(tuple(wide.shape), []).append(wide.contiguous())
    stack = torch.stack(max(by_shape.values(), key=len))
    chunk = muon_module.chunk_matrices(stack, torch.float32)
    schedule = muon_module.newton_schulz_schedule(5, "quintic")
    ways = {
        "whole": lambda: muon_module.newton_schulz_iterate(stack, schedule, torch.float32),
        "chunked": lambda: [
            muon_module.newton_schulz_iterate(part, schedule, torch.float32) for part in stack.split(chunk)
        ],
        "looped": lambda: [
            muon_module.newton_schulz_iterate(m, schedule, torch.float32) for m in stack.unbind(0)
        ],
    }
    way_times = {name: [] for name in ways}
    for index in range(WARMUP + PEER_PAIRS // 3):
        names = list(ways)[index % 3:] + list(ways)[:index % 3]
        for name in names:
            start = clock()
            ways[name]()
            if index >= WARMUP:
                way_times[name].append(clock() - start)
    return {
        "ours": statistics.median(ours_times),
        "theirs": statistics.median(theirs_times),
        "ratio": statistics.median(ratios),
        "agreement": agreement,
        "matrices": len(matrices),
        "stack": tuple(stack.shape),
        "ours_bf16": ours_bf16,
        "theirs_bf16": theirs_bf16,
        "ours_fp32": ours_fp32,
        "chunk": chunk,
        **{name: statistics.median(seconds) for name, seconds in way_times.items()},
    }


def compare_full_step_with_torch(model) -> dict:
    """pilotrun's whole optimizer step (MuonAdamW over the real partition, default settings: fp32
    Newton-Schulz on the CPU) against a reference of equal work in the same process: torch.optim.Muon (fp32
    Newton-Schulz, as in compare_with_torch_muon) on the same Muon matrices, each routed-expert slice a 2-D
    parameter, plus torch.optim.AdamW (the CPU default, single-tensor) on the same AdamW parameters, each
    group with pilotrun's hyperparameters. Each takes its own copies of the weights and gradients. Rounds
    alternate which goes first; CPU time; the median of per-round ratios."""
    groups = build_optimizer(model, OptimConfig()).param_groups

    def copies(params, grads=None):
        leaves = []
        for p, grad in zip(params, grads or [p.grad for p in params], strict=True):
            leaf = p.detach().clone().requires_grad_(True)
            leaf.grad = grad.detach().clone()
            leaves.append(leaf)
        return leaves

    ours = MuonAdamW([dict(g, params=copies(g["params"])) for g in groups])
    muon_groups, adamw_groups = [], []
    for g in groups:
        if g["use_muon"]:
            slices = [m for p in g["params"] for m in p.detach().reshape(-1, *p.shape[-2:]).unbind(0)]
            grads = [m for p in g["params"] for m in p.grad.reshape(-1, *p.shape[-2:]).unbind(0)]
            muon_groups.append(
                {"params": copies(slices, grads), "lr": g["lr"], "weight_decay": g["weight_decay"]}
            )
        else:
            adamw_groups.append(
                {
                    "params": copies(g["params"]),
                    "lr": g["lr"],
                    "weight_decay": g["weight_decay"],
                    "betas": g["betas"],
                    "eps": g["eps"],
                }
            )
    muon_cfg = OptimConfig().muon
    torch_muon = torch.optim.Muon(muon_groups, momentum=muon_cfg.momentum, nesterov=muon_cfg.nesterov,
                                  ns_steps=muon_cfg.ns_steps, adjust_lr_fn="match_rms_adamw")
    torch_adamw = torch.optim.AdamW(adamw_groups)

    def theirs():
        torch_muon.step()
        torch_adamw.step()

    times = {"ours": [], "theirs": []}
    ratios = []
    with torch_muon_with_fp32_newton_schulz():
        for index in range(WARMUP + PEER_PAIRS):
            timed = {}
            for name in (("ours", "theirs") if index % 2 == 0 else ("theirs", "ours")):
                start = clock()
                ours.step() if name == "ours" else theirs()
                timed[name] = clock() - start
            if index >= WARMUP:
                for name, seconds in timed.items():
                    times[name].append(seconds)
                ratios.append(timed["ours"] / timed["theirs"])
    return {"ours": statistics.median(times["ours"]), "theirs": statistics.median(times["theirs"]),
            "ratio": statistics.median(ratios), "spread": (min(ratios), max(ratios)),
            "muon_matrices": sum(len(g["params"]) for g in muon_groups),
            "adamw_tensors": sum(len(g["params"]) for g in adamw_groups)}


def run(nanochat=None) -> str:
    """The section; `nanochat` (benchmarks.nanochat_adapter.Nanochat, from `--nanochat PATH`) adds the
    comparison with nanochat's own Muon, which without it says it was not measured."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure() + "\n" + nanochat_subsection(nanochat)
    finally:
        torch.set_num_threads(threads)


@dataclasses.dataclass(frozen=True)
class NanochatSize:
    """The model whose Muon matrices both optimizers step: a preset with changes, and the rounds timed."""

    name: str
    preset: str
    changes: dict
    rounds: int
    warmup: int


# The two sizes of bench_update: the stability recipe's geometry and the large one (gpu-100m at 4 layers).
# The first warm-up round pays nanochat's compilation; it is timed apart and reported.
NANOCHAT_SIZES = (
    NanochatSize("stability", "cpu", {}, rounds=20, warmup=2),
    NanochatSize("large", "gpu-100m", {"n_layers": 4}, rounds=5, warmup=2),
)
# The open speed goal: pilotrun's Muon step <= 0.9x nanochat's compiled one on identical matrices.
TARGET_STEP_OVER_NANOCHAT = 0.9
# nanochat's own set-up values for its Muon groups (gpt.py setup_optimizer): matrix_lr and beta2 of its
# variance reduction. Momentum, iterations and weight decay are taken from pilotrun's groups (the same).
NANOCHAT_MATRIX_LR = 0.02
NANOCHAT_BETA2 = 0.9


def muon_groups_with_gradients(size: NanochatSize) -> list[dict]:
    """pilotrun's Muon groups (its partition, OptimConfig defaults) of the size's model, each parameter
    holding the gradient of one forward/backward of a BATCH x SEQ batch."""
    torch.manual_seed(0)
    model = build_model(model_preset(size.preset, vocab_size=VOCAB, init_std=0.02, **size.changes))
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    return [g for g in build_optimizer(model, OptimConfig()).param_groups if g["use_muon"]]


def leaf_with_gradient(tensor: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    leaf = tensor.detach().clone().requires_grad_(True)
    leaf.grad = grad.detach().clone()
    return leaf


def pilotrun_muon(groups: list[dict]) -> MuonAdamW:
    """pilotrun's MuonAdamW over its own copies of the Muon groups, every setting as the groups have it."""
    return MuonAdamW([dict(g, params=[leaf_with_gradient(p, p.grad) for p in g["params"]]) for g in groups])


def nanochat_matrices(groups: list[dict]) -> list[torch.Tensor]:
    """The same matrices as 2-D leaves, as nanochat holds them: each routed-expert stack [E, A, B] as its E
    experts' [A, B] matrices, each with its slice of the gradient."""
    return [
        leaf_with_gradient(matrix, grad)
        for group in groups
        for p in group["params"]
        for matrix, grad in zip(p.detach().reshape(-1, *p.shape[-2:]).unbind(0),
                                p.grad.reshape(-1, *p.shape[-2:]).unbind(0), strict=True)
    ]


def nanochat_muon(optim_module, groups: list[dict]):
    """nanochat's MuonAdamW over the same matrices, one Muon group per shape (as its set-up groups them),
    with pilotrun's momentum, iterations and weight decay and nanochat's own lr and beta2."""
    matrices = nanochat_matrices(groups)
    settings = groups[0]
    param_groups = [
        {"kind": "muon", "params": [m for m in matrices if m.shape == shape], "lr": NANOCHAT_MATRIX_LR,
         "momentum": settings["momentum"], "ns_steps": settings["ns_steps"], "beta2": NANOCHAT_BETA2,
         "weight_decay": settings["weight_decay"]}
        for shape in sorted({m.shape for m in matrices})
    ]
    return optim_module.MuonAdamW(param_groups)


def nanochat_optim_module(nanochat):
    """nanochat.optim of the checkout that benchmarks.nanochat_adapter.load imported (its package is in
    sys.modules, so the submodule comes from the same place), checked to be from that checkout."""
    module = importlib.import_module("nanochat.optim")
    if nanochat.path not in Path(module.__file__).resolve().parents:
        raise RuntimeError(f"nanochat.optim was imported from {module.__file__}, not from {nanochat.path}")
    return module


def iteration_flops(shapes: list[tuple[int, int]], steps: int, short_side) -> float:
    """Matmul FLOP of `steps` iterations over matrices of these shapes, each iterating on the side
    `short_side(rows, cols)` picks: X X^T, G G and (.) X cost 2 s^2 l + 2 s^3 + 2 s^2 l."""
    total = 0.0
    for rows, cols in shapes:
        short = short_side(rows, cols)
        long = rows * cols // short
        total += steps * (4 * short * short * long + 2 * short**3)
    return total


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
    peer = compare_with_torch_muon(model)
    whole = compare_full_step_with_torch(model)

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
    torch_adamw_foreach = torch.optim.AdamW(
        all_params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True
    )
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
    bf16_no_worse = all(o <= t for o, t in zip(peer['ours_bf16'], peer['theirs_bf16'], strict=True))
    lines = [
        "## Optimizer step: Muon + AdamW vs AdamW-only (cpu preset)",
        "",
        f"Model: `cpu` preset at vocab {VOCAB}, {n_total:,} weights ({n_muon:,} in Muon groups, the stacked "
        "experts"
        f" orthogonalised per expert slice). Gradients from one forward/backward of a {BATCH}x{SEQ} batch "
        "(the"
        f" stability recipe's microbatch), held fixed. Times are CPU seconds of one torch thread"
        f" (`time.process_time`; robust to other jobs on the machine), median of {REPEATS} steps after "
        f"{WARMUP}"
        " warm-up steps.",
        "",
        "| measurement | CPU ms per step | vs torch AdamW (default) |",
        "|---|---:|---:|",
        f"| Muon + AdamW (pilotrun MuonAdamW, real partition) | {muon_seconds * ms:.1f} |"
        f" {muon_seconds / torch_adamw_seconds:.2f}x |",
        f"| of which Newton-Schulz ({ns_clock['calls'] // steps} stacked chains per step) | "
        f"{ns_seconds * ms:.1f} |"
        f" {ns_share:.0%} of the same steps ({wrapped_step_seconds * ms:.1f} ms mean, timed in a separate "
        "run of"
        f" {steps} with Newton-Schulz instrumented; the row above is the median of uninstrumented steps) |",
        f"| AdamW-only, torch.optim.AdamW (CPU default: single-tensor) | {torch_adamw_seconds * ms:.1f} | "
        "1.00x |",
        f"| AdamW-only, torch.optim.AdamW(foreach=True) | {torch_adamw_foreach_seconds * ms:.1f} |"
        f" {torch_adamw_foreach_seconds / torch_adamw_seconds:.2f}x |",
        f"| AdamW-only, pilotrun MuonAdamW with one AdamW group | {ours_adamw_only_seconds * ms:.1f} |"
        f" {ours_adamw_only_seconds / torch_adamw_seconds:.2f}x |",
        f"| forward + backward of the same {BATCH}x{SEQ} batch (for scale) | {fwd_bwd_seconds * ms:.1f} |"
        f" {fwd_bwd_seconds / torch_adamw_seconds:.2f}x |",
        f"| forward + backward of a {BATCH}x{LONG_SEQ} batch | {fwd_bwd_long_seconds * ms:.1f} |"
        f" {fwd_bwd_long_seconds / torch_adamw_seconds:.2f}x |",
        "",
        f"Muon + AdamW step / forward+backward: {muon_seconds / fwd_bwd_seconds:.2f} at {BATCH * SEQ} tokens "
        "per"
        f" update, {muon_seconds / fwd_bwd_long_seconds:.2f} at {BATCH * LONG_SEQ} tokens (the step does not "
        "depend"
        " on the tokens; this is a single-microbatch update, without gradient accumulation).",
        "",
        f"FLOP model: Newton-Schulz does {ns_flops / 1e9:.2f} GFLOP per step, forward+backward of the Muon"
        f" matrices about {muon_fwd_bwd_flops / 1e9:.2f} GFLOP at {BATCH * SEQ} tokens (ratio"
        f" {ns_flops / muon_fwd_bwd_flops:.2f}). NS cost is fixed per update while forward+backward grows "
        "with"
        " the tokens per update, so for these shapes the same model gives"
        f" {ns_flops / (muon_fwd_bwd_flops * 262144 / (BATCH * SEQ)):.2%} at 262,144 tokens per update"
        " (128 x 2048): Muon's overhead is a small-batch cost.",
        "",
        f"Achieved rates on one torch thread: Newton-Schulz {ns_rate / 1e9:.1f} GFLOP/s, the model's "
        "forward+backward"
        f" {fwd_bwd_rate / 1e9:.1f} GFLOP/s ({model_fwd_bwd_flops / 1e9:.2f} GFLOP by"
        " `accounting.flops_per_token`).",
        "",
        f"Target: Newton-Schulz runs at >= {TARGET_NS_RATE_OVER_FWD_BWD_RATE:.1f}x the forward+backward FLOP "
        "rate"
        f" (no waste around its matmuls). Measured {ns_rate / fwd_bwd_rate:.2f}x: "
        f"{'met' if met else 'NOT met'}.",
        "",
        "### Muon against torch.optim.Muon (the same matrices and gradients)",
        "",
        f"The Muon step alone on the {peer['matrices']} Muon matrices above (each routed-expert stack as its"
        " experts' matrices), fp32 Newton-Schulz on both sides: torch.optim.Muon of the installed torch, its"
        " Newton-Schulz function's one `bfloat16()` cast replaced by `float()` at run time (torch offers no "
        "fp32"
        " option; everything else is torch's code), against pilotrun MuonAdamW with `ns_dtype: float32`. "
        "Matched"
        " conventions: Nesterov momentum 0.95, 5 quintic steps with the same coefficients, decoupled weight "
        "decay"
        " 0.1, update scale 0.2 sqrt(max(A, B)) (torch's `adjust_lr_fn=\"match_rms_adamw\"`); torch's "
        "momentum"
        " is an EMA, pilotrun's a sum, the same direction after Newton-Schulz's normalisation. Alternating "
        "steps,"
        f" CPU time of the process, one torch thread, {PEER_PAIRS} pairs after {WARMUP} warm-up pairs.",
        "",
        "| measurement | pilotrun | torch.optim.Muon | ratio |",
        "|---|---:|---:|---:|",
        f"| Muon step, fp32 Newton-Schulz, CPU ms (median; ratio = median of per-pair ratios) |"
        f" {peer['ours'] * ms:.1f} | {peer['theirs'] * ms:.1f} | {peer['ratio']:.3f}x |",
        f"| Newton-Schulz in bf16: worst relative Frobenius error against an fp64 iteration, over the"
        f" {peer['matrices']} gradients | {peer['ours_bf16'][0]:.2e} | {peer['theirs_bf16'][0]:.2e} |"
        f" {peer['ours_bf16'][0] / peer['theirs_bf16'][0]:.2f}x |",
        f"| the same, median over the gradients | {peer['ours_bf16'][1]:.2e} | {peer['theirs_bf16'][1]:.2e} |"
        f" {peer['ours_bf16'][1] / peer['theirs_bf16'][1]:.2f}x |",
        "",
        f"Weights after the same {WARMUP + PEER_PAIRS} steps: max |pilotrun - torch| = "
        f"{peer['agreement']:.1e}"
        " of the largest change either made (they agree to rounding). pilotrun's fp32 Newton-Schulz is"
        f" {peer['ours_fp32'][0]:.1e} from the fp64 iteration (worst matrix).",
        "",
        "Targets: the Muon step <= 1.0x torch.optim.Muon's CPU time: "
        f"{'met' if peer['ratio'] <= 1.0 else 'NOT met'}"
        f" ({peer['ratio']:.3f}x); bf16 Newton-Schulz error no worse than torch's:"
        f" {'met' if bf16_no_worse else 'NOT met'}"
        " (worst and median).",
        "",
        f"The largest stack the step builds, {peer['stack'][0]} matrices {list(peer['stack'][1:])} (every "
        "Muon"
        " matrix of that shape, tall ones transposed, across parameters and groups), orthogonalized as one "
        "stacked"
        f" chain (`bmm` / `baddbmm`) took {peer['whole'] * ms:.1f} ms, in pilotrun's chunks of "
        f"{peer['chunk']}"
        f" {peer['chunked'] * ms:.1f} ms, as one 2-D chain per matrix {peer['looped'] * ms:.1f} ms (CPU, "
        "medians of"
        f" {PEER_PAIRS // 3} rounds in rotating order; chunked/looped "
        f"{peer['chunked'] / peer['looped']:.2f}x,"
        f" whole/looped {peer['whole'] / peer['looped']:.2f}x). On the CPU one chain over a whole stack "
        "streams"
        " every product through memory; the chunks keep a chain's working set near the L2 cache"
        " (`NEWTON_SCHULZ_CPU_CHUNK_BYTES`). Every matrix gets the bits of its own 2-D chain on this CPU"
        " (tests/optim).",
        "",
        "### The whole optimizer step against torch.optim.Muon + torch.optim.AdamW",
        "",
        "pilotrun MuonAdamW over the real partition with its default settings (fp32 Newton-Schulz on the "
        "CPU) against"
        " a reference of equal work in the same process: torch.optim.Muon (fp32 Newton-Schulz, as above) on "
        "the"
        f" same {whole['muon_matrices']} Muon matrices plus torch.optim.AdamW (single-tensor, the CPU "
        "default) on the"
        f" same {whole['adamw_tensors']} AdamW tensors, each group with pilotrun's hyperparameters. Rounds"
        f" alternate which goes first; CPU time of the process, one torch thread; {PEER_PAIRS} rounds after"
        f" {WARMUP} warm-up rounds.",
        "",
        "| measurement | pilotrun | torch Muon + AdamW | ratio |",
        "|---|---:|---:|---:|",
        f"| one optimizer step, CPU ms (median; ratio = median of per-round ratios, range"
        f" {whole['spread'][0]:.2f}-{whole['spread'][1]:.2f}) | {whole['ours'] * ms:.1f} |"
        f" {whole['theirs'] * ms:.1f} | {whole['ratio']:.3f}x |",
        "",
        f"Target: the optimizer step <= {TARGET_STEP_OVER_TORCH:.1f}x the reference:"
        f" {'met' if whole['ratio'] <= TARGET_STEP_OVER_TORCH else 'NOT met'} ({whole['ratio']:.3f}x). Both "
        "spend"
        " most of the step in the same fp32 matmuls (Newton-Schulz, above), which run at this core's matmul "
        "rate"
        " either way; pilotrun's margin is what it saves around them (stacked chains, fused multiply-adds, "
        "one"
        " foreach call per AdamW operation).",
        "",
        "Command: `python -m benchmarks.run_all bench_optim`",
    ]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def compiled_for_every_shape(shapes: int):
    """nanochat compiles its Muon step with dynamic=False: one compiled version per shape group, and
    torch.compile runs a function eager once it holds `recompile_limit` (8) versions. nanochat's own model
    has fewer shapes than that; the large size here has 8 and the two sizes in one process 15. So dynamo's
    caches are cleared around each size and the limit is raised to the size's group count: every group
    runs compiled, as in nanochat's own training."""
    config = torch._dynamo.config
    limit = config.recompile_limit
    torch._dynamo.reset()
    config.recompile_limit = max(limit, shapes)
    try:
        yield
    finally:
        config.recompile_limit = limit
        torch._dynamo.reset()


def alternate_steps(steps: dict, size: NanochatSize) -> dict:
    """Each optimizer's step in rounds, the order alternating, CPU time of the process; the first round's
    steps (nanochat's compiles) timed apart, wall and CPU, and left out with the other warm-up rounds."""
    names = list(steps)
    times = {name: [] for name in names}
    first, ratios = {}, []
    for index in range(size.warmup + size.rounds):
        timed = {}
        for name in names if index % 2 == 0 else names[::-1]:
            wall, start = time.perf_counter(), clock()
            steps[name]()
            timed[name] = clock() - start
            first.setdefault(name, (time.perf_counter() - wall, timed[name]))
        if index >= size.warmup:
            for name in names:
                times[name].append(timed[name])
            ratios.append(timed["pilotrun"] / timed["nanochat"])
    return {"medians": {name: statistics.median(seconds) for name, seconds in times.items()},
            "ratio": statistics.median(ratios), "spread": (min(ratios), max(ratios)), "first": first}


MATMUL_OPERATORS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
PROFILED_STEPS = 2


def matmul_profile(step, steps: int = PROFILED_STEPS) -> dict:
    """Where one optimizer's step spends its time: torch.profiler over `steps` steps, the matrix-product
    operators' self time as a share of the profiled steps, and their calls per step. nanochat's compiled
    graph calls aten::bmm for its products (an extern kernel), so both sides' products are counted alike."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            step()
    events = profiler.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    products = [event for event in events if event.key in MATMUL_OPERATORS]
    return {"share": sum(event.self_cpu_time_total for event in products) / total,
            "calls": sum(event.count for event in products) // steps,
            "operators": sorted(event.key for event in products)}


def measure_against_nanochat(size: NanochatSize, optim_module) -> dict:
    """pilotrun's Muon step against nanochat's on the size's Muon matrices, the same gradients."""
    groups = muon_groups_with_gradients(size)
    ours, theirs = pilotrun_muon(groups), nanochat_muon(optim_module, groups)
    shapes = [tuple(p.shape) for g in theirs.param_groups for p in g["params"]]
    steps = groups[0]["ns_steps"]
    graphs = torch._dynamo.utils.counters["stats"]
    with compiled_for_every_shape(len(theirs.param_groups)):
        compiled_before = graphs["unique_graphs"]
        figures = alternate_steps({"pilotrun": ours.step, "nanochat": theirs.step}, size)
        compiled = graphs["unique_graphs"] - compiled_before
        profiles = {"pilotrun": matmul_profile(ours.step), "nanochat": matmul_profile(theirs.step)}
    finite = {name: all(bool(p.isfinite().all()) for g in optimizer.param_groups for p in g["params"])
              for name, optimizer in (("pilotrun", ours), ("nanochat", theirs))}
    return {
        "size": size, "matrices": len(shapes), "groups": len(theirs.param_groups),
        "compiled_graphs": compiled, "profiles": profiles,
        "parameters": sum(rows * cols for rows, cols in shapes), "steps": steps, "finite": finite,
        # pilotrun iterates on the short side of every matrix (a tall one transposed first); nanochat forms
        # X^T X for a tall matrix and X X^T otherwise: the short side too.
        "pilotrun_flops": iteration_flops(shapes, steps, min),
        "nanochat_flops": iteration_flops(shapes, steps, lambda rows, cols: cols if rows > cols else rows),
        **figures,
    }


NANOCHAT_HEADING = "### Muon step against nanochat's compiled Muon (identical matrices)"


def nanochat_subsection(nanochat) -> str:
    """The comparison's Markdown: measured at both sizes with a nanochat checkout, else a line that says it
    was not measured (and nothing of nanochat imported)."""
    if nanochat is None:
        return "\n".join([
            NANOCHAT_HEADING, "",
            "Not measured in this run: it needs a checkout of nanochat (`python -m benchmarks.run_all "
            "bench_optim --nanochat PATH`); without one nothing of nanochat is imported.", "",
        ])
    optim_module = nanochat_optim_module(nanochat)
    results = [measure_against_nanochat(size, optim_module) for size in NANOCHAT_SIZES]
    return nanochat_markdown(results, nanochat)


def nanochat_row(r: dict) -> str:
    ms, (wall, cpu), size = 1e3, r["first"]["nanochat"], r["size"]
    low, high = r["spread"]
    return (
        f"| {size.name} ({size.preset}) | {r['matrices']} ({r['groups']}) | {r['parameters']:,} |"
        f" {r['pilotrun_flops'] / 1e9:.2f} / {r['nanochat_flops'] / 1e9:.2f} |"
        f" {r['medians']['pilotrun'] * ms:.1f} | {r['medians']['nanochat'] * ms:.1f} |"
        f" **{r['ratio']:.3f}x** ({low:.2f}-{high:.2f}) | {size.rounds} after {size.warmup} |"
        f" {r['compiled_graphs']}: {wall:.1f} s wall, {cpu:.1f} s CPU |"
    )


NANOCHAT_SET_UP = (
    "pilotrun MuonAdamW's Muon groups (its partition, OptimConfig defaults: 5 quintic Newton-Schulz "
    "iterations, fp32 on the CPU, stacked in chunks) against nanochat's own MuonAdamW (nanochat/optim.py "
    "of the checkout given by `--nanochat`{commit}; its `muon_step_fused` is `torch.compile`d with "
    "dynamic=False, fullgraph=True) on the same matrices: pilotrun's Muon parameters of the size's model,"
    " each routed-expert stack [E, A, B] handed to nanochat as its E experts' [A, B] matrices, one "
    "nanochat Muon group per shape (as its set-up groups them), the same gradients (one forward/backward "
    "of a {batch}x{seq} batch, held fixed). Both: momentum 0.95, 5 iterations (nanochat: its Polar "
    "Express coefficients, ns_steps=5), weight decay 0.1; nanochat's own lr 0.02 and beta2 0.9. CPU time "
    "of the process, one torch thread, rounds alternating which goes first; medians, and the median of "
    "per-round ratios. nanochat's first step compiles one graph per shape group (torch's recompile limit "
    "raised to the group count so that none runs eager, dynamo's caches cleared around each size); it is "
    "left out of the medians and reported (its wall time includes inductor's C++ builds in worker "
    "processes, and inductor's on-disk cache shortens it on a rerun)."
)
NANOCHAT_WORK = (
    "The iterations' FLOP are the same on both sides: both iterate on the short side of each matrix "
    "(pilotrun transposes a tall one first; nanochat forms X^T X for it), 5 x (4 s^2 l + 2 s^3) per [s, "
    "l] matrix. Both run in fp32 on the CPU: pilotrun's `ns_dtype: auto` is fp32 off CUDA, and nanochat's"
    " COMPUTE_DTYPE is float32 without CUDA (it casts to bf16 only where that is its compute dtype)."
)
NANOCHAT_DIFFERENCES = (
    "What each step does beyond the iterations. pilotrun: momentum as a sum (M <- G + 0.95 M, fp32), the "
    "Nesterov direction G + 0.95 M written into its stack (a tall matrix transposed into it), Frobenius "
    "normalisation, the 5 iterations on chunks of same-shape matrices, decoupled weight decay on every "
    "weight, the update scaled by 0.2 sqrt(max(A, B)). nanochat: momentum and Nesterov as two lerps on a "
    "stacked copy of the gradients, MuonEq row equilibration (each row rescaled to the mean row norm), "
    "Frobenius normalisation (x 1.01), Muon+ renormalisation of the result to Frobenius norm sqrt(min(A, "
    "B)), NorMuon variance reduction (a factored second moment per row or column, beta2 0.9), cautious "
    "weight decay (only where update and weight agree in sign), lr scaled by sqrt(max(1, A/B)); each step"
    " stacks its group's parameters and gradients and copies the updated stack back."
)


def nanochat_markdown(results: list[dict], nanochat) -> str:
    commit = f" at {nanochat.commit}" if nanochat.commit else ""
    verdict = "NOT met" if any(r["ratio"] > TARGET_STEP_OVER_NANOCHAT for r in results) else "met"
    finite = "yes" if all(all(r["finite"].values()) for r in results) else "NO"
    ratios = ", ".join(f"{r['size'].name} {r['ratio']:.3f}x" for r in results)
    lines = [
        NANOCHAT_HEADING, "",
        NANOCHAT_SET_UP.format(commit=commit, batch=BATCH, seq=SEQ), "",
        "| size | matrices (nanochat groups) | Muon weights | matmul GFLOP per step, pilotrun / nanochat |"
        " pilotrun CPU ms | nanochat CPU ms | pilotrun / nanochat (range) | rounds | nanochat's first step:"
        " graphs compiled, time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[nanochat_row(r) for r in results], "",
        f"{NANOCHAT_WORK} Weights finite on both sides after every step: {finite}.", "",
        nanochat_profile_paragraph(results), "",
        NANOCHAT_DIFFERENCES, "",
        f"Target: pilotrun's Muon step <= {TARGET_STEP_OVER_NANOCHAT:.1f}x nanochat's compiled one at both"
        f" sizes: {verdict} ({ratios}).", "",
        "Command: `python -m benchmarks.run_all bench_optim --nanochat PATH`",
    ]
    return "\n".join(lines) + "\n"


def nanochat_profile_paragraph(results: list[dict]) -> str:
    """The profiled share of each step in matrix products, and the product rate that share implies."""
    parts = []
    for r in results:
        sides = []
        for name in ("pilotrun", "nanochat"):
            profile, seconds = r["profiles"][name], r["medians"][name]
            if not profile["calls"]:
                sides.append(f"{name}: no matrix-product operator seen")
                continue
            rate = r[f"{name}_flops"] / (profile["share"] * seconds) / 1e9
            sides.append(f"{name} {profile['share']:.0%} in {profile['calls']} calls"
                         f" ({', '.join(profile['operators'])}), {rate:.1f} GFLOP/s")
        parts.append(f"{r['size'].name}: {'; '.join(sides)}")
    return (
        f"Where the time goes (torch.profiler over {PROFILED_STEPS} more steps of each after the rounds: the"
        " matrix products' self time as a share of the profiled steps, their calls per step, and the rate"
        " implied by the iterations' FLOP over that share of the median CPU step): " + "; ".join(parts) + "."
    )
