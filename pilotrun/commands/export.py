"""A committed checkpoint as a Hugging Face model folder: `pilotrun export RUN [--step N] --out DIR`.

What is written (the layout `transformers`' `AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer`
read, and that vLLM / lm-eval take as a DeepSeek-V3 checkpoint):
  model.safetensors       the weights in fp32, under the names of the DeepSeek-V3 hub checkpoints (routed
                          experts one matrix per expert: `mlp.experts.{j}.gate_proj.weight`, ...; recent
                          transformers versions fuse them on load, older ones and vLLM read them as they are)
  config.json             `DeepseekV3ForCausalLM` with every architecture option mapped from the recipe
  generation_config.json  the end-of-document id as eos (pilotrun trains with no BOS and no padding)
  tokenizer.json          the data folder's tokenizer, byte for byte
  tokenizer_config.json   says "PreTrainedTokenizerFast" (otherwise the model type would pick a Llama class)
  pilotrun_export.json    where it came from: run id, step, storage, the checkpoint marker's file hashes

The checkpoint's files are rehashed against its marker before anything is read, for both storages (the
single-process torch.save parts and torch.distributed.checkpoint folders written under torchrun, loaded here
on one process into plain tensors). Options transformers' DeepSeek-V3 cannot express are refused with one line
naming the key: its router is sigmoid-only, its group score is always the sum of the top two biased scores,
and its latent RMSNorms use a fixed eps of 1e-6.

RoPE layout: pilotrun rotates adjacent pairs (x[2i], x[2i+1]) -- DeepSeek's interleaved layout -- and
transformers' `rope_interleave=True` rotates the same pairs but writes the result de-interleaved. It does so
for queries and keys alike, and a dot product is unchanged when both vectors are permuted the same way, so
attention is identical and no weight needs permuting (the logits comparison in tests/commands/test_export.py
checks it).

Nothing is written into DIR until every file is complete: the folder is assembled beside it and renamed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

import torch

from pilotrun.common.errors import CheckpointError, ConfigError, PilotrunError
from pilotrun.common.files import open_for_write, refuse_link, remove_stale_temps, temp_path
from pilotrun.config import ModelConfig, RunConfig, config_from_dict

TRANSFORMERS_NORM_EPS = 1e-6  # DeepseekV3Attention builds q_a_layernorm / kv_a_layernorm with this eps
EXPORT_INFO_FILE = "pilotrun_export.json"


class ExportError(PilotrunError):
    """A model option the target format cannot express, or an output folder that would be overwritten."""


# ---------------------------------------------------------------------------------------------- reading
def _checkpointer(run_dir: Path):
    from pilotrun.training.checkpoint.distributed_checkpointer import DistributedCheckpointer

    if not (run_dir / "checkpoints").is_dir():
        raise CheckpointError(
            f"{run_dir / 'checkpoints'} not found: is {run_dir} a run folder with checkpoints?"
        )
    return DistributedCheckpointer(run_dir, keep=1)


def load_checkpoint_model(run_dir: str | Path, step: int | None = None):
    """(model in eval mode on the CPU, RunConfig, checkpoint meta, step, marker) of a committed checkpoint.

    The newest committed step by default. Every file of the checkpoint is rehashed first (a damaged one raises
    CheckpointError naming it); then only the model's part is read, whichever storage wrote it."""
    from pilotrun.model.transformer import build_model

    run_dir = Path(run_dir)
    checkpointer = _checkpointer(run_dir)
    steps = checkpointer.committed_steps()
    if not steps:
        raise CheckpointError(f"no committed checkpoint in {checkpointer.root}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"--step {step}: no committed checkpoint at that step in {checkpointer.root} "
                              f"(committed: {', '.join(str(s) for s in steps)})")
    checkpoint = checkpointer.verify(step)
    meta = checkpoint.marker.get("meta", {})
    if "recipe" not in meta:
        raise CheckpointError(f"checkpoint {checkpoint.path}: its marker records no recipe")
    config: RunConfig = config_from_dict(meta["recipe"])
    model = build_model(config.model)
    files = sorted(checkpoint.marker["files"])
    if checkpoint.marker.get("storage") == "torch_dcp":
        model_state = _read_dcp_model_state(checkpoint.path, model)
    else:
        from pilotrun.training.checkpoint.single_file import TorchSaveStorage

        model_files = [f for f in files if f == "model.pt" or re.fullmatch(r"model\.\d{3,}\.pt", f)]
        if "model.pt" not in model_files:
            raise CheckpointError(f"checkpoint {checkpoint.path} has no model.pt")
        model_state = TorchSaveStorage().read(checkpoint.path, model_files)["model"]
    try:
        model.load_state_dict(model_state)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise CheckpointError(
            f"checkpoint {checkpoint.path}: its model does not match its recipe: {first}"
        ) from None
    model.eval()
    return model, config, meta, step, checkpoint.marker


def _read_dcp_model_state(folder: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model entries of a torch.distributed.checkpoint folder, loaded on one process into plain tensors
    shaped like `model`'s (DCP reassembles FSDP2 shards and reads DDP's single copy). Read through the same
    restricted reader a resume uses: DCP's own reader unpickles `.metadata` with plain pickle, so a crafted
    checkpoint would run code on export."""
    import warnings

    from pilotrun.training.checkpoint.dcp_safe_read import safe_dcp_load

    template = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is", category=UserWarning)
        safe_dcp_load(folder, template, no_dist=True)  # CheckpointError (one line) on anything it refuses
    return template["model"]


# ---------------------------------------------------------------------------------------------- mapping
def refuse_inexpressible_options(model_cfg: ModelConfig) -> None:
    """ExportError naming the first recipe option that transformers' DeepSeek-V3 would compute differently."""
    from pilotrun.model.balancing import uses_expert_bias

    m = model_cfg
    has_moe = m.n_layers > m.n_dense_layers
    if m.norm_eps != TRANSFORMERS_NORM_EPS:
        raise ExportError(
            f"model.norm_eps={m.norm_eps}: transformers' DeepSeek-V3 fixes the eps of its latent "
            f"RMSNorms (q_a_layernorm, kv_a_layernorm) at {TRANSFORMERS_NORM_EPS}; cannot export"
        )
    if not has_moe:
        return
    if m.score_func != "sigmoid":
        raise ExportError(
            f"model.score_func={m.score_func}: transformers' DeepSeek-V3 router is sigmoid only; "
            "cannot export"
        )
    if m.force_balanced_routing:
        raise ExportError("model.force_balanced_routing=true is a debug routing transformers does not have; "
                          "cannot export")
    if m.n_routed_experts // m.n_expert_groups < 2:
        raise ExportError(
            f"model.n_expert_groups={m.n_expert_groups}: transformers scores each group by its top "
            "two experts, which needs at least 2 experts per group; cannot export"
        )
    if m.n_expert_groups > 1 and not uses_expert_bias(m.balance):
        raise ExportError(
            f"model.n_expert_groups={m.n_expert_groups} with model.balance={m.balance}: without the "
            "aux-free bias pilotrun scores a group by its best expert, transformers by its top two; "
            "cannot export"
        )


def hf_config(model: torch.nn.Module, eos_id: int | None) -> dict[str, Any]:
    """config.json for `DeepseekV3ForCausalLM`, every field from the built model's config."""
    m: ModelConfig = model.cfg
    refuse_inexpressible_options(m)
    moe_layers = model.moe_layers()
    # The route scale as the model resolved it (0 in the recipe means Moonlight's formula, resolved by the
    # model).
    route_scale = float(moe_layers[0].gate.route_scale) if moe_layers else 1.0
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "first_k_dense_replace": m.n_dense_layers,
        "intermediate_size": m.dense_hidden,
        "moe_intermediate_size": m.moe_hidden,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_heads,
        "q_lora_rank": m.q_lora_rank if m.q_lora_rank > 0 else None,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "n_routed_experts": m.n_routed_experts,
        "n_shared_experts": m.n_shared_experts,
        "num_experts_per_tok": m.top_k,
        "n_group": m.n_expert_groups,
        "topk_group": m.n_limited_groups,
        "routed_scaling_factor": route_scale,
        "norm_topk_prob": bool(m.route_norm),
        # read by DeepSeek's own modeling code and vLLM; transformers is sigmoid-only
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",  # likewise: top-k over scores + e_score_correction_bias, group-limited
        "hidden_act": "silu",
        "max_position_embeddings": m.max_seq_len,
        "rope_theta": m.rope_theta,  # transformers < 5 and vLLM
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},  # transformers >= 5
        "rope_scaling": None,
        "rope_interleave": True,
        "rms_norm_eps": m.norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,  # pilotrun's head is a separate matrix, not the embedding
        "num_nextn_predict_layers": 0,  # no multi-token-prediction module
        "initializer_range": m.init_std,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under DeepSeek-V3 hub names (the names transformers' DeepseekV3 modules give them),
    contiguous fp32 CPU copies."""
    from pilotrun.model.balancing import uses_expert_bias

    m: ModelConfig = model.cfg
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embed.weight,
        "model.norm.weight": model.norm.weight,
        "lm_head.weight": model.head.weight,
    }
    for index, block in enumerate(model.layers):
        prefix = f"model.layers.{index}."
        attn = block.attn
        out[prefix + "input_layernorm.weight"] = block.attn_norm.weight
        out[prefix + "post_attention_layernorm.weight"] = block.ffn_norm.weight
        a = prefix + "self_attn."
        if m.q_lora_rank > 0:
            out[a + "q_a_proj.weight"] = attn.wq_a.weight
            out[a + "q_a_layernorm.weight"] = attn.q_norm.weight
            out[a + "q_b_proj.weight"] = attn.wq_b.weight
        else:
            out[a + "q_proj.weight"] = attn.wq.weight
        out[a + "kv_a_proj_with_mqa.weight"] = attn.wkv_a.weight
        out[a + "kv_a_layernorm.weight"] = attn.kv_norm.weight
        out[a + "kv_b_proj.weight"] = attn.wkv_b.weight
        out[a + "o_proj.weight"] = attn.wo.weight
        f = prefix + "mlp."
        ffn = block.ffn
        if not block.is_moe:
            out[f + "gate_proj.weight"] = ffn.w1.weight
            out[f + "up_proj.weight"] = ffn.w3.weight
            out[f + "down_proj.weight"] = ffn.w2.weight
            continue
        out[f + "gate.weight"] = ffn.gate.weight
        bias = ffn.gate.expert_bias if uses_expert_bias(m.balance) else torch.zeros_like(ffn.gate.expert_bias)
        out[f + "gate.e_score_correction_bias"] = bias
        for expert in range(m.n_routed_experts):
            e = f"{f}experts.{expert}."
            out[e + "gate_proj.weight"] = ffn.experts.w1[expert]
            out[e + "up_proj.weight"] = ffn.experts.w3[expert]
            out[e + "down_proj.weight"] = ffn.experts.w2[expert]
        if m.n_shared_experts > 0:
            shared = ffn.shared_experts
            out[f + "shared_experts.gate_proj.weight"] = shared.w1.weight
            out[f + "shared_experts.up_proj.weight"] = shared.w3.weight
            out[f + "shared_experts.down_proj.weight"] = shared.w2.weight
        else:  # transformers always builds the shared experts; zero width computes exactly zero
            d = m.d_model
            out[f + "shared_experts.gate_proj.weight"] = torch.zeros(0, d)
            out[f + "shared_experts.up_proj.weight"] = torch.zeros(0, d)
            out[f + "shared_experts.down_proj.weight"] = torch.zeros(d, 0)
    return {name: tensor.detach().to(device="cpu", dtype=torch.float32).contiguous().clone()
            for name, tensor in out.items()}


# ---------------------------------------------------------------------------------------------- writing
def _tokenizer_files(data_dir: Path, expected_metadata_sha256: str | None) -> tuple[Path, int, str | None]:
    """(tokenizer.json path, eos id, eos token text) from the run's data folder, identity checked."""
    from pilotrun.common.errors import DataError
    from pilotrun.data.mixed_reader import open_data

    if not data_dir.exists():  # a folder, or a mixture file (whose sources share one tokenizer)
        raise DataError(
            f"data folder {data_dir} (recorded by the checkpoint) not found: pass --data with its "
            "current location"
        )
    dataset = open_data(data_dir)
    if expected_metadata_sha256 and dataset.metadata_sha256 != expected_metadata_sha256:
        raise DataError(
            f"{data_dir}: metadata_sha256 {dataset.metadata_sha256[:12]} differs from the "
            f"checkpoint's {expected_metadata_sha256[:12]}: not the data this model was trained on"
        )
    eos_text = dataset.load_tokenizer().id_to_token(dataset.eos_id)
    return Path(dataset.tokenizer_path), dataset.eos_id, eos_text


def _import_safetensors():
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError(
            "pilotrun export needs the safetensors package: pip install 'pilotrun[export]'"
        ) from None
    return save_file


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None,
               data_dir: str | Path | None = None) -> dict[str, Any]:
    """Write the Hugging Face folder for a run's checkpoint (newest, or `step`); returns what was exported."""
    save_file = _import_safetensors()
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    refuse_link(out_dir)  # the finished folder is renamed onto --out: a link there is refused, never followed
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"--out {out_dir} exists and is not an empty folder; choose a new one")
    model, config, meta, step, marker = load_checkpoint_model(run_dir, step)
    data = meta.get("data", {})
    source = Path(data_dir) if data_dir is not None else Path(data.get("dir", ""))
    tokenizer_path, eos_id, eos_text = _tokenizer_files(source, data.get("metadata_sha256"))
    hf = hf_config(model, eos_id)
    tensors = hf_state_dict(model)
    info = {
        "run_dir": str(run_dir.resolve()),
        "run_id": meta.get("run_id"),
        "step": step,
        "storage": marker.get("storage", "torch_save"),
        "data_metadata_sha256": data.get("metadata_sha256"),
        "checkpoint_files": marker.get("files", {}),
        "recipe": meta.get("recipe"),
    }

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for line in remove_stale_temps(out_dir.parent, out_dir.name):  # a killed export's whole-model temp folder
        print(f"pilotrun: {line}", file=sys.stderr)
    temp = temp_path(out_dir)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        _write_json(temp / "config.json", hf)
        try:
            save_file(tensors, str(temp / "model.safetensors"), metadata={
                "format": "pt", "pilotrun_run_id": str(meta.get("run_id")), "pilotrun_step": str(step)})
        except Exception as error:  # safetensors' own error type (a full disk, a quota): one line, exit 2
            if isinstance(error, OSError) or type(error).__name__ != "SafetensorError":
                raise
            raise ExportError(
                f"--out {out_dir}: the model could not be written ({' '.join(str(error).split())})"
            ) from None
        # safetensors creates its file private (0600); the export is one folder whose files share one mode,
        # the one this process's umask gives any file (config.json's), so whoever may read the config may
        # read the model it describes.
        os.chmod(temp / "model.safetensors", stat.S_IMODE((temp / "config.json").stat().st_mode))
        _write_json(temp / "generation_config.json", {"eos_token_id": eos_id, "bos_token_id": None,
                                                      "pad_token_id": None})
        shutil.copyfile(tokenizer_path, temp / "tokenizer.json")
        _write_json(
            temp / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": eos_text,
                "model_max_length": config.model.max_seq_len,
                "clean_up_tokenization_spaces": False,
            },
        )
        _write_json(temp / EXPORT_INFO_FILE, info)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.rename(temp, out_dir)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return {"out": str(out_dir), "step": step, "storage": info["storage"], "tensors": len(tensors),
            "parameters": int(sum(t.numel() for t in tensors.values()))}


def _write_json(path: Path, data: Any) -> None:
    with open_for_write(path, "w", exclusive=True) as handle:  # inside the fresh temp folder: never a link
        handle.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
