"""QK-Clip for Multi-head Latent Attention (the "Clip" of MuonClip; Kimi K2 2.1; docs/MODEL.md, "QK-Clip").

After an APPLIED update only, every head h whose max attention logit S_h (the softmax input, scale included,
measured over the step's training forwards) exceeds tau gets gamma_h = tau / max(S_h, tau), and its
head-specific query/key weights are rescaled so that every logit of that head is multiplied by exactly
gamma_h:

    wq (or wq_b) rows of head h, content part  [0, d_n)        *= sqrt(gamma_h)   (W^UQ_h)
    wq (or wq_b) rows of head h, rotary part   [d_n, d_n+d_r)  *= gamma_h         (W^QR_h)
    wkv_b rows of head h, key part             [0, d_n)        *= sqrt(gamma_h)   (W^UK_h)

since S = sigma*(q^C.k^C + q^R.k^R). Untouched: the value rows of wkv_b, wkv_a (W^DKV and the rotary key W^KR
shared by all heads, K2: "to avoid effect across heads"), wq_a, q_norm, kv_norm (scaling the down-projections
would be undone by the RMSNorms) and wo. Optimizer state is not modified (K2 modifies weights only).

gamma = tau / max(S, tau) is 1 for small or negative S, so a negative max logit can never produce a negative
factor and a NaN square root (the Megatron-LM PR #7517 bug). A layer whose measurement contains NaN or +inf is
skipped and reported, never clipped with gamma 0 or NaN; a -inf entry means "no logit measured" and is left
alone. Rows are head-major in both projections (the model views q as [.., H, d_qk] and wkv_b's output as [..,
H, d_n + d_v]), so row h * rows_per_head + i belongs to head h; the clip multiplies each weight by one per-row
factor column (1.0 for rows left alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from pilotrun.common.errors import CheckpointError
from pilotrun.config import QK_CLIP_HARD_GAMMA


@dataclass
class QKClipResult:
    """One QK-Clip pass: which heads were clipped (bool [L, H]), their gamma (fp32 [L, H], 1 where not
    clipped), how many, the smallest gamma (1.0 when nothing was clipped) and the attention layers skipped
    because their max logits were NaN or +inf."""

    clipped: torch.Tensor
    gamma: torch.Tensor
    n_heads_clipped: int
    min_gamma: float
    skipped_nonfinite_layers: list[int] = field(default_factory=list)


def _query_projection(attn: torch.nn.Module) -> torch.nn.Linear:
    return attn.wq_b if attn.q_lora_rank > 0 else attn.wq


def _scale_rows(weight: torch.Tensor, row_scale: torch.Tensor) -> None:
    """weight[r, :] *= row_scale[r] in place. Rows with factor 1.0 keep their exact bits (x * 1 == x). Under
    FSDP2 the weight is a DTensor sharded by rows: the factor column is sharded the same way, from the
    identical full column every rank holds (src_data_rank=None), so each rank scales its own rows."""
    factor = row_scale.to(device=weight.device, dtype=weight.dtype)[:, None]
    if isinstance(weight, DTensor):
        factor = distribute_tensor(factor, weight.device_mesh, weight.placements, src_data_rank=None)
    weight.mul_(factor)


@torch.no_grad()
def apply_qk_clip(model: torch.nn.Module, qk_max_logit: torch.Tensor, tau: float) -> QKClipResult:
    """Rescale the query/key weights of every head with max logit above `tau`, in place.

    `qk_max_logit` is [L_attn, H] (global: all-reduced MAX across ranks), in `model.attention_layers()` order.
    Call it only after an applied update.
    """
    if not tau > 0:
        raise ValueError(f"QK-Clip tau must be positive, got {tau}")
    layers = model.attention_layers()
    # One host copy of the small [L, H] table; the decisions are then plain Python.
    logits = qk_max_logit.detach().to(device="cpu", dtype=torch.float32)
    if logits.ndim != 2 or logits.size(0) != len(layers):
        raise ValueError(f"qk_max_logit has shape {tuple(logits.shape)}, expected [{len(layers)}, n_heads]")
    clipped = torch.zeros(logits.shape, dtype=torch.bool)
    gamma = torch.ones(logits.shape, dtype=torch.float32)
    skipped: list[int] = []
    for layer_index, attn in enumerate(layers):
        row = logits[layer_index]
        if row.size(0) != attn.n_heads:
            raise ValueError(
                f"qk_max_logit row {layer_index} has {row.size(0)} heads, the layer has {attn.n_heads}"
            )
        if torch.isnan(row).any() or torch.isposinf(row).any():
            skipped.append(layer_index)
            continue
        layer_gamma = tau / torch.clamp(row, min=tau)  # exactly 1.0 where S <= tau (and for -inf)
        heads = (row > tau).nonzero().flatten().tolist()
        if not heads:
            continue
        n_heads, d_n, d_r = attn.n_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
        query_scale = torch.ones(n_heads, d_n + d_r)
        key_value_scale = torch.ones(n_heads, d_n + attn.v_head_dim)
        for head in heads:
            g = float(layer_gamma[head])
            root = math.sqrt(g)
            query_scale[head, :d_n] = root     # q^C: sqrt(gamma)
            query_scale[head, d_n:] = g        # q^R: gamma (the shared k^R in wkv_a is not touched)
            key_value_scale[head, :d_n] = root  # k^C: sqrt(gamma); value rows keep 1
            clipped[layer_index, head] = True
            gamma[layer_index, head] = g
        _scale_rows(_query_projection(attn).weight, query_scale.flatten())
        _scale_rows(attn.wkv_b.weight, key_value_scale.flatten())
    n_clipped = int(clipped.sum())
    return QKClipResult(clipped=clipped, gamma=gamma, n_heads_clipped=n_clipped,
                        min_gamma=float(gamma.min()) if n_clipped else 1.0, skipped_nonfinite_layers=skipped)


# A `qk_clip` event line when a head is clipped for the first time in the run or hard (gamma below this).
HARD_CLIP_GAMMA = QK_CLIP_HARD_GAMMA


def qk_clip_events(result: QKClipResult, qk_max_logit: torch.Tensor,
                   first_clipped: list[tuple[int, int]]) -> list[dict]:
    """The fields of one `qk_clip` metrics event per head this pass clipped for the first time in the run
    (`first_clipped`, from QKClipCounters.update) or with gamma < HARD_CLIP_GAMMA: layer, head, the max logit
    S that triggered it, gamma = tau / S, and which of the two reasons hold. In (layer, head) order."""
    first = set(first_clipped)
    logits = qk_max_logit.detach().to(device="cpu", dtype=torch.float32)
    events = []
    for layer, head in result.clipped.nonzero().tolist():
        gamma = float(result.gamma[layer, head])
        if (layer, head) in first or gamma < HARD_CLIP_GAMMA:
            events.append(
                {
                    "layer": layer,
                    "head": head,
                    "max_logit": float(logits[layer, head]),
                    "gamma": gamma,
                    "first_time": (layer, head) in first,
                    "hard": gamma < HARD_CLIP_GAMMA,
                }
            )
    return events


class QKClipCounters:
    """Cumulative interventions per (attention layer, head), the number of updates that clipped anything, and
    the number of layer skips for non-finite logits. Part of the trainer state, so they survive a checkpoint.
    """

    def __init__(self, n_layers: int, n_heads: int):
        self.cumulative = torch.zeros((n_layers, n_heads), dtype=torch.int64)
        self.updates_with_clip = 0
        self.nonfinite_layer_skips = 0

    def update(self, result: QKClipResult) -> list[tuple[int, int]]:
        """Count one QK-Clip pass; returns the (layer, head) pairs clipped for the first time (each gets a
        `qk_clip` event, so the record shows when a head first needed clipping)."""
        clipped = result.clipped.to(torch.int64)
        if clipped.shape != self.cumulative.shape:
            raise ValueError(
                f"QK-Clip result shape {tuple(clipped.shape)} != counters {tuple(self.cumulative.shape)}"
            )
        first_time = ((self.cumulative == 0) & result.clipped).nonzero().tolist()
        self.cumulative += clipped
        self.updates_with_clip += int(result.n_heads_clipped > 0)
        self.nonfinite_layer_skips += len(result.skipped_nonfinite_layers)
        return [(int(layer), int(head)) for layer, head in first_time]

    def total_interventions(self) -> int:
        return int(self.cumulative.sum())

    def state_dict(self) -> dict:
        # Plain ints (JSON-able, exact), not tensors.
        return {"cumulative": self.cumulative.tolist(), "updates_with_clip": self.updates_with_clip,
                "nonfinite_layer_skips": self.nonfinite_layer_skips}

    def load_state_dict(self, state: dict) -> None:
        cumulative = torch.tensor(state["cumulative"], dtype=torch.int64)
        if cumulative.shape != self.cumulative.shape:
            raise CheckpointError(
                f"QK-Clip counters in the checkpoint have shape {tuple(cumulative.shape)}, the "
                f"model needs {tuple(self.cumulative.shape)} (attention layers, heads)"
            )
        self.cumulative = cumulative
        self.updates_with_clip = int(state["updates_with_clip"])
        self.nonfinite_layer_skips = int(state.get("nonfinite_layer_skips", 0))
