"""bench_optim's comparison with nanochat's own Muon: without a checkout nothing of nanochat is imported and
the subsection says it was not measured; with one (a minimal stand-in of nanochat's API written here, no
network), nanochat's optimizer receives pilotrun's Muon matrices one for one, each expert slice its own 2-D
matrix with its own gradient, one group per shape, and both optimizers step in the same alternating rounds."""

from __future__ import annotations

import inspect
import sys
import textwrap

import torch

from benchmarks import bench_optim, nanochat_adapter

# What benchmarks.nanochat_adapter.load checks in gpt.py: a GPTConfig dataclass with its size fields and a GPT
# with setup_optimizer (this benchmark builds no nanochat model).
FAKE_GPT = textwrap.dedent('''
    from dataclasses import dataclass


    @dataclass
    class GPTConfig:
        sequence_len: int = 64
        vocab_size: int = 256
        n_layer: int = 2
        n_head: int = 2
        n_embd: int = 32


    class GPT:
        def setup_optimizer(self):
            raise NotImplementedError
''')

# nanochat's MuonAdamW as this benchmark uses it: param groups of kind "muon" whose parameters share one
# shape, and step() (here a plain signed-gradient step, which asserts the groups are built that way).
FAKE_OPTIM = textwrap.dedent('''
    import torch


    class MuonAdamW(torch.optim.Optimizer):
        def __init__(self, param_groups):
            super().__init__(param_groups, defaults={})

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                assert group["kind"] == "muon"
                assert len({p.shape for p in group["params"]}) == 1
                for p in group["params"]:
                    p.sub_(group["lr"] * p.grad.sign())
''')

TINY = bench_optim.NanochatSize("tiny", "tiny", {}, rounds=2, warmup=1)


def fake_checkout(root):
    (root / "nanochat").mkdir(parents=True)
    (root / "nanochat" / "__init__.py").write_text("")
    (root / "nanochat" / "gpt.py").write_text(FAKE_GPT)
    (root / "nanochat" / "optim.py").write_text(FAKE_OPTIM)
    return nanochat_adapter.load(root)


def test_without_a_checkout_the_subsection_says_not_measured_and_imports_nothing_of_nanochat():
    before = {name for name in sys.modules if name.split(".")[0] == "nanochat"}
    text = bench_optim.nanochat_subsection(None)
    assert text.startswith(bench_optim.NANOCHAT_HEADING + "\n") and "Not measured in this run" in text
    assert {name for name in sys.modules if name.split(".")[0] == "nanochat"} == before
    # run_all hands its --nanochat checkout to a benchmark whose run() names the parameter
    assert "nanochat" in inspect.signature(bench_optim.run).parameters


def test_nanochat_gets_pilotruns_matrices_one_for_one_grouped_by_shape(tmp_path):
    optim_module = bench_optim.nanochat_optim_module(fake_checkout(tmp_path))
    groups = bench_optim.muon_groups_with_gradients(TINY)
    theirs = bench_optim.nanochat_muon(optim_module, groups)
    slices = [(m, g) for group in groups for p in group["params"]
              for m, g in zip(p.detach().reshape(-1, *p.shape[-2:]), p.grad.reshape(-1, *p.shape[-2:]),
                              strict=True)]
    given = sorted((p for group in theirs.param_groups for p in group["params"]), key=lambda p: p.shape)
    assert any(p.ndim == 3 for group in groups for p in group["params"])  # the routed-expert stacks
    assert len(given) == len(slices)
    for shape in {m.shape for m, _ in slices}:
        ours = [(m, g) for m, g in slices if m.shape == shape]
        group = next(g for g in theirs.param_groups if g["params"][0].shape == shape)
        assert len(group["params"]) == len(ours)
        assert group["momentum"] == groups[0]["momentum"] and group["ns_steps"] == groups[0]["ns_steps"]
        for leaf, (matrix, grad) in zip(group["params"], ours, strict=True):
            assert torch.equal(leaf, matrix) and torch.equal(leaf.grad, grad)
            assert leaf.data_ptr() != matrix.data_ptr()  # its own copy: stepping it leaves pilotrun's alone
    assert len(theirs.param_groups) == len({m.shape for m, _ in slices})


def test_both_step_in_alternating_rounds_and_the_section_reports_each_size(tmp_path, monkeypatch):
    nanochat = fake_checkout(tmp_path)
    monkeypatch.setattr(bench_optim, "NANOCHAT_SIZES", (TINY,))
    limit = torch._dynamo.config.recompile_limit
    text = bench_optim.nanochat_subsection(nanochat)
    assert torch._dynamo.config.recompile_limit == limit
    assert text.startswith(bench_optim.NANOCHAT_HEADING + "\n")
    row = next(line for line in text.splitlines() if line.startswith("| tiny (tiny) |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[3].split(" / ")[0] == cells[3].split(" / ")[1]  # the same iteration FLOP on both sides
    assert cells[7] == "2 after 1"
    assert "Weights finite on both sides after every step: yes." in text
    # pilotrun's chains are seen in the profile; the stand-in multiplies no matrices
    profile = next(line for line in text.splitlines() if line.startswith("Where the time goes"))
    assert "tiny: pilotrun " in profile and "calls (aten::baddbmm, aten::bmm)" in profile
    assert "nanochat: no matrix-product operator seen" in profile
    assert "pilotrun's Muon step <= 0.9x nanochat's compiled one at both sizes: " in text
    assert "Command: `python -m benchmarks.run_all bench_optim --nanochat PATH`" in text


def test_the_rounds_alternate_and_the_first_is_left_out(monkeypatch):
    now, order = [0.0], []

    def taking(name, seconds):
        def step():
            order.append(name)
            now[0] += seconds
        return step

    monkeypatch.setattr(bench_optim, "clock", lambda: now[0])
    figures = bench_optim.alternate_steps(
        {"pilotrun": taking("pilotrun", 1.0), "nanochat": taking("nanochat", 4.0)},
        bench_optim.NanochatSize("fake", "tiny", {}, rounds=3, warmup=1),
    )
    assert order == ["pilotrun", "nanochat", "nanochat", "pilotrun"] * 2
    assert figures["medians"] == {"pilotrun": 1.0, "nanochat": 4.0}
    assert figures["ratio"] == 0.25 and figures["spread"] == (0.25, 0.25)
    assert figures["first"]["nanochat"][1] == 4.0


def test_iteration_flops_count_the_side_each_iterates_on():
    # [2, 3]: the Gram matrix is 2 x 2; one iteration costs 4 * 2^2 * 3 + 2 * 2^3 = 64
    assert bench_optim.iteration_flops([(2, 3), (3, 2)], 1, min) == 128
    assert bench_optim.iteration_flops([(3, 2)], 5, lambda rows, cols: rows) == 5 * (4 * 9 * 2 + 2 * 27)
