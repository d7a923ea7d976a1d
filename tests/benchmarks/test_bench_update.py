"""bench_update's optional comparison with a nanochat checkout: a path that is not one is refused with one
line (exit 2, nothing measured), and a checkout of nanochat's API shape (a minimal stand-in written here, no
network) joins the same interleaved rounds as "nanochat eager" and "nanochat as shipped", at pilotrun's matmul
work per token, with its ratios in the Markdown."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from benchmarks import bench_update, nanochat_adapter

# The API shape the adapter relies on, as nanochat's gpt.py has it: a GPTConfig dataclass, a GPT whose blocks
# sit in transformer.h with an MLP of c_fc and c_proj (4x wide, no width in the config), init_weights, a
# forward that returns the loss given targets, and setup_optimizer.
FAKE_GPT = textwrap.dedent('''
    from dataclasses import dataclass
    import torch
    import torch.nn.functional as F
    from torch import nn

    print("a message at import time")


    @dataclass
    class GPTConfig:
        sequence_len: int = 64
        vocab_size: int = 256
        n_layer: int = 2
        n_head: int = 2
        n_kv_head: int = 2
        n_embd: int = 32
        window_pattern: str = "SSSL"


    class Linear(nn.Linear):
        pass


    class MLP(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=False)
            self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=False)

        def forward(self, x):
            return self.c_proj(F.relu(self.c_fc(x)).square())


    class Block(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.attn = Linear(config.n_embd, config.n_embd, bias=False)
            self.mlp = MLP(config)

        def forward(self, x):
            x = x + self.attn(F.rms_norm(x, (x.size(-1),)))
            return x + self.mlp(F.rms_norm(x, (x.size(-1),)))


    class GPT(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            embedding = nn.Embedding(config.vocab_size, config.n_embd)
            blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.transformer = nn.ModuleDict({"wte": embedding, "h": blocks})
            self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)

        def init_weights(self):
            for p in self.parameters():
                nn.init.normal_(p, std=0.02)

        def num_matmul_params(self):
            return sum(m.weight.numel() for m in self.modules() if isinstance(m, Linear))

        def setup_optimizer(self):
            print("a message at set-up")
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def forward(self, idx, targets=None):
            x = self.transformer.wte(idx)
            for block in self.transformer.h:
                x = block(x)
            logits = self.lm_head(F.rms_norm(x, (x.size(-1),)))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
''')

TINY = bench_update.Size("tiny", "tiny", {}, batch=2, seq=16, rounds=2, warmup=1)


def fake_checkout(root, gpt_source=FAKE_GPT):
    (root / "nanochat").mkdir(parents=True)
    (root / "nanochat" / "__init__.py").write_text("")
    (root / "nanochat" / "gpt.py").write_text(gpt_source)
    return root


def refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        bench_update.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    return captured.err


def test_a_path_that_is_not_a_nanochat_checkout_is_refused_in_one_line(tmp_path, capsys):
    err = refusal(capsys, ["--sizes", "stability", "--nanochat", str(tmp_path)])
    assert err == f"bench_update: --nanochat {tmp_path}: not a nanochat checkout (no nanochat/gpt.py in it)\n"


def test_a_checkout_missing_part_of_the_api_is_refused_naming_it(tmp_path, capsys):
    fake_checkout(tmp_path / "no_setup", FAKE_GPT.replace("def setup_optimizer", "def other"))
    err = refusal(capsys, ["--sizes", "stability", "--nanochat", str(tmp_path / "no_setup")])
    assert err.endswith(": nanochat.gpt.GPT has no setup_optimizer or setup_optimizers\n")
    fake_checkout(tmp_path / "no_field", FAKE_GPT.replace("    n_embd: int = 32\n", ""))
    assert refusal(capsys, ["--nanochat", str(tmp_path / "no_field")]).endswith(
        "GPTConfig has no field n_embd\n"
    )
    fake_checkout(tmp_path / "broken", "raise RuntimeError('needs CUDA')\n")
    err = refusal(capsys, ["--nanochat", str(tmp_path / "broken")])
    assert err.endswith("importing nanochat.gpt failed: RuntimeError: needs CUDA\n")
    fake_checkout(tmp_path / "no_mlp", FAKE_GPT.replace("self.mlp = MLP(config)", "self.ffn = MLP(config)")
                  .replace("self.mlp(", "self.ffn("))
    nanochat = nanochat_adapter.load(tmp_path / "no_mlp")
    with pytest.raises(nanochat_adapter.NanochatError, match="blocks have no mlp.c_fc and mlp.c_proj"):
        nanochat_adapter.build(
            nanochat, d_model=32, n_layers=2, n_heads=2, vocab=256, seq=16, target_matmul=10**4
        )


def test_the_model_matches_the_matmul_work_asked_for_and_is_nanochats_own_init(tmp_path, capsys):
    nanochat = nanochat_adapter.load(fake_checkout(tmp_path))
    model, optimizers, shape = nanochat_adapter.build(nanochat, d_model=32, n_layers=2, n_heads=2, vocab=256,
                                                      seq=16, target_matmul=40_000)
    # attention 2 x 32^2 + head 32 x 256 = 10,240; the MLP's 2 x 2 x 32 x h nearest the remaining 29,760: h
    # 232
    assert shape["nanochat_hidden"] == 232 and shape["nanochat_shipped_hidden"] == 128
    assert shape["nanochat_matmul_parameters"] == 10_240 + 4 * 32 * 232 == model.num_matmul_params()
    assert shape["nanochat_flops_per_token"] == 6 * 39_936 + 6 * 2 * 2 * 32 * 17 / 2
    assert model.transformer.h[0].mlp.c_fc.weight.shape == (232, 32)
    assert type(model.transformer.h[0].mlp.c_fc).__module__ == "nanochat.gpt"
    assert shape["nanochat_optimizers"] == ["AdamW"] and len(optimizers) == 1
    assert capsys.readouterr().out == ""  # its messages went to stderr


def test_the_nanochat_variants_run_in_the_same_rounds_and_phases(tmp_path, monkeypatch, capsys):
    # Compilation is what the benchmark measures, not what this test checks: each compile is the identity
    # here.
    monkeypatch.setattr(bench_update, "compile_blocks_and_output", lambda model, backend: None)
    monkeypatch.setattr(torch, "compile", lambda model, **options: model)
    nanochat = nanochat_adapter.load(fake_checkout(tmp_path))
    result = bench_update.measure(TINY, nanochat)
    figures = result["figures"]
    assert list(figures) == ["pilotrun eager", "pilotrun compiled", "reference eager", "reference compiled",
                             "MoE reference eager", "nanochat as shipped", "nanochat eager"]
    assert len(figures["nanochat eager"]) == 4  # the eager one has no compile figures
    assert set(figures["nanochat as shipped"]) >= {"update_ms", "forward_backward_ms", "step_ms", "speedup",
                                                   "compile_s", "payback_updates"}
    assert result["nanochat_matmul_parameters"] > 0 and result["nanochat_newton_schulz_flops"] > 0
    json.dumps(result)
    text = bench_update.markdown([result])
    assert "pilotrun (" in text and ") / nanochat as shipped: update " in text and "optimizer step " in text
    assert f"MLP width set to {result['nanochat_hidden']}" in text
    assert "| nanochat as shipped |" in text and "| nanochat eager |" in text
    # Both yardsticks side by side: the MoE of identical total matrices beside nanochat's equal active work.
    assert "| MoE reference eager |" in text and "pilotrun eager / the MoE reference of identical" in text
    assert result["moe_reference_newton_schulz_flops"] == result["pilotrun_newton_schulz_flops"]
    assert result["moe_reference_parameters"] == result["pilotrun_parameters"]
    # A compiled side whose first updates came out no slower: its cost is below what they resolve, never
    # negative.
    figures["pilotrun compiled"].update(compile_s=-0.7, payback_updates=-6.0)
    row = next(
        line
        for line in bench_update.markdown([result]).splitlines()
        if line.startswith("| pilotrun compiled")
    )
    assert row.endswith("| under the noise | at once |") and "-" not in row.split("|", 2)[2], row
    capsys.readouterr()


def test_without_the_flag_nanochat_is_not_named():
    result = {"figures": {}}
    assert bench_update.nanochat_shape(result) == [] and bench_update.nanochat_ratios(result["figures"]) == []


def test_the_moe_reference_has_pilotruns_matrices_one_for_one():
    from benchmarks import moe_reference
    from pilotrun.config import OptimConfig
    from pilotrun.model.presets import model_preset
    from pilotrun.model.transformer import build_model
    from pilotrun.optim.muon_adamw import build_optimizer

    for cfg in (model_preset("tiny", vocab_size=256), model_preset("cpu", vocab_size=256, q_lora_rank=0)):
        model = build_model(cfg)
        optimizer = build_optimizer(model, OptimConfig())
        ours = [p for g in optimizer.param_groups if g["use_muon"] for p in g["params"]]
        reference = moe_reference.ReferenceMoE(cfg)
        assert moe_reference.muon_shapes(moe_reference.muon_matrices(reference)) == \
            moe_reference.muon_shapes(ours)
        assert sum(p.numel() for p in reference.parameters()) == sum(p.numel() for p in model.parameters())
        tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
        loss = reference(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        # Every matrix but a routed expert that no token chose takes part in the update.
        assert torch.isfinite(loss)
        assert all(p.grad is not None for name, p in reference.named_parameters() if ".experts." not in name)
