"""bench_fwdbwd_parts: the parts it times cover pilotrun's model, and their matmul work adds up to the model's
own FLOP count."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_fwdbwd_parts
from pilotrun.model.accounting import flops_per_token
from pilotrun.model.presets import model_preset
from pilotrun.model.transformer import build_model


@pytest.mark.parametrize("preset", ["tiny", "cpu"])
def test_the_parts_work_adds_up_to_the_models_flops_per_token(preset):
    cfg = model_preset(preset, vocab_size=256)
    model = build_model(cfg)
    parts = bench_fwdbwd_parts.pilotrun_parts(model)
    assert sum(len(modules) for kind, modules in parts.items() if kind != "head matmul") == 2 * cfg.n_layers
    batch, seq = 2, 16
    total = sum(bench_fwdbwd_parts.part_flops(m, kind, batch, seq) for kind, modules in parts.items()
                for m in modules)
    assert total == pytest.approx(flops_per_token(cfg, seq) * batch * seq, rel=1e-12)


def test_each_part_sees_the_inputs_it_had_in_the_model():
    cfg = model_preset("tiny", vocab_size=256)
    model = build_model(cfg).train()
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    parts = bench_fwdbwd_parts.pilotrun_parts(model)
    seen = bench_fwdbwd_parts.recorded_inputs(model, parts, lambda: model(tokens[:, :-1], tokens[:, 1:]))
    head_input = seen[id(model.head)][0][0]
    with torch.no_grad():
        x = model.embed(tokens[:, :-1])
        cos, sin = model.rope_cos[:16], model.rope_sin[:16]
        for block in model.layers:
            x, _ = block(x, cos, sin)
        assert torch.equal(head_input, model.norm(x))
    assert len(seen) == sum(len(modules) for modules in parts.values())


def column(whole, attention, ffn, head):
    return {"whole": whole, "attention": attention, "FFN": ffn, "head matmul": head,
            "rest": whole - attention - ffn - head, "attention GFLOP": 1.0, "FFN GFLOP": 2.2,
            "head matmul GFLOP": 1.0}


def test_the_goal_line_takes_pilotruns_faster_setting_against_nanochat_as_shipped():
    figures = {("pilotrun", "eager"): column(100.0, 30.0, 30.0, 20.0),
               ("pilotrun", "compiled"): column(90.0, 25.0, 30.0, 20.0),
               ("nanochat", "eager"): column(110.0, 25.0, 25.0, 20.0),
               ("nanochat", "compiled"): column(80.0, 22.0, 22.0, 20.0)}
    line = bench_fwdbwd_parts.gap_lines(figures)[1]
    assert line.startswith("pilotrun (compiled, its faster setting) / nanochat as shipped, forward+backward: "
                           "1.12x (goal <= 1.0x: NOT met); the difference, +10.0 ms")
    assert line.endswith("attention +3.0, FFN +8.0, head matmul +0.0, rest -1.0.")
    # FFN: 30/22 = 1.36x the time at 2.2/2.2 the work; attention 25/22 at equal work
    assert bench_fwdbwd_parts.per_flop(figures, "FFN") == "1.36x"
    assert bench_fwdbwd_parts.per_flop(figures, "attention") == "1.14x"
    figures[("pilotrun", "eager")] = column(79.0, 20.0, 20.0, 20.0)
    assert "/ nanochat as shipped, forward+backward: 0.99x (goal <= 1.0x: met)" in (
        bench_fwdbwd_parts.gap_lines(figures)[1])


def test_the_compiled_alternatives_run_the_setting_they_name_on_the_original_inputs(monkeypatch):
    cfg = model_preset("tiny", vocab_size=256)
    model = build_model(cfg).train()
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    parts = bench_fwdbwd_parts.pilotrun_parts(model)
    inputs = bench_fwdbwd_parts.recorded_inputs(model, parts, lambda: model(tokens[:, :-1], tokens[:, 1:]))
    built = []
    monkeypatch.setattr(bench_fwdbwd_parts, "part_step",
                        lambda module, args, kwargs, compiled: built.append((module, args, compiled)))
    steps = bench_fwdbwd_parts.alternative_steps(model, inputs)
    assert {kind: len(s) for kind, s in steps.items()} == {"MoE layer": 1, "attention": 2}
    moe, attention = built[0][0], built[1][0]
    assert moe.cpu_kernels is False and model.layers[1].ffn.cpu_kernels is True
    assert attention.attn_impl == "sdpa" and all(compiled for _, _, compiled in built)
    assert built[0][1] is inputs[id(model.layers[1].ffn)][0]  # the original part's recorded input
    assert torch.equal(moe.experts.w1, model.layers[1].ffn.experts.w1)


def test_the_alternatives_line_compares_each_with_the_part_as_compiled():
    line = bench_fwdbwd_parts.alternatives_line({"MoE layer": 20.0, "attention": 10.0},
                                                {"MoE layer": 30.0, "attention": 9.0})
    assert ("MoE layer traced through the reference operators (model.cpu_kernels=false) 30.0 ms, 1.50x its "
            "20.0") in line
    assert "attention scaled_dot_product_attention (model.attn_impl=sdpa) 9.0 ms, 0.90x its 10.0" in line


def test_the_graph_break_blocks_differ_only_in_whether_the_stand_in_leaves_the_graph(monkeypatch):
    cfg = model_preset("tiny", vocab_size=256)
    model = build_model(cfg).train()
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    built = []
    monkeypatch.setattr(bench_fwdbwd_parts, "part_step",
                        lambda module, args, kwargs, compiled: built.append((module, args, compiled)))
    steps = bench_fwdbwd_parts.graph_break_steps(model, lambda: model(tokens[:, :-1], tokens[:, 1:]))
    assert list(steps) == [("MoE block", bench_fwdbwd_parts.BREAK), ("MoE block", bench_fwdbwd_parts.TRACED)]
    (behind_break, args, compiled), (traced, _, _) = built
    assert compiled and behind_break.is_moe and traced.is_moe
    x = args[0]
    for block in (behind_break, traced):
        output, aux = block.ffn.forward_layer(x)
        assert torch.equal(output, x * model.layers[1].ffn.gate.weight[0, 0]) and aux == 0
    # the block that steps out of the graph is the one whose MoE layer would take the CPU kernels
    assert behind_break.ffn.kernels_may_apply(x) and not traced.ffn.kernels_may_apply(x)


def test_the_break_line_says_the_cost_per_layer_and_of_the_whole():
    line = bench_fwdbwd_parts.break_line({bench_fwdbwd_parts.BREAK: 5.25, bench_fwdbwd_parts.TRACED: 5.0}, 3,
                                         75.0)
    assert "behind the break as the CPU kernels run, 5.25 ms, traced into the block's graph 5.00 ms" in line
    assert "+0.25 ms a layer, +0.8 ms over its 3 MoE layers (+1.0% of the compiled whole)" in line
