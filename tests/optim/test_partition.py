"""The explicit parameter partition on the real model."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from pilotrun.config import ModelConfig, OptimConfig
from pilotrun.model.transformer import build_model
from pilotrun.optim.muon_adamw import MuonAdamW, build_optimizer
from pilotrun.optim.partition import classify_parameter, partition_parameters, partition_table

NOT_FOR_MUON = re.compile(r"embed|head|norm")


def _model(q_lora_rank: int = 0):
    torch.manual_seed(0)
    return build_model(ModelConfig(vocab_size=256, q_lora_rank=q_lora_rank))


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_every_trainable_parameter_in_exactly_one_group(q_lora_rank):
    model = _model(q_lora_rank)
    groups = partition_parameters(model, OptimConfig())
    seen: dict[int, str] = {}
    for group in groups:
        assert len(group["params"]) == len(group["param_names"])
        for name, param in zip(group["param_names"], group["params"]):
            assert id(param) not in seen, f"{name} in two groups"
            seen[id(param)] = group["name"]
            assert dict(model.named_parameters())[name] is param
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert set(seen) == trainable
    buffers = {id(b) for b in model.buffers()}
    assert not buffers & set(seen)  # expert_bias, RoPE tables, counters: in no group


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_no_embedding_head_norm_or_router_in_muon(q_lora_rank):
    model = _model(q_lora_rank)
    groups = partition_parameters(model, OptimConfig())
    for group in groups:
        for name, param in zip(group["param_names"], group["params"]):
            if group["use_muon"]:
                assert not NOT_FOR_MUON.search(name), name
                assert not name.endswith("gate.weight"), name
                assert param.ndim >= 2, name
    by_name = {n: g["name"] for g in groups for n in g["param_names"]}
    assert by_name["embed.weight"] == "embedding" and by_name["head.weight"] == "head"
    assert by_name["layers.1.ffn.gate.weight"] == "router"
    assert by_name["layers.1.ffn.experts.w1"] == "routed_experts"
    assert by_name["layers.0.ffn.w2.weight"] == "dense_ffn"
    assert by_name["layers.1.ffn.shared_experts.w3.weight"] == "shared_experts"
    assert by_name["layers.0.attn.wkv_b.weight"] == "attention"
    if q_lora_rank:
        assert by_name["layers.0.attn.q_norm.weight"] == "norms"
        assert by_name["layers.0.attn.wq_a.weight"] == "attention"
    assert not any("expert_bias" in n for n in by_name)


def test_router_on_muon_when_asked_and_norm_decay_flag():
    model = _model()
    cfg = OptimConfig(router_optimizer="muon", wd_norms=False)
    groups = {g["name"]: g for g in partition_parameters(model, cfg)}
    assert groups["router_muon"]["use_muon"] and "router" not in groups
    assert groups["norms"]["weight_decay"] == 0.0
    assert groups["embedding"]["weight_decay"] == cfg.adamw.weight_decay


def test_groups_carry_the_configured_hyperparameters():
    cfg = OptimConfig()
    cfg = dataclasses.replace(cfg, muon=dataclasses.replace(cfg.muon, lr=0.02, scale_mode="keller"),
                              adamw=dataclasses.replace(cfg.adamw, lr=3e-4, betas=[0.8, 0.99], eps=1e-10))
    optimizer = build_optimizer(_model(), cfg)
    assert isinstance(optimizer, MuonAdamW)
    for group in optimizer.param_groups:
        if group["use_muon"]:
            assert (group["lr"], group["base_lr"], group["scale_mode"]) == (0.02, 0.02, "keller")
        else:
            assert (group["lr"], group["betas"], group["eps"]) == (3e-4, (0.8, 0.99), 1e-10)


def test_partition_table_is_json_and_counts_every_weight():
    model = _model()
    table = partition_table(partition_parameters(model, OptimConfig()))
    json.dumps(table)
    assert sum(row["count"] for row in table) == sum(p.numel() for p in model.parameters())
    assert {row["optimizer"] for row in table} == {"muon", "adamw"}
    assert set(table[0]) == {"group", "parameters", "count", "optimizer", "lr", "weight_decay"}
    experts = next(row for row in table if row["group"] == "routed_experts")
    assert experts["count"] == 3 * 4 * 64 * 64


def test_an_unknown_matrix_is_an_error_and_vectors_fall_to_adamw():
    with pytest.raises(ValueError, match="no rule assigns parameter 'layers.0.mystery.weight'"):
        classify_parameter("layers.0.mystery.weight", torch.zeros(4, 4), "adamw")
    assert classify_parameter("layers.0.attn.wo.bias", torch.zeros(4), "adamw") == "other_vectors"
    with pytest.raises(ValueError, match="is not 3-D"):
        classify_parameter("layers.1.ffn.experts.w1", torch.zeros(4, 4), "adamw")


def test_wrapper_prefixes_are_stripped():
    model = _model()
    wrapped = torch.nn.Module()
    wrapped.module = model  # what DDP's named_parameters look like: "module.embed.weight", ...
    plain = partition_table(partition_parameters(model, OptimConfig()))
    assert partition_table(partition_parameters(wrapped, OptimConfig())) == plain
