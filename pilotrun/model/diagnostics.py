"""Per-step model statistics for the trainer: expert loads, router health, aux-free bias, max attention
logits.

The forward passes accumulate (training mode only) into buffers of each MoE and MLA module;
`collect_step_statistics` packs them into two tensors that the trainer all-reduces (SUM for the counts, MAX
for the logits) before the QK-Clip and the bias update, and `reset_step_statistics` clears them after each
optimizer step. `moe_diagnostics` turns the (global) counts into the JSON-ready dict that metrics.jsonl
records.
"""

from __future__ import annotations

import math

import torch

from pilotrun.model.balancing import uses_expert_bias
from pilotrun.model.moe import ROUTER_STATISTICS


def collect_step_statistics(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_per_expert [L_moe, E], qk_max_logit [L_attn, H]) as fp32 copies, on the model's device."""
    moe_layers = model.moe_layers()
    attention_layers = model.attention_layers()
    if moe_layers:
        tokens_per_expert = torch.stack(
            [moe.tokens_per_expert.detach().float() for moe in moe_layers]
        ).clone()
    else:
        device = attention_layers[0].qk_max_logit.device
        tokens_per_expert = torch.zeros(0, max(model.cfg.n_routed_experts, 0), device=device)
    qk_max_logit = torch.stack([attn.qk_max_logit.detach().float() for attn in attention_layers]).clone()
    return tokens_per_expert, qk_max_logit


@torch.no_grad()
def reset_step_statistics(model: torch.nn.Module) -> None:
    """Zero the expert counters and router sums, and set every max-logit tracker back to -inf."""
    for moe in model.moe_layers():
        moe.tokens_per_expert.zero_()
        moe.router_statistics.zero_()
        moe.router_logit_absmax.zero_()
    for attn in model.attention_layers():
        attn.qk_max_logit.fill_(float("-inf"))
    for block in model.layers:
        block.output_square_sum.zero_()
        block.output_elements.zero_()


def block_output_rms(model: torch.nn.Module) -> list[float | None]:
    """The RMS of each block's output (the residual stream after it) over this rank's
    training forwards since the last reset; None for a block that has not run. Growth across a run is the
    output-RMS drift Moonlight (section 2.2) watches for."""
    figures = []
    for block in model.layers:
        elements = float(block.output_elements)
        figures.append(math.sqrt(float(block.output_square_sum) / elements) if elements > 0 else None)
    return figures


def expert_load_figures(counts: torch.Tensor) -> dict[str, float | int]:
    """Figures for one layer's counts c [E]: imbalance max/mean (= 1 + MaxVio), MaxVio, MinVio, CV, dead
    experts, normalized load entropy (1 = perfectly balanced). With no tokens counted every figure is 0 except
    dead."""
    counts = counts.double()
    total = float(counts.sum())
    n_experts = counts.numel()
    dead = int((counts == 0).sum())
    if total <= 0:
        return {
            "imbalance": 0.0,
            "would_drop_cf1": 0.0,
            "would_drop_cf1_25": 0.0,
            "maxvio": 0.0,
            "minvio": 0.0,
            "cv": 0.0,
            "dead": dead,
            "load_entropy": 0.0,
        }
    mean = total / n_experts
    share = counts / total
    entropy = float(-(share[share > 0] * share[share > 0].log()).sum())
    return {
        "imbalance": float(counts.max()) / mean,
        # `would_drop` at capacity factor kappa: the share of routed slots a capacity-factor-kappa router
        # would drop (we drop none): sum_i max(0, c_i - ceil(kappa * mean)) / sum_i c_i.
        "would_drop_cf1": float((counts - math.ceil(mean)).clamp_min(0).sum()) / total,
        "would_drop_cf1_25": float((counts - math.ceil(1.25 * mean)).clamp_min(0).sum()) / total,
        "maxvio": float(counts.max()) / mean - 1.0,
        "minvio": 1.0 - float(counts.min()) / mean,
        "cv": float(counts.std(unbiased=False)) / mean,
        "dead": dead,
        "load_entropy": entropy / math.log(n_experts) if n_experts > 1 else 1.0,
    }


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def moe_diagnostics(model: torch.nn.Module, tokens_per_expert: torch.Tensor) -> dict:
    """JSON-ready router/balance figures for one step (tokens_per_expert: the step's global [L_moe, E]
    counts).

    Load figures come from the given counts and the bias from the model; the router figures are means over
    this rank's own training forwards since the last reset (not all-reduced). Per-layer lists:
    tokens_per_expert, imbalance (max/mean), maxvio, dead_experts_per_layer, load_entropy (1 = balanced),
    router_entropy (mean normalized entropy of s', 1 = uniform), balance_term (sum f P, = L_seq / alpha),
    score_spread (mean over tokens of std over experts of s), speed_to_spread (bias_update_speed /
    score_spread, ~<= 0.1 is safe), topk_mass (mean selected score mass before normalization), route_margin
    (mean gap between the K-th and (K+1)-th biased choice score), bias_flip_rate (share of tokens whose expert
    set the aux-free bias changed), router_logit_absmax, bias_min, bias_max, bias_std. Scalars: max_imbalance,
    dead_experts (total), bias_abs_max.
    """
    moe_layers = model.moe_layers()
    counts = tokens_per_expert.detach().double().cpu()
    per_layer = [expert_load_figures(counts[index]) for index in range(len(moe_layers))]
    router: dict[str, list] = {
        key: []
        for key in (
            "router_entropy",
            "balance_term",
            "score_spread",
            "speed_to_spread",
            "topk_mass",
            "route_margin",
            "bias_flip_rate",
            "router_logit_absmax",
        )
    }
    bias_min, bias_max, bias_std, bias_abs_max = [], [], [], 0.0
    for moe in moe_layers:
        sums = dict(
            zip(ROUTER_STATISTICS, moe.router_statistics.detach().double().cpu().tolist(), strict=True)
        )
        tokens, batches = sums["tokens"], sums["microbatches"]
        uniform_entropy = math.log(moe.n_routed_experts) if moe.n_routed_experts > 1 else None
        spread = sums["score_spread"] / tokens if tokens > 0 else None
        router["router_entropy"].append(sums["entropy"] / tokens / uniform_entropy
                                        if tokens > 0 and uniform_entropy else None)
        router["balance_term"].append(sums["balance_term"] / batches if batches > 0 else None)
        router["score_spread"].append(spread)
        # The bias moves by +-gamma a step; gamma much above ~0.1 x the score spread oscillates.
        speed = model.cfg.bias_update_speed if uses_expert_bias(moe.balance) else 0.0
        router["speed_to_spread"].append(speed / spread if spread else None)
        router["topk_mass"].append(sums["topk_mass"] / tokens if tokens > 0 else None)
        router["route_margin"].append(sums["route_margin"] / tokens if tokens > 0 else None)
        router["bias_flip_rate"].append(sums["bias_flips"] / tokens if tokens > 0 else None)
        router["router_logit_absmax"].append(float(moe.router_logit_absmax) if tokens > 0 else None)
        bias = moe.gate.expert_bias.detach().double().cpu()
        bias_min.append(float(bias.min()))
        bias_max.append(float(bias.max()))
        bias_std.append(float(bias.std(unbiased=False)))
        bias_abs_max = max(bias_abs_max, float(bias.abs().max()))
    imbalance = [figures["imbalance"] for figures in per_layer]
    return {
        "tokens_per_expert": [[float(c) for c in row] for row in counts.tolist()],
        "imbalance": imbalance,
        "max_imbalance": max(imbalance) if imbalance else None,
        "maxvio": [figures["maxvio"] for figures in per_layer],
        "would_drop_cf1": [figures["would_drop_cf1"] for figures in per_layer],
        "would_drop_cf1_25": [figures["would_drop_cf1_25"] for figures in per_layer],
        "dead_experts": sum(figures["dead"] for figures in per_layer),
        "dead_experts_per_layer": [figures["dead"] for figures in per_layer],
        "load_entropy": [figures["load_entropy"] for figures in per_layer],
        **router,
        "bias_abs_max": bias_abs_max,
        "bias_min": bias_min,
        "bias_max": bias_max,
        "bias_std": bias_std,
    }


def attention_diagnostics(qk_max_logit: torch.Tensor) -> dict:
    """JSON-ready max attention logits: per layer (max over heads) and per layer and head; None where no
    training forward ran since the last reset (the tracker still holds -inf)."""
    values = qk_max_logit.detach().double().cpu()
    return {
        "max_logit": [_finite_or_none(float(row.max())) for row in values],
        "max_logit_per_head": [[_finite_or_none(float(v)) for v in row] for row in values.tolist()],
        "global_max_logit": _finite_or_none(float(values.max())) if values.numel() else None,
    }
