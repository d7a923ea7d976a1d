"""Which parameter goes to which optimizer: an explicit partition by name and shape (docs/MODEL.md).

Muon takes the hidden matrices: attention projections, dense and shared-expert SwiGLU matrices, and the
stacked routed experts (orthogonalised per expert slice). AdamW takes the embedding, the output head, every
RMSNorm gain, the router (by default; `optim.router_optimizer="muon"` moves it) and any other vector. Buffers
(the MoE balancing bias, RoPE tables, counters) are not parameters and so are in no group.

Muon's justification is steepest descent under the spectral norm for matrices acting on a hidden space
(Moonlight 2.1); the embedding is a lookup table and the head feeds a V-way softmax, so they must never reach
Muon. The rules are therefore written out by name rather than guessed from `ndim`, and a matrix that matches
no rule is an error instead of a silent default. The result is a table that run.json records.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from pilotrun.config import OptimConfig

# (group name, pattern on the full parameter name, optimizer). First match wins; order matters only for
# readability, the patterns do not overlap.
MUON_RULES = (
    ("attention", re.compile(r"(^|\.)attn\.(wq|wq_a|wq_b|wkv_a|wkv_b|wo)\.weight$")),
    ("dense_ffn", re.compile(r"(^|\.)ffn\.(w1|w2|w3)\.weight$")),
    ("shared_experts", re.compile(r"(^|\.)ffn\.shared_experts\.(w1|w2|w3)\.weight$")),
    ("routed_experts", re.compile(r"(^|\.)ffn\.experts\.(w1|w2|w3)$")),
)
EMBEDDING_RULE = re.compile(r"^embed\.weight$")
HEAD_RULE = re.compile(r"^head\.weight$")
NORM_RULE = re.compile(r"(^|\.)(attn_norm|ffn_norm|q_norm|kv_norm|norm)\.weight$")
ROUTER_RULE = re.compile(r"(^|\.)ffn\.gate\.weight$")

# Group order in the optimizer and the table: Muon groups first, then AdamW groups.
GROUP_ORDER = ("attention", "dense_ffn", "shared_experts", "routed_experts", "router_muon",
               "embedding", "head", "norms", "router", "other_vectors")


# Prefixes that wrappers put in front of the model's own names: DDP ("module.") and torch.compile
# ("_orig_mod."). The partition and its table use the model's own names either way.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name


def classify_parameter(name: str, param: torch.Tensor, router_optimizer: str) -> str:
    """The group name for one parameter; raises ValueError for a matrix no rule covers."""
    if EMBEDDING_RULE.search(name):
        return "embedding"
    if HEAD_RULE.search(name):
        return "head"
    if NORM_RULE.search(name):
        return "norms"
    if ROUTER_RULE.search(name):
        return "router_muon" if router_optimizer == "muon" else "router"
    for group, pattern in MUON_RULES:
        if pattern.search(name):
            expected_ndim = 3 if group == "routed_experts" else 2
            if param.ndim != expected_ndim:
                raise ValueError(f"partition: parameter '{name}' of shape {tuple(param.shape)} matches the "
                                 f"'{group}' rule but is not {expected_ndim}-D")
            return group
    if param.ndim < 2:  # a bias or other vector has no spectral norm to steer: AdamW
        return "other_vectors"
    raise ValueError(
        f"partition: no rule assigns parameter '{name}' of shape {tuple(param.shape)} to Muon or "
        "AdamW; add it to pilotrun/optim/partition.py explicitly"
    )


def partition_parameters(model: torch.nn.Module, optim_cfg: OptimConfig) -> list[dict[str, Any]]:
    """Torch param groups (`params`, `param_names`, `name`, `use_muon`, `base_lr`, `lr`, `weight_decay`
    and the optimizer's hyperparameters), every trainable parameter in exactly one group."""
    members: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        name = canonical_name(name)
        group = classify_parameter(name, param, optim_cfg.router_optimizer)
        members.setdefault(group, []).append((name, param))

    groups = []
    for group_name in GROUP_ORDER:
        if group_name not in members:
            continue
        names = [n for n, _ in members[group_name]]
        params = [p for _, p in members[group_name]]
        use_muon = group_name in ("attention", "dense_ffn", "shared_experts", "routed_experts", "router_muon")
        if use_muon:
            muon = optim_cfg.muon
            group = {"lr": muon.lr, "weight_decay": muon.weight_decay, "momentum": muon.momentum,
                     "nesterov": muon.nesterov, "ns_steps": muon.ns_steps, "scale_mode": muon.scale_mode,
                     "ns_variant": muon.ns_variant, "ns_dtype": "auto"}
        else:
            adamw = optim_cfg.adamw
            weight_decay = adamw.weight_decay
            if group_name == "norms" and not optim_cfg.wd_norms:  # optim.wd_norms: false exempts the gains
                weight_decay = 0.0
            group = {
                "lr": adamw.lr,
                "weight_decay": weight_decay,
                "betas": tuple(adamw.betas),
                "eps": adamw.eps,
            }
        group.update({"params": params, "param_names": names, "name": group_name, "use_muon": use_muon,
                      "base_lr": group["lr"]})
        if use_muon and optim_cfg.muon.granularity == "per_head":
            group["row_blocks"] = [head_row_block(model, name) for name in names]
        groups.append(group)
    return groups


def head_row_block(model: torch.nn.Module, name: str) -> int:
    """`per_head` granularity: the rows of one head in an MLA projection whose rows are laid out head by head
    (wq / wq_b: d_nope + d_rope per head; wkv_b: d_nope + d_v per head), else 0 (the parameter is one
    matrix)."""
    module_name, _, leaf = name.rpartition(".")
    projection = module_name.rpartition(".")[2]
    if leaf != "weight" or projection not in ("wq", "wq_b", "wkv_b"):
        return 0
    attention = model.get_submodule(module_name.rpartition(".")[0])
    if projection == "wkv_b":
        return attention.qk_nope_head_dim + attention.v_head_dim
    return attention.qk_nope_head_dim + attention.qk_rope_head_dim


def partition_table(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON rows for run.json's optimizer section: group, parameters, count, optimizer, lr, weight_decay.

    `count` is the number of scalar weights in the group; `lr` is the group's base (peak) learning rate.
    """
    rows = []
    for group in groups:
        rows.append({
            "group": group["name"],
            "parameters": list(group["param_names"]),
            "count": int(sum(p.numel() for p in group["params"])),
            "optimizer": "muon" if group["use_muon"] else "adamw",
            "lr": float(group.get("base_lr", group["lr"])),
            "weight_decay": float(group["weight_decay"]),
        })
    return rows
