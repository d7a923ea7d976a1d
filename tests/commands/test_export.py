"""pilotrun/commands/export.py: a trained checkpoint, exported, loaded by the real `transformers` DeepSeek-V3
on the CPU, gives pilotrun's logits (fp32, max abs diff < 1e-5); torch.save and DCP checkpoints export the
same tensors; inexpressible options, damaged checkpoints and occupied output folders are refused with exit
2."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from pilotrun.commands.cli import main
from pilotrun.commands.export import ExportError, load_checkpoint_model, refuse_inexpressible_options
from pilotrun.common.errors import PilotrunError
from pilotrun.config import ModelConfig, load_run_config
from pilotrun.training.trainer import Trainer

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"
# A large bias update speed and init std make the exported router bias and every matrix matter: the bias moves
# by 0.05 per update and decides selections (the negative controls below show the comparison would notice).
VARIANTS = {
    "plain_q": ["model.q_lora_rank=0", "model.n_shared_experts=1"],
    "lora_q_groups_no_shared": ["model.q_lora_rank=16", "model.n_expert_groups=2", "model.n_limited_groups=1",
                                "model.n_shared_experts=0", "model.n_routed_experts=6"],
}
TOLERANCE = 1e-5


def train_tiny_run(data_dir: Path, run_dir: Path, overrides: list[str]) -> None:
    config = load_run_config(SMOKE, ["train.num_threads=1", "train.max_steps=3", "train.eval_every=0",
                                     "train.checkpoint_every=3", "model.bias_update_speed=0.05",
                                     "model.init_std=0.02", *overrides])
    Trainer(config, data_dir, run_dir, progress=False).run()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def exported(request, builtin_data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"export-{request.param}")
    run_dir = root / "run"
    train_tiny_run(builtin_data_dir, run_dir, VARIANTS[request.param])
    out = root / "hf"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    return run_dir, out


def load_hf(out: Path, attn: str = "eager"):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation=attn
    )
    return model.eval()


def sample_tokens(vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab_size, (2, 32), generator=generator)


def max_logit_difference(pilot_model, hf_model, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return (pilot_model(tokens).logits - hf_model(tokens).logits).abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_transformers_reproduces_pilotrun_logits(exported, attn):
    run_dir, out = exported
    pilot_model, config, _meta, step, _marker = load_checkpoint_model(run_dir)
    assert step == 3
    hf_model = load_hf(out, attn)
    assert type(hf_model).__name__ == "DeepseekV3ForCausalLM"
    tokens = sample_tokens(config.model.vocab_size)
    difference = max_logit_difference(pilot_model, hf_model, tokens)
    assert difference < TOLERANCE, f"max |logit difference| {difference}"
    # Every parameter of the HF model came from the file (none left at transformers' initialization).
    assert sum(p.numel() for p in hf_model.parameters()) == sum(p.numel() for p in pilot_model.parameters())


def test_greedy_generation_through_the_kv_cache_matches_pilotrun(exported):
    """transformers' generate (its MLA cache, RoPE at cached positions) picks the tokens pilotrun's full
    forward picks, greedily, for 6 new tokens."""
    run_dir, out = exported
    pilot_model, config, *_ = load_checkpoint_model(run_dir)
    prompt = sample_tokens(config.model.vocab_size)[:1, :5]
    generated = load_hf(out).generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    sequence = prompt
    with torch.no_grad():
        for _ in range(6):
            next_token = pilot_model(sequence).logits[:, -1].argmax(dim=-1, keepdim=True)
            sequence = torch.cat([sequence, next_token], dim=1)
    assert torch.equal(generated, sequence)


def test_comparison_notices_a_wrong_bias_or_a_swapped_projection(exported):
    """Negative controls: the tolerance above is far below what one mapping mistake does to the logits."""
    run_dir, out = exported
    pilot_model, config, *_ = load_checkpoint_model(run_dir)
    tokens = sample_tokens(config.model.vocab_size)
    moe_layer = config.model.n_dense_layers
    hf_model = load_hf(out)
    gate = hf_model.model.layers[moe_layer].mlp.gate
    assert gate.e_score_correction_bias.abs().max() > 0.05  # the trained bias arrived
    with torch.no_grad():
        gate.e_score_correction_bias.zero_()
    assert max_logit_difference(pilot_model, hf_model, tokens) > 100 * TOLERANCE
    hf_model = load_hf(out)
    experts = hf_model.model.layers[moe_layer].mlp.experts
    with torch.no_grad():  # gate and up halves of every expert swapped (w1 <-> w3)
        gate_up = experts.gate_up_proj
        gate_up.copy_(torch.cat(gate_up.chunk(2, dim=1)[::-1], dim=1))
    assert max_logit_difference(pilot_model, hf_model, tokens) > 100 * TOLERANCE


def test_exported_config_and_tokenizer(exported, builtin_data_dir):
    run_dir, out = exported
    pilot_model, config, *_ = load_checkpoint_model(run_dir)
    m = config.model
    hf_config = transformers.AutoConfig.from_pretrained(out)
    assert (hf_config.hidden_size, hf_config.num_hidden_layers, hf_config.first_k_dense_replace) == (
        m.d_model, m.n_layers, m.n_dense_layers)
    assert hf_config.q_lora_rank == (m.q_lora_rank or None)
    assert (hf_config.n_group, hf_config.topk_group, hf_config.num_experts_per_tok) == (
        m.n_expert_groups, m.n_limited_groups, m.top_k)
    assert hf_config.routed_scaling_factor == pilot_model.moe_layers()[0].gate.route_scale
    assert hf_config.tie_word_embeddings is False and hf_config.rope_interleave is True
    from tokenizers import Tokenizer

    text = "The pilot run showed that the loss behaves and the run resumes."
    expected = Tokenizer.from_file(str(builtin_data_dir / "tokenizer.json")).encode(text).ids
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer(text)["input_ids"] == expected
    assert tokenizer.eos_token_id == hf_config.eos_token_id == json.loads(
        (builtin_data_dir / "metadata.json").read_text())["tokenizer"]["eos_id"]
    assert (out / "tokenizer.json").read_bytes() == (builtin_data_dir / "tokenizer.json").read_bytes()


def test_dcp_checkpoint_exports_the_same_tensors(exported, tmp_path):
    """The run's checkpoint rewritten through torch.distributed.checkpoint (the torchrun storage), in process:
    the export reads it into the same tensors, bit for bit, as from the torch.save checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from pilotrun.optim.muon_adamw import build_optimizer
    from pilotrun.training.checkpoint.checkpointer import Checkpointer
    from pilotrun.training.checkpoint.dcp_storage import DCPStorage

    run_dir, out = exported
    model, config, meta, step, _marker = load_checkpoint_model(run_dir)
    dcp_run = tmp_path / "dcp-run"
    model_state, optimizer_state = get_state_dict(model, build_optimizer(model, config.optim))
    with warnings.catch_warnings():  # "assuming ... a single process": intended
        warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
        Checkpointer(dcp_run, keep=1, storage=DCPStorage()).save(step, {"model": model_state,
                                                                        "optimizer": optimizer_state}, meta)
    marker = json.loads((dcp_run / "checkpoints" / f"step-{step:08d}" / "COMMITTED.json").read_text())
    assert marker["storage"] == "torch_dcp"
    dcp_out = tmp_path / "hf"
    assert main(["export", str(dcp_run), "--out", str(dcp_out), "--step", str(step)]) == 0
    expected = safetensors_torch.load_file(out / "model.safetensors")
    got = safetensors_torch.load_file(dcp_out / "model.safetensors")
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def test_refusals_exit_2_with_one_line_and_write_nothing(exported, tmp_path, capsys):
    run_dir, _out = exported
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    folder = copy / "checkpoints" / "step-00000003"

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    capsys.readouterr()
    assert main(["export", str(copy), "--out", str(occupied)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert [p.name for p in occupied.iterdir()] == ["keep.txt"]

    assert main(["export", str(copy), "--out", str(tmp_path / "a"), "--step", "2"]) == 2
    assert "no committed checkpoint at that step" in capsys.readouterr().err

    marker_path = folder / "COMMITTED.json"
    marker = json.loads(marker_path.read_text())
    marker["meta"]["recipe"]["model"]["score_func"] = "softmax"
    marker_path.write_text(json.dumps(marker))
    assert main(["export", str(copy), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "model.score_func=softmax" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()

    model_file = folder / "model.pt"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model_file.write_bytes(bytes(data))
    assert main(["export", str(copy), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "model.pt" in err and "damaged" in err
    assert not (tmp_path / "c").exists()
    assert not list(tmp_path.glob(".c.tmp-*"))


@pytest.mark.parametrize(("overrides", "named"), [
    ({"score_func": "softmax"}, "model.score_func"),
    ({"norm_eps": 1e-5}, "model.norm_eps"),
    ({"force_balanced_routing": True}, "model.force_balanced_routing"),
    ({"n_expert_groups": 2, "balance": "seq"}, "model.n_expert_groups"),
    ({"n_routed_experts": 4, "n_expert_groups": 4, "n_limited_groups": 2}, "model.n_expert_groups"),
])
def test_inexpressible_options_are_named(overrides, named):
    with pytest.raises(ExportError, match=named.replace(".", r"\.")):
        refuse_inexpressible_options(ModelConfig(**overrides))
    assert issubclass(ExportError, PilotrunError)


def test_dense_only_model_needs_no_router_options():
    refuse_inexpressible_options(ModelConfig(n_layers=2, n_dense_layers=2, score_func="softmax"))


def test_every_exported_file_has_the_same_mode(exported):
    """safetensors writes its file private (0600); the export's files share the mode the umask gives."""
    import stat

    _, out = exported
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert len(set(modes.values())) == 1, modes
