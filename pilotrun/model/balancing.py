"""Load balancing for the routed experts (docs/MODEL.md, "The model") and the default routed scale.

- Auxiliary-loss-free balancing: a per-expert bias b (fp32 buffer) is added to the router scores for the
  *selection* only; after each applied optimizer update the trainer calls `update_expert_bias`, which moves
  every b_i by gamma * sign(mean(c) - c_i) and re-centres the step (keeping |b| bounded), c = the step's
  counts.
- Sequence-wise (and batch-wise) auxiliary loss: alpha * mean_b sum_i f_{b,i} P_{b,i} (V3 eq. 17-20).
- Router z-loss: beta * mean_t logsumexp(z_t)^2 (ST-MoE), optional.
"""

from __future__ import annotations

import functools

import torch

BALANCE_MODES_WITH_BIAS = ("aux_free+seq", "aux_free")


def uses_expert_bias(balance: str) -> bool:
    return balance in BALANCE_MODES_WITH_BIAS


@functools.lru_cache(maxsize=64)
def default_route_scale(n_experts: int, top_k: int, samples: int = 1 << 17) -> float:
    """Moonlight App. C: route_scale = E_z[1 / sqrt(sum_k p_k^2)], p = renormalized top-K of sigmoid(z), z ~
    N(0, I_E).

    It makes the routed output's RMS comparable to one dense FFN's. Monte Carlo with its own fixed generator
    (independent of the global seed, so building a model never depends on how many draws came before); its
    values are E=4,K=2: 1.398, E=8,K=2: 1.409, E=64,K=6: 2.446 (Moonlight's figure).
    """
    generator = torch.Generator().manual_seed(12345)
    total = 0.0
    chunk = 1 << 14
    for start in range(0, samples, chunk):
        rows = min(chunk, samples - start)
        z = torch.randn(rows, n_experts, generator=generator, dtype=torch.float64)
        top = torch.sigmoid(z).topk(top_k, dim=-1).values
        p = top / top.sum(dim=-1, keepdim=True)
        total += float((1.0 / p.pow(2).sum(dim=-1).sqrt()).sum())
    return total / samples


def balance_loss_terms(scores: torch.Tensor, indices: torch.Tensor, n_experts: int, top_k: int,
                       score_func: str) -> torch.Tensor:
    """sum_i f_i P_i for each group of tokens, without alpha.

    scores: [S, T, E] fp32 router scores s (sigmoid or softmax) of S groups (sequences, or one group = the
    whole batch) of T tokens; indices: [S, T, K] the actual (biased) selection: the load the
    bias acts on, not the unbiased top-k.
    f_i = E / (K T) * #tokens choosing i (no gradient); P_i = mean_t s'_{t,i}, s' = s normalized over experts
    for a sigmoid router (Megatron-LM #1438), the softmax probabilities themselves for a softmax router.
    Returns [S]; equals 1 for perfectly balanced counts and E/K for total collapse onto K experts.
    """
    groups, tokens, _ = scores.shape
    with torch.no_grad():
        counts = torch.zeros(groups, n_experts, device=scores.device, dtype=torch.float32)
        counts.scatter_add_(1, indices.reshape(groups, -1), torch.ones_like(indices.reshape(groups, -1),
                                                                           dtype=torch.float32))
        fraction = counts * (n_experts / (top_k * tokens))
    if score_func == "sigmoid":
        normalized = scores / scores.sum(dim=-1, keepdim=True)
    else:
        normalized = scores
    probability = normalized.mean(dim=1)  # [S, E]
    return (fraction * probability).sum(dim=-1)


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean_t logsumexp_i(z_{t,i})^2 over the [N, E] fp32 router logits (multiply by beta outside)."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


def bias_update_delta(tokens_per_expert: torch.Tensor, speed: float) -> torch.Tensor:
    """Centered sign rule: delta_i = gamma * sign(mean(c) - c_i), minus its mean (so sum(delta) = 0).

    Overloaded experts (c_i above the mean) get their bias lowered. Centering adds the same constant to all
    biases, so it never changes a top-k or group choice, but keeps |b| bounded.
    """
    counts = tokens_per_expert.float()
    delta = speed * torch.sign(counts.mean(dim=-1, keepdim=True) - counts)
    return delta - delta.mean(dim=-1, keepdim=True)


@torch.no_grad()
def update_expert_bias(model: torch.nn.Module, tokens_per_expert: torch.Tensor, speed: float) -> None:
    """Apply the centered sign rule to every MoE layer's `gate.expert_bias` from the step's global counts.

    tokens_per_expert: [L_moe, E], summed over the step's microbatches and all-reduced over ranks, so every
    rank applies the identical update. The trainer calls this only after an applied update. Layers whose
    balance mode does not use the bias are left alone.
    """
    moe_layers = model.moe_layers()
    if tokens_per_expert.shape[0] != len(moe_layers):
        raise ValueError(
            f"tokens_per_expert has {tokens_per_expert.shape[0]} rows for {len(moe_layers)} MoE layers"
        )
    if speed == 0:
        return
    for layer_index, moe in enumerate(moe_layers):
        if not uses_expert_bias(moe.balance):
            continue
        bias = moe.gate.expert_bias
        bias.add_(bias_update_delta(tokens_per_expert[layer_index].to(bias.device), speed))
