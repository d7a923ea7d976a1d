"""Where one forward + backward spends its time, part by part: pilotrun's model against nanochat's at equal
active work (the sizes and models of bench_update), eager and compiled, side by side in one process.

A part is a submodule that every layer has (pilotrun: each block's MLA attention, its dense FFN or MoE layer,
and the output head's matmul; nanochat: each block's attention and MLP, and its lm_head). One forward of the
whole model records each part's inputs (a forward hook); each part is then timed alone, forward + backward
on those inputs (as leaves that need a gradient, so that its input gradient is computed as in the model), its
output's gradient a fixed random tensor. "The rest" is what the whole model's forward + backward takes beyond
its parts: the norms outside them, residual adds, the embedding, the loss (softmax and cross-entropy), and for
nanochat its extras (value embeddings, smear, the per-layer residual scalars, the logit soft-cap). Compiled:
each part by `torch.compile(part)` and the whole model as `train.compile=inductor` compiles it (pilotrun: each
block, and the final norm, head and loss as one graph) and as nanochat's training script does
(`torch.compile(model, dynamic=False)`); pilotrun's MoE layers run eagerly with their CPU kernels there
(moe.py), so their compiled figure is their eager one plus the cost of the break.

Rounds interleave every timed function and rotate their order; CPU seconds of this process on one torch
thread, medians. Beside each part its matmul work (forward + backward: 6 x tokens x the matmul weights a token
uses, plus attention's Q K^T and P V over the causal (T+1)/2 keys on average, as accounting.py counts it), so
that a ratio of times can be read against the ratio of work: a part slower by its extra work alone does the
same per FLOP; one slower beyond it pays overhead.
`python -m benchmarks.bench_fwdbwd_parts --nanochat PATH [--sizes stability,large] [--rounds N]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from benchmarks import nanochat_adapter
from benchmarks.bench_update import SIZES, VOCAB, Size, pilotrun_loss
from pilotrun.model.accounting import active_matmul_parameters
from pilotrun.model.presets import model_preset
from pilotrun.model.transformer import build_model, compile_blocks_and_output

clock = time.process_time


def pilotrun_parts(model: nn.Module) -> dict[str, list[nn.Module]]:
    """pilotrun's parts by kind, each with every layer's instance."""
    return {
        "attention": [block.attn for block in model.layers],
        "dense FFN": [block.ffn for block in model.layers if not block.is_moe],
        "MoE layer": [block.ffn for block in model.layers if block.is_moe],
        "head matmul": [model.head],
    }


def nanochat_parts(model: nn.Module) -> dict[str, list[nn.Module]]:
    """nanochat's parts by kind (its blocks in transformer.h, each with attn and mlp; lm_head)."""
    blocks = model.transformer.h
    return {"attention": [b.attn for b in blocks], "MLP": [b.mlp for b in blocks],
            "head matmul": [model.lm_head]}


def matmul_weights(module: nn.Module) -> int:
    """The matmul weights one token multiplies by in this part: every 2-D weight, and of a MoE layer's
    stacked routed experts the top_k it chooses."""
    count = sum(p.numel() for p in module.parameters() if p.ndim == 2)
    experts = getattr(module, "experts", None)
    if experts is not None:
        one = sum(w[0].numel() for w in (experts.w1, experts.w2, experts.w3))
        count += module.top_k * one
    return count


def part_flops(module: nn.Module, kind: str, batch: int, seq: int) -> float:
    """Forward + backward matmul FLOP of one part instance on batch x seq tokens."""
    tokens = batch * seq
    flops = 6.0 * tokens * matmul_weights(module)
    if kind == "attention":
        if hasattr(module, "qk_head_dim"):  # MLA: d_qk = d_n + d_r per head for Q K^T, d_v for P V
            per_key = module.n_heads * (module.qk_head_dim + module.v_head_dim)
        else:  # nanochat: head_dim for both
            per_key = 2 * module.n_head * module.head_dim
        flops += 6.0 * tokens * per_key * (seq + 1) / 2
    return flops


def recorded_inputs(model: nn.Module, parts: dict[str, list[nn.Module]], run_model: Callable) -> dict:
    """Each part instance's (args, kwargs) from one forward of the whole model."""
    seen: dict[int, tuple] = {}

    def record(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        seen.setdefault(id(module), (args, kwargs))

    hooks = [module.register_forward_hook(record, with_kwargs=True)
             for modules in parts.values() for module in modules]
    try:
        with torch.no_grad():
            run_model()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def as_leaf(value):
    """A float tensor as a fresh leaf that needs a gradient (the part's input gradient is then computed);
    anything else as it is."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().clone().requires_grad_(True)
    return value


def part_step(module: nn.Module, args: tuple, kwargs: dict, compiled: bool) -> Callable[[], None]:
    """One forward + backward of the part on its recorded inputs."""
    call = torch.compile(module) if compiled else module
    args = tuple(as_leaf(a) for a in args)
    kwargs = {k: as_leaf(v) for k, v in kwargs.items()}
    first = module(*args, **kwargs)
    first = first[0] if isinstance(first, tuple) else first
    grad = torch.randn(first.shape, generator=torch.Generator().manual_seed(3)).to(first.dtype)

    def step() -> None:
        out = call(*args, **kwargs)
        (out[0] if isinstance(out, tuple) else out).backward(grad)

    return step


# Compiled alternatives to two of pilotrun's part kinds, timed beside them: a model setting under which
# torch.compile traces the part another way. The MoE layer through its reference operators (no CPU kernels:
# the whole layer in the block's graph, where the kernels run eagerly behind a graph break), and MLA through
# scaled_dot_product_attention (the fused kernel nanochat's attention runs on the CPU) instead of the
# materialized logits.
ALTERNATIVES = {
    "MoE layer": ("traced through the reference operators (model.cpu_kernels=false)", {"cpu_kernels": False}),
    "attention": ("scaled_dot_product_attention (model.attn_impl=sdpa)", {"attn_impl": "sdpa"}),
}


def alternative_steps(model: nn.Module, inputs: dict) -> dict[str, list[Callable[[], None]]]:
    """{kind: compiled steps of every layer's part} for each of ALTERNATIVES, on a copy of the model built
    with the alternative setting and pilotrun's weights, each part on the inputs its original had."""
    steps = {}
    for kind, (_, changes) in ALTERNATIVES.items():
        copy = build_model(dataclasses.replace(model.cfg, **changes)).train()
        copy.load_state_dict(model.state_dict())
        originals, copies = pilotrun_parts(model)[kind], pilotrun_parts(copy)[kind]
        steps[kind] = [part_step(other, *inputs[id(original)], compiled=True)
                       for original, other in zip(originals, copies)]
    return steps


def timed_functions(size: Size, nanochat: nanochat_adapter.Nanochat | None) -> tuple[dict, dict, dict]:
    """{(model, kind, setting): [steps]} for every part instance (and pilotrun's ALTERNATIVES as
    ("pilotrun", kind, ALTERNATIVE)), {(model, setting): step} for the whole models, and {(model, kind):
    matmul FLOP of all its instances}."""
    cfg = model_preset(size.preset, vocab_size=VOCAB, init_std=0.02, **size.changes)
    tokens = torch.randint(0, VOCAB, (size.batch, size.seq + 1), generator=torch.Generator().manual_seed(0))
    models = {}
    torch.manual_seed(0)
    models["pilotrun"] = (build_model(cfg).train(), pilotrun_parts, pilotrun_loss)
    if nanochat is not None:
        torch.manual_seed(0)
        chat, _, _ = nanochat_adapter.build(nanochat, d_model=cfg.d_model, n_layers=cfg.n_layers,
                                            n_heads=cfg.n_heads, vocab=VOCAB, seq=size.seq,
                                            target_matmul=active_matmul_parameters(cfg))
        models["nanochat"] = (chat, nanochat_parts, nanochat_adapter.loss)
    parts, wholes, flops = {}, {}, {}
    for name, (model, kinds, loss) in models.items():
        by_kind = kinds(model)
        inputs = recorded_inputs(model, by_kind, lambda m=model, f=loss: f(m, tokens))
        for kind, modules in by_kind.items():
            flops[(name, kind)] = sum(part_flops(m, kind, size.batch, size.seq) for m in modules)
        for setting in ("eager", "compiled"):
            for kind, modules in by_kind.items():
                parts[(name, kind, setting)] = [
                    part_step(m, *inputs[id(m)], compiled=setting == "compiled") for m in modules
                ]
            wholes[(name, setting)] = whole_step(name, model, loss, tokens, setting == "compiled")
        if name == "pilotrun":
            for kind, steps in alternative_steps(model, inputs).items():
                parts[(name, kind, ALTERNATIVE)] = steps
            wholes.update(graph_break_steps(model, lambda m=model, f=loss: f(m, tokens)))
    wholes[("pilotrun", ONE_REGION)] = one_region_step(models["pilotrun"][0], tokens)
    return parts, wholes, flops


BREAK, TRACED = "behind the break", "traced"  # the two compiled MoE blocks of graph_break_steps
BREAK_ROUNDS = 15  # the fewest interleaved rounds the two blocks are timed in (measure)


def stand_in_layer(moe: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer's place-holder of next to no cost: its input times one router weight, no auxiliary loss."""
    return x * moe.gate.weight[0, 0], x.new_zeros(())


def graph_break_steps(model: nn.Module, run_model: Callable) -> dict:
    """{("MoE block", BREAK | TRACED): step}: two compiled copies of the first MoE block whose layer is the
    stand-in (stand_in_layer), run eagerly behind a graph break as the CPU kernels run (BREAK), or traced into
    the block's graph as the reference operators are (TRACED), each forward + backward on the block's input in
    the model. Their difference is what the break costs a block: the most that making the kernels traceable
    (one graph per block, the kernels inside it as opaque operators) could save."""
    index = next(i for i, block in enumerate(model.layers) if block.is_moe)
    (args, _), = recorded_inputs(model, {"block": [model.layers[index]]}, run_model).values()
    steps = {}
    for name, traced in ((BREAK, False), (TRACED, True)):
        copy = build_model(model.cfg).train()
        copy.load_state_dict(model.state_dict())
        block = copy.layers[index]
        block.ffn.forward_layer = functools.partial(stand_in_layer, block.ffn)
        block.ffn.cpu_kernels = not traced  # off: MoE.forward no longer steps out of the graph
        steps[("MoE block", name)] = part_step(block, args, {}, compiled=True)
    return steps


ALTERNATIVE = "compiled alternative"  # the setting under which parts holds ALTERNATIVES' steps
ONE_REGION = "one region"  # pilotrun's whole model under one torch.compile, against the per-block compile


def one_region_step(model: nn.Module, tokens: torch.Tensor) -> Callable[[], None]:
    """pilotrun's whole model compiled as one region (`model.compile(dynamic=False)`), on a copy: Dynamo
    breaks its graph where an MoE layer runs eagerly (moe.py) and goes on in the blocks' own frames."""
    copy = build_model(model.cfg).train()
    copy.load_state_dict(model.state_dict())
    copy.compile(backend="inductor", dynamic=False)
    return lambda: pilotrun_loss(copy, tokens).backward()


def whole_step(name: str, model: nn.Module, loss: Callable, tokens: torch.Tensor,
               compiled: bool) -> Callable[[], None]:
    """The whole model's forward + backward; compiled as each project compiles it, on a copy of the model so
    that the eager parts keep theirs."""
    if compiled:
        copy = build_model(model.cfg).train() if name == "pilotrun" else model
        if name == "pilotrun":
            copy.load_state_dict(model.state_dict())
            compile_blocks_and_output(copy, "inductor")
        else:
            copy = torch.compile(model, dynamic=False)
        return lambda: loss(copy, tokens).backward()
    return lambda: loss(model, tokens).backward()


def interleaved_medians(functions: dict, rounds: int, warmup: int) -> dict:
    """Median CPU ms of each function over interleaved rounds (order rotated each round)."""
    for function in functions.values():
        for _ in range(warmup):
            function()
    names = list(functions)
    times: dict = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            start = clock()
            functions[name]()
            times[name].append(clock() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


# Which of nanochat's parts does the work of which of pilotrun's.
ROWS = (("attention", ("attention",), ("attention",)), ("FFN", ("dense FFN", "MoE layer"), ("MLP",)),
        ("head matmul", ("head matmul",), ("head matmul",)))


def measure(size: Size, nanochat: nanochat_adapter.Nanochat | None, rounds: int) -> dict:
    """Per (model, setting): ms per row of ROWS, the rest and the whole, and per part kind its instances."""
    parts, wholes, flops = timed_functions(size, nanochat)
    functions = {("whole", *key): step for key, step in wholes.items()}
    for key, steps in parts.items():
        functions.update({("part", *key, index): step for index, step in enumerate(steps)})
    breaks = {key: functions.pop(key) for key in list(functions) if key[1] == "MoE block"}
    medians = interleaved_medians(functions, rounds, size.warmup)
    # The two blocks differ by a few percent: timed apart, in rounds of their own, at least BREAK_ROUNDS of
    # them, so that the other functions' cost swings do not land between them.
    medians.update(interleaved_medians(breaks, max(rounds, BREAK_ROUNDS), size.warmup))
    figures: dict = {}
    for model, setting in [key for key in wholes if key[0] != "MoE block" and key[1] != ONE_REGION]:
        kinds = {kind: sum(medians[("part", m, kind, s, index)] for index in range(len(steps)))
                 for (m, kind, s), steps in parts.items() if m == model and s == setting}
        whole = medians[("whole", model, setting)]
        column = {"whole": whole, "kinds": kinds, "counts": {kind: len(parts[(model, kind, setting)])
                                                             for kind in kinds}}
        side = 1 if model == "pilotrun" else 2
        for row, *names in ROWS:
            column[row] = sum(kinds.get(kind, 0.0) for kind in names[side - 1])
            column[f"{row} GFLOP"] = sum(flops.get((model, kind), 0.0) for kind in names[side - 1]) / 1e9
        column["rest"] = whole - sum(kinds.values())
        figures[(model, setting)] = column
    figures[("pilotrun", "compiled")]["one region"] = medians[("whole", "pilotrun", ONE_REGION)]
    figures[("pilotrun", "compiled")]["break"] = {name: medians[("whole", "MoE block", name)]
                                                  for name in (BREAK, TRACED)}
    alternatives = {kind: sum(medians[("part", m, kind, s, index)] for index in range(len(steps)))
                    for (m, kind, s), steps in parts.items() if s == ALTERNATIVE}
    return {"size": size, "rounds": rounds, "figures": figures, "alternatives": alternatives}


def cell(figures: dict, model: str, setting: str, row: str) -> str:
    column = figures.get((model, setting))
    return "" if column is None else f"{column[row]:.1f}"


def ratio(figures: dict, setting: str, row: str) -> str:
    ours, theirs = figures.get(("pilotrun", setting)), figures.get(("nanochat", setting))
    if ours is None or theirs is None or theirs[row] <= 0:
        return ""
    return f"{ours[row] / theirs[row]:.2f}x"


def work(figures: dict, row: str) -> str:
    """The row's matmul GFLOP of each model and their ratio (two cells), where both have the row."""
    ours, theirs = figures.get(("pilotrun", "eager")), figures.get(("nanochat", "eager"))
    key = f"{row} GFLOP"
    if ours is None or theirs is None or key not in ours or theirs[key] <= 0:
        return " | "
    return f"{ours[key]:.2f} / {theirs[key]:.2f} | {ours[key] / theirs[key]:.2f}x"


def per_flop(figures: dict, row: str) -> str:
    """Compiled time ratio over work ratio: 1.00x where pilotrun's part is slower by its extra work alone."""
    ours, theirs = figures.get(("pilotrun", "compiled")), figures.get(("nanochat", "compiled"))
    key = f"{row} GFLOP"
    if ours is None or theirs is None or key not in ours or min(theirs[key], theirs[row], ours[key]) <= 0:
        return ""
    return f"{(ours[row] / theirs[row]) / (ours[key] / theirs[key]):.2f}x"


def gap_lines(figures: dict) -> list[str]:
    """pilotrun at its faster setting against nanochat as shipped (compiled), and where the difference
    sits."""
    theirs = figures.get(("nanochat", "compiled"))
    if theirs is None:
        return []
    setting = min(("eager", "compiled"), key=lambda s: figures[("pilotrun", s)]["whole"])
    ours = figures[("pilotrun", setting)]
    whole = ours["whole"] / theirs["whole"]
    rows = [r[0] for r in ROWS] + ["rest"]
    shares = ", ".join(f"{row} {ours[row] - theirs[row]:+.1f}" for row in rows)
    return ["", f"pilotrun ({setting}, its faster setting) / nanochat as shipped, forward+backward: "
            f"{whole:.2f}x "
            f"(goal <= 1.0x: {'met' if whole <= 1.0 else 'NOT met'}); the difference, "
            f"{ours['whole'] - theirs['whole']:+.1f} ms, by part (pilotrun {setting} less nanochat compiled, "
            f"ms): {shares}."]


def alternatives_line(compiled_kinds: dict, alternatives: dict) -> str:
    """Each compiled alternative's time (its part kind summed over its layers) against the part as
    `train.compile=inductor` runs it, in the same rounds."""
    figures = [f"the {kind} {ALTERNATIVES[kind][0]} {ms:.1f} ms, {ms / compiled_kinds[kind]:.2f}x its "
               f"{compiled_kinds[kind]:.1f}" for kind, ms in alternatives.items()]
    return ("Compiled alternatives, each part timed alone as above (ms summed over its layers, against the "
            "part as pilotrun compiles it): " + "; ".join(figures) + ".")


def break_line(block: dict, moe_layers: int, whole: float) -> str:
    """What the graph break at a MoE layer costs (graph_break_steps), per layer and over the model's."""
    cost = block[BREAK] - block[TRACED]
    total = moe_layers * cost
    return (f"The graph break at a MoE layer (two blocks timed in rounds of their own, at least "
            f"{BREAK_ROUNDS}): a compiled MoE block with a stand-in of next to no cost for its layer, run "
            f"eagerly behind the break as the CPU kernels run, {block[BREAK]:.2f} ms, traced "
            f"into the block's graph {block[TRACED]:.2f} ms: {cost:+.2f} ms a layer, "
            f"{total:+.1f} ms over its {moe_layers} MoE layers ({total / whole:+.1%} of the compiled whole), "
            "the most that making the kernels traceable could save.")


def markdown(results: list[dict]) -> str:
    lines = ["## Forward + backward part by part against nanochat (bench_fwdbwd_parts)", "",
             "CPU ms of one torch thread per forward + backward, medians over interleaved rounds; a part's "
             "figure is the sum over its layers, each timed alone on the inputs it had in the model; the "
             "rest "
             "= the whole model less its parts (norms outside the parts, residuals, embedding, loss; "
             "nanochat's extras: value embeddings, smear, residual scalars, soft-cap). Compiled: each part "
             "`torch.compile`d alone; the whole model as `train.compile=inductor` (pilotrun: each block, and "
             "the final norm, head and loss as one graph) and "
             "`torch.compile(model, dynamic=False)` (nanochat) compile it. The rest is a difference of "
             "separately timed medians: below zero where the parts timed alone cost more than inside a whole "
             "compiled graph. Work: matmul FLOP forward + backward, attention over the causal half for both "
             "(pilotrun's eager attention multiplies, per block of 128 query rows, the keys up to the "
             "block's last row and masks the rest; nanochat's flash kernel skips the masked blocks).", ""]
    for result in results:
        size, f = result["size"], result["figures"]
        lines += [f"### {size.name}: {size.preset} preset, batch {size.batch} x seq {size.seq}, "
                  f"{result['rounds']} rounds", "",
                  "| part | pilotrun eager ms | nanochat eager ms | ratio | pilotrun compiled ms | nanochat "
                  "compiled ms | ratio | matmul GFLOP pilotrun / nanochat | work ratio | compiled time per "
                  "FLOP ratio |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in [r[0] for r in ROWS] + ["rest", "whole"]:
            lines.append(
                f"| {row} | {cell(f, 'pilotrun', 'eager', row)} | {cell(f, 'nanochat', 'eager', row)} | "
                f"{ratio(f, 'eager', row)} | {cell(f, 'pilotrun', 'compiled', row)} | "
                f"{cell(f, 'nanochat', 'compiled', row)} | {ratio(f, 'compiled', row)} | "
                f"{work(f, row)} | {per_flop(f, row)} |")
        lines += gap_lines(f)
        compiled = f[("pilotrun", "compiled")]
        lines += ["", f"pilotrun's whole model as one compiled region (`model.compile(dynamic=False)`): "
                  f"{compiled['one region']:.1f} ms, {compiled['one region'] / compiled['whole']:.2f}x the "
                  "per-block compile of `train.compile=inductor` (Dynamo breaks the graph at each MoE layer, "
                  "which runs eagerly, and compiles the frames after it as they come)."]
        lines += ["", alternatives_line(compiled["kinds"], result["alternatives"]), "",
                  break_line(compiled["break"], compiled["counts"]["MoE layer"], compiled["whole"])]
        lines += ["", "Per part kind (ms summed over its layers, layers in brackets): " + "; ".join(
            f"{model} {setting}: " + ", ".join(f"{kind} [{column['counts'][kind]}] {ms:.1f}"
                                               for kind, ms in column["kinds"].items())
            for (model, setting), column in f.items()) + ".", ""]
    lines += ["Command: `python -m benchmarks.bench_fwdbwd_parts --nanochat PATH` (`python -m "
              "benchmarks.run_all bench_fwdbwd_parts --nanochat PATH`).", ""]
    return "\n".join(lines)


def run(sizes: tuple[str, ...] = ("stability", "large"), nanochat: nanochat_adapter.Nanochat | None = None,
        rounds: int | None = None) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return markdown([measure(SIZES[name], nanochat, rounds or SIZES[name].rounds) for name in sizes])
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="stability,large", help="comma-separated: stability, large")
    parser.add_argument("--rounds", type=int, default=0, help="interleaved rounds (default: the size's)")
    parser.add_argument("--nanochat", metavar="PATH", help="a checkout of nanochat to compare with")
    args = parser.parse_args(argv)
    sizes = tuple(s for s in args.sizes.split(",") if s)
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.exit(2, f"bench_fwdbwd_parts: unknown size {', '.join(unknown)} (known: {', '.join(SIZES)})\n")
    try:
        nanochat = nanochat_adapter.load(args.nanochat) if args.nanochat else None
    except nanochat_adapter.NanochatError as error:
        parser.exit(2, f"bench_fwdbwd_parts: {error}\n")
    print(run(sizes, nanochat, args.rounds or None))


if __name__ == "__main__":
    main()
