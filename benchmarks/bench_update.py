"""One whole update (forward + backward + optimizer step) of pilotrun's model against a reference of equal
active work built from torch's own modules, eager and compiled, side by side in one process.

The reference: a dense GPT of pre-norm blocks (torch.nn.RMSNorm, q/k/v/o projections and
F.scaled_dot_product_attention, a SwiGLU MLP), trained with torch.optim.Muon on its hidden matrices and
torch.optim.AdamW (foreach) on the embedding, the head and the norm gains. Its MLP width is chosen so that its
matmul parameters equal pilotrun's active matmul parameters (`accounting.active_matmul_parameters`: what one
token multiplies by), so both do the same matmul work per token; the FLOP per token of each is stated beside
it. It has no rotary embedding (elementwise work, a few percent at most).

Each variant keeps its own model and optimizer; the rounds interleave them and rotate their order (so that a
busier moment of the shared machine does not fall on one variant), and each phase is timed in CPU seconds of
this process on one torch thread (`time.process_time`: other jobs on the machine take wall time, not this
process's CPU time). The first updates of a compiled variant pay its compilation: their excess over the eager
variant's update is the compile cost, and the updates after which it pays back follow from the per-update
saving.

A second yardstick joins the same rounds: "MoE reference eager" (benchmarks/moe_reference.py), an MoE of torch
modules with pilotrun's total matrices one for one (MLA's projections, the routed and shared experts, each
expert matrix a 2-D weight) and torch.optim.Muon on them: the same Newton-Schulz work per step as pilotrun,
which the dense reference (equal ACTIVE work) does not have.

With `--nanochat PATH` (a checkout of nanochat; optional, never required) two more variants join the same
rounds: "nanochat as shipped" (`torch.compile` of its model, its own optimizers, whose step functions it
compiles itself) and "nanochat eager" (its model uncompiled, the same optimizers), built by
benchmarks/nanochat_adapter.py at the same work per token.

`python -m benchmarks.run_all bench_update` (`python -m benchmarks.bench_update --json` for the figures alone;
`--sizes stability` for the small size only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import moe_reference, nanochat_adapter
from benchmarks.bench_optim import torch_muon_with_fp32_newton_schulz
from pilotrun.config import OptimConfig
from pilotrun.model.accounting import active_matmul_parameters, flops_per_token
from pilotrun.model.presets import model_preset
from pilotrun.model.transformer import build_model, compile_blocks_and_output
from pilotrun.optim.muon_adamw import build_optimizer

VOCAB = 4096
clock = time.process_time
# Goals of the update's speed: pilotrun's update no slower than the reference's at equal work, its optimizer
# step no slower, and compilation >= 1.3x faster than eager where a run is long enough to pay it back.
TARGET_UPDATE_OVER_REFERENCE = 1.0
TARGET_STEP_OVER_REFERENCE = 1.0
TARGET_COMPILED_SPEEDUP = 1.3


@dataclasses.dataclass(frozen=True)
class Size:
    name: str
    preset: str
    changes: dict
    batch: int
    seq: int
    rounds: int
    warmup: int


SIZES = {
    "stability": Size("stability", "cpu", {}, batch=8, seq=64, rounds=12, warmup=3),
    # The gpu recipe's model cut to 4 layers: the larger CPU size the speed goals name.
    "large": Size("large", "gpu-100m", {"n_layers": 4}, batch=8, seq=256, rounds=3, warmup=2),
}


class ReferenceBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, hidden: int):
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d_model), nn.RMSNorm(d_model)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d_model, hidden, bias=False), nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        h = self.attn_norm(x)
        q, k, v = (
            w(h).view(batch, seq, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attended.transpose(1, 2).reshape(batch, seq, d_model))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ReferenceGPT(moe_reference.BlockStackLM):
    def __init__(self, vocab: int, d_model: int, n_layers: int, n_heads: int, hidden: int):
        super().__init__(vocab, d_model,
                         lambda: (ReferenceBlock(d_model, n_heads, hidden) for _ in range(n_layers)))


def reference_hidden_width(matmul_parameters: int, d_model: int, n_layers: int, vocab: int) -> int:
    """The SwiGLU width at which the reference's matmul parameters (per layer 4 d^2 + 3 d h, plus the head)
    equal the given count, rounded to a multiple of 8."""
    per_layer = (matmul_parameters - d_model * vocab) / n_layers - 4 * d_model * d_model
    return max(8, int(round(per_layer / (3 * d_model) / 8)) * 8)


def reference_matmul_parameters(model: ReferenceGPT) -> int:
    return sum(
        p.numel() for name, p in model.named_parameters() if p.ndim == 2 and not name.startswith("embed")
    )


def reference_flops_per_token(model: ReferenceGPT, seq: int) -> float:
    d_model = model.embed.embedding_dim
    keys_attended = (seq + 1) / 2  # causal, counted as accounting.flops_per_token counts pilotrun's
    return 6 * reference_matmul_parameters(model) + 6 * len(model.layers) * 2 * d_model * keys_attended


def newton_schulz_flops(matrices: list[torch.Tensor]) -> float:
    """Newton-Schulz FLOP of one step over these Muon parameters (a 3-D stack counted per slice): 5 quintic
    iterations of X X^T, the polynomial and its product with X on the short side A of each [A, B] matrix, 5 (4
    A^2 B + 2 A^3). An MoE orthogonalises every expert's matrices each step, the ones a token did not use
    included: the step's work follows the total parameters, the forward's the active ones."""
    total = 0.0
    for p in matrices:
        a, b = sorted(p.shape[-2:])
        total += (p.numel() // (a * b)) * 5 * (4 * a * a * b + 2 * a ** 3)
    return total


def reference_optimizers(model: nn.Module, optim: OptimConfig,
                         hidden: list[torch.Tensor] | None = None) -> list[torch.optim.Optimizer]:
    """torch.optim.Muon on every hidden matrix (default: every 2-D weight in the layers), torch.optim.AdamW
    (foreach) on the rest, with pilotrun's hyperparameters (Muon's update scaled to AdamW's RMS, as pilotrun's
    default scale does; its Newton-Schulz in fp32 as pilotrun's on the CPU, through bench_optim's patch of
    torch's single bf16 cast)."""
    if hidden is None:
        hidden = [p for name, p in model.named_parameters() if p.ndim == 2 and name.startswith("layers.")]
    rest = [p for p in model.parameters() if not any(p is h for h in hidden)]
    muon = torch.optim.Muon(
        hidden,
        lr=optim.muon.lr,
        weight_decay=optim.muon.weight_decay,
        momentum=optim.muon.momentum,
        nesterov=optim.muon.nesterov,
        ns_steps=optim.muon.ns_steps,
        adjust_lr_fn="match_rms_adamw",
    )
    adamw = torch.optim.AdamW(rest, lr=optim.adamw.lr, betas=tuple(optim.adamw.betas), eps=optim.adamw.eps,
                              weight_decay=optim.adamw.weight_decay, foreach=True)
    return [muon, adamw]


class Variant:
    """One model and its optimizers, with its phases timed per update."""

    def __init__(self, name: str, model: nn.Module, optimizers: list, loss_of, tokens: torch.Tensor):
        self.name, self.model, self.optimizers, self.loss_of, self.tokens = (
            name,
            model,
            optimizers,
            loss_of,
            tokens,
        )
        self.forward_backward: list[float] = []
        self.step: list[float] = []
        self.first_updates = 0.0

    def update(self, timed: bool) -> float:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=False)
        start = clock()
        self.loss_of(self.model, self.tokens).backward()
        middle = clock()
        for optimizer in self.optimizers:
            optimizer.step()
        end = clock()
        if timed:
            self.forward_backward.append(middle - start)
            self.step.append(end - middle)
        return end - start

    def figures(self) -> dict:
        updates = [a + b for a, b in zip(self.forward_backward, self.step, strict=True)]
        return {"update_ms": 1e3 * statistics.median(updates),
                "forward_backward_ms": 1e3 * statistics.median(self.forward_backward),
                "step_ms": 1e3 * statistics.median(self.step), "first_updates_s": self.first_updates}


def pilotrun_loss(model, tokens):
    return model(tokens[:, :-1], tokens[:, 1:]).loss


def reference_loss(model, tokens):
    return model(tokens[:, :-1], tokens[:, 1:])


def build_variants(
    size: Size, nanochat: nanochat_adapter.Nanochat | None = None
) -> tuple[list[Variant], dict]:
    cfg = model_preset(size.preset, vocab_size=VOCAB, init_std=0.02, **size.changes)
    tokens = torch.randint(0, VOCAB, (size.batch, size.seq + 1), generator=torch.Generator().manual_seed(0))
    optim = OptimConfig()
    matmul = active_matmul_parameters(cfg)
    hidden = reference_hidden_width(matmul, cfg.d_model, cfg.n_layers, VOCAB)
    variants = []
    # compile_blocks_and_output resets dynamo's caches: the compiled pilotrun model is built before any other
    # compiled model.
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg)
        model.train()
        if compiled:
            compile_blocks_and_output(model, "inductor")
        optimizer = build_optimizer(model, optim)
        variants.append(Variant(f"pilotrun {'compiled' if compiled else 'eager'}", model, [optimizer],
                                pilotrun_loss, tokens))
    pilotrun_ns = newton_schulz_flops(
        [p for g in optimizer.param_groups if g["use_muon"] for p in g["params"]]
    )
    for compiled in (False, True):
        torch.manual_seed(0)
        reference = ReferenceGPT(VOCAB, cfg.d_model, cfg.n_layers, cfg.n_heads, hidden)
        model = torch.compile(reference) if compiled else reference
        variants.append(Variant(f"reference {'compiled' if compiled else 'eager'}", model,
                                reference_optimizers(reference, optim), reference_loss, tokens))
    torch.manual_seed(0)
    moe = moe_reference.ReferenceMoE(cfg)
    moe_matrices = moe_reference.muon_matrices(moe)
    variants.append(Variant("MoE reference eager", moe, reference_optimizers(moe, optim, moe_matrices),
                            reference_loss, tokens))
    ours = [p for g in optimizer.param_groups if g["use_muon"] for p in g["params"]]
    if moe_reference.muon_shapes(moe_matrices) != moe_reference.muon_shapes(ours):
        raise AssertionError("the MoE reference's Muon matrices are not pilotrun's")  # it would be unfair
    shape = {
        "size": size.name,
        "d_model": cfg.d_model,
        "layers": cfg.n_layers,
        "batch": size.batch,
        "seq": size.seq,
        "pilotrun_active_matmul_parameters": matmul,
        "reference_matmul_parameters": reference_matmul_parameters(reference),
        "reference_hidden": hidden,
        "pilotrun_flops_per_token": flops_per_token(cfg, size.seq),
        "reference_flops_per_token": reference_flops_per_token(reference, size.seq),
        "pilotrun_parameters": sum(p.numel() for p in variants[0].model.parameters()),
        "reference_parameters": sum(p.numel() for p in reference.parameters()),
        "pilotrun_newton_schulz_flops": pilotrun_ns,
        "reference_newton_schulz_flops": newton_schulz_flops(
            [p for name, p in reference.named_parameters() if p.ndim == 2 and name.startswith("layers.")]
        ),
        "moe_reference_parameters": sum(p.numel() for p in moe.parameters()),
        "moe_reference_newton_schulz_flops": newton_schulz_flops(moe_matrices),
    }
    if nanochat is not None:
        # As shipped first: its first updates then pay the compilation of nanochat's optimizer step functions
        # too (module-level, shared by both variants), so its compile cost is all that compiling costs
        # nanochat.
        for name in ("nanochat as shipped", "nanochat eager"):
            torch.manual_seed(0)
            model, optimizers, extra = nanochat_adapter.build(
                nanochat, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, vocab=VOCAB,
                seq=size.seq, target_matmul=matmul)
            # As its training script does: the whole model compiled, shapes fixed.
            compiled_model = torch.compile(model, dynamic=False) if name.endswith("shipped") else model
            variants.append(Variant(name, compiled_model, optimizers, nanochat_adapter.loss, tokens))
        shape.update(extra, nanochat_newton_schulz_flops=newton_schulz_flops(
            [p for p in model.transformer.h.parameters() if p.ndim == 2]))
    return variants, shape


# Each compiled variant and the eager one its compile cost and speedup are measured against.
COMPILED_PAIRS = (("pilotrun compiled", "pilotrun eager"), ("reference compiled", "reference eager"),
                  ("nanochat as shipped", "nanochat eager"))


def measure(size: Size, nanochat: nanochat_adapter.Nanochat | None = None) -> dict:
    variants, shape = build_variants(size, nanochat)
    # pilotrun's CPU default orthogonalises in fp32: the same for both
    with torch_muon_with_fp32_newton_schulz():
        return time_variants(variants, shape, size)


def time_variants(variants: list[Variant], shape: dict, size: Size) -> dict:
    for variant in variants:  # the first updates: warm-up, and a compiled variant's compilation
        variant.first_updates = sum(variant.update(timed=False) for _ in range(size.warmup))
    for index in range(size.rounds):
        shift = index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            variant.update(timed=True)
    figures = {variant.name: variant.figures() for variant in variants}
    for compiled_name, eager_name in COMPILED_PAIRS:
        if compiled_name not in figures:
            continue
        eager, compiled = figures[eager_name], figures[compiled_name]
        saving_s = (eager["update_ms"] - compiled["update_ms"]) / 1e3
        compile_s = compiled["first_updates_s"] - eager["first_updates_s"]
        compiled["speedup"] = eager["update_ms"] / compiled["update_ms"]
        compiled["compile_s"] = compile_s
        compiled["payback_updates"] = compile_s / saving_s if saving_s > 0 else None
    return {**shape, "rounds": size.rounds, "figures": figures}


def markdown(results: list[dict]) -> str:
    lines = [
        "## The whole update against a reference of equal work (torch modules, torch.optim.Muon)",
        "",
        "Per update, CPU ms of one torch thread, median over interleaved rounds (order rotated each round). "
        "The"
        " reference is a dense SwiGLU GPT of torch modules with torch.optim.Muon + AdamW(foreach), its MLP "
        "width"
        " set so that its matmul parameters equal pilotrun's active ones; compiled = `train.compile=inductor`"
        " for pilotrun (each decoder block compiled, and the final norm, head and loss as one graph),"
        " `torch.compile(model)` for the reference.",
        "",
    ]
    for result in results:
        f = result["figures"]
        lines += (
            [
                f"### {result['size']}: d {result['d_model']}, {result['layers']} layers, batch "
                f"{result['batch']}"
                f" x seq {result['seq']}, {result['rounds']} rounds",
                "",
                f"Matmul parameters per token: pilotrun {result['pilotrun_active_matmul_parameters']:,} "
                "active,"
                f" reference {result['reference_matmul_parameters']:,} (MLP width "
                f"{result['reference_hidden']});"
                f" FLOP per token {result['pilotrun_flops_per_token']:,.0f} vs"
                f" {result['reference_flops_per_token']:,.0f}. Total parameters "
                f"{result['pilotrun_parameters']:,}"
                f" vs {result['reference_parameters']:,}; Newton-Schulz per optimizer step"
                f" {result['pilotrun_newton_schulz_flops'] / 1e9:.2f} vs"
                f" {result['reference_newton_schulz_flops'] / 1e9:.2f} GFLOP (the step's work follows the "
                "total"
                " parameters: every expert is orthogonalised each step).",
                "",
            ]
            + nanochat_shape(result)
            + [
                "| variant | update ms | fwd+bwd ms | optimizer step ms | step share | compiled speedup |"
                " compile s | pays back after |",
                "|---|---:|---:|---:|---:|---:|---:|---:|",
            ]
        )
        for name, v in f.items():
            speed = f"{v['speedup']:.2f}x" if "speedup" in v else ""
            # The compile cost is a difference of two first-update timings; where the compiled side's came out
            # no slower, the cost is below what two warm-up updates can resolve, not negative.
            unresolved = "compile_s" in v and v["compile_s"] <= 0
            compile_s = (
                "" if "compile_s" not in v else "under the noise" if unresolved else f"{v['compile_s']:.1f}"
            )
            payback = ("" if "compile_s" not in v else "never (slower)" if v["payback_updates"] is None
                       else "at once" if unresolved else f"{v['payback_updates']:,.0f} updates")
            lines.append(
                f"| {name} | {v['update_ms']:.1f} | {v['forward_backward_ms']:.1f} | {v['step_ms']:.1f} |"
                f" {v['step_ms'] / v['update_ms']:.0%} | {speed} | {compile_s} | {payback} |"
            )
        ours, ref = f["pilotrun eager"], f["reference eager"]
        best_ref = min(f["reference eager"]["update_ms"], f["reference compiled"]["update_ms"])
        best_ours = min(ours["update_ms"], f["pilotrun compiled"]["update_ms"])
        update_ratio = best_ours / best_ref
        step_ratio = ours["step_ms"] / ref["step_ms"]
        flops_ratio = result["reference_newton_schulz_flops"] / result["pilotrun_newton_schulz_flops"]
        lines += [
            "",
            f"pilotrun / reference, each at its faster setting: update {update_ratio:.2f}x (goal <="
            f" {TARGET_UPDATE_OVER_REFERENCE:.1f}x: "
            f"{'met' if update_ratio <= TARGET_UPDATE_OVER_REFERENCE else 'NOT met'});"
            f" eager forward+backward {ours['forward_backward_ms'] / ref['forward_backward_ms']:.2f}x; eager"
            f" optimizer step {step_ratio:.2f}x, per Newton-Schulz FLOP"
            f" {step_ratio * flops_ratio:.2f}x"
            f" (goal <= {TARGET_STEP_OVER_REFERENCE:.1f}x:"
            f" {'met' if step_ratio <= TARGET_STEP_OVER_REFERENCE else 'NOT met'}); pilotrun compiled over "
            "eager"
            f" {f['pilotrun compiled']['speedup']:.2f}x (goal >= {TARGET_COMPILED_SPEEDUP:.1f}x:"
            f" {'met' if f['pilotrun compiled']['speedup'] >= TARGET_COMPILED_SPEEDUP else 'NOT met'}).",
        ]
        lines += moe_ratios(result) + nanochat_ratios(f) + [""]
    lines += [
        "Command: `python -m benchmarks.run_all bench_update` (figures as JSON: `python -m"
        " benchmarks.bench_update --json`; with nanochat: `python -m benchmarks.bench_update --nanochat "
        "PATH`).",
        "",
    ]
    return "\n".join(lines)


def moe_ratios(result: dict) -> list[str]:
    """pilotrun against the MoE of identical total matrices (benchmarks/moe_reference.py), both eager."""
    f = result["figures"]
    if "MoE reference eager" not in f:
        return []
    ours, theirs = f["pilotrun eager"], f["MoE reference eager"]
    update_ratio = ours["update_ms"] / theirs["update_ms"]
    return [
        "",
        f"pilotrun eager / the MoE reference of identical total matrices (eager: torch modules, per-expert "
        f"2-D weights, torch.optim.Muon; {result['moe_reference_parameters']:,} parameters, Newton-Schulz "
        f"{result['moe_reference_newton_schulz_flops'] / 1e9:.2f} GFLOP per step, as pilotrun's): update "
        f"{update_ratio:.2f}x (goal <= {TARGET_UPDATE_OVER_REFERENCE:.1f}x: "
        f"{'met' if update_ratio <= TARGET_UPDATE_OVER_REFERENCE else 'NOT met'}); forward+backward "
        f"{ours['forward_backward_ms'] / theirs['forward_backward_ms']:.2f}x; optimizer step "
        f"{ours['step_ms'] / theirs['step_ms']:.2f}x.",
    ]


def nanochat_shape(result: dict) -> list[str]:
    """How nanochat's model was set up against the other two, where the run had one."""
    if "nanochat_hidden" not in result:
        return []
    commit = f" at {result['nanochat_commit']}" if result["nanochat_commit"] else ""
    return [
        f"nanochat (the checkout given by `--nanochat`{commit}): its GPT with its MLP width set to"
        f" {result['nanochat_hidden']} (shipped: relu^2 at {result['nanochat_shipped_hidden']}, which its "
        "config"
        " cannot change: the adapter replaces the two MLP projections with its own Linear class at that width"
        " before its `init_weights`), every layer attending to the full causal context, compute dtype"
        f" {result['nanochat_compute_dtype']}; matmul parameters per token "
        f"{result['nanochat_matmul_parameters']:,},"
        f" FLOP per token {result['nanochat_flops_per_token']:,.0f}, total parameters"
        f" {result['nanochat_parameters']:,}, Newton-Schulz per optimizer step"
        f" {result['nanochat_newton_schulz_flops'] / 1e9:.2f} GFLOP; its optimizers as its own set-up returns"
        f" them ({', '.join(result['nanochat_optimizers'])}: the same in both variants, whatever of their "
        "step"
        " its own code compiles compiled). As shipped = `torch.compile(model, dynamic=False)`, as its "
        "training"
        " script does (its compile s includes its optimizer's compilation, which the eager variant then "
        "reuses);"
        " eager = the model uncompiled.",
        "",
    ]


def nanochat_ratios(f: dict) -> list[str]:
    """pilotrun at its faster setting over nanochat as shipped, per phase: what the speed goal is stated
    against."""
    if "nanochat as shipped" not in f:
        return []
    name = min(("pilotrun eager", "pilotrun compiled"), key=lambda n: f[n]["update_ms"])
    ours, theirs = f[name], f["nanochat as shipped"]
    return [
        "",
        f"pilotrun ({name.split()[1]}, its faster setting) / nanochat as shipped: update"
        f" {ours['update_ms'] / theirs['update_ms']:.2f}x (goal <= {TARGET_UPDATE_OVER_REFERENCE:.1f}x:"
        " "
        f"{'met' if ours['update_ms'] <= TARGET_UPDATE_OVER_REFERENCE * theirs['update_ms'] else 'NOT met'});"
        f" forward+backward {ours['forward_backward_ms'] / theirs['forward_backward_ms']:.2f}x; optimizer "
        "step"
        f" {ours['step_ms'] / theirs['step_ms']:.2f}x.",
    ]


def run(
    sizes: tuple[str, ...] = ("stability", "large"), nanochat: nanochat_adapter.Nanochat | None = None
) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return markdown([measure(SIZES[name], nanochat) for name in sizes])
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="stability,large", help="comma-separated: stability, large")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of Markdown")
    parser.add_argument(
        "--nanochat", metavar="PATH", help="a checkout of nanochat to compare with (optional)"
    )
    args = parser.parse_args(argv)
    sizes = tuple(s for s in args.sizes.split(",") if s)
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.exit(2, f"bench_update: unknown size {', '.join(unknown)} (known: {', '.join(SIZES)})\n")
    torch.set_num_threads(1)
    # a checkout whose API does not match is refused before or while its model is built, before any output
    try:
        nanochat = nanochat_adapter.load(args.nanochat) if args.nanochat else None
        text = json.dumps([measure(SIZES[name], nanochat) for name in sizes], indent=1) if args.json else run(
            sizes, nanochat)
    except nanochat_adapter.NanochatError as error:
        parser.exit(2, f"bench_update: {error}\n")
    print(text)


if __name__ == "__main__":
    main()
