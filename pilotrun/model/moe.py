"""DeepSeekMoE feed-forward: shared experts + routed experts behind a sigmoid (or softmax) router.

The router runs in fp32 with autocast off; the aux-free bias chooses experts but never weights them; routed
experts are stored stacked [E, out, in] so that Muon can orthogonalize each slice in one batch and unrouted
experts still get a (zero) gradient instead of None.

Dispatch implementations (`moe_impl`), which all compute y_t = sum_k w_{t,k} FFN_{S_t[k]}(u_t):
  grouped   -- the sorted layout below, but each projection is one `grouped_mm` over all segments with offsets
               cumsum(counts) (no host sync): one operator instead of one matmul per expert. Used where torch
               provides grouped_mm for the device and dtype (probed once, see `grouped_matmul_works`);
               elsewhere it runs `sorted`. On the CPU its forward equals sorted's bit for bit; gradients to
               rounding (the BLAS sees other layouts), tests/model/test_moe.py. On the CPU in fp32 without
               autocast, with `cpu_kernels`, it runs as one compiled operator each way instead
               (forward_fused), the same arithmetic without the per-segment views and autograd nodes, and the
               shared experts with it. In bf16/fp16 on the CPU each segment is padded to one of a few lengths
               (segment_buckets.py; so are `sorted`'s and `loop`'s): a per-shape kernel cache then stops
               growing after the first updates.
  sorted    -- stable argsort of the chosen expert ids, one gather, one matmul chain per contiguous expert
               segment (one host sync per layer for the segment sizes), fp32 weighting, one index_add_.
  loop      -- DeepSeek's inference loop: per expert, find its tokens with `where` and add its output.
  dense_ref -- every expert on every token, weighted by a [N, E] matrix that is zero off the selection. E
  times the compute; kept as the obviously-correct oracle for tests.

CPU kernels (`cpu_kernels`, default on): on the CPU the router's matmul, top-k, gate normalization, balance
term, statistics, sort by expert and weighted combine run as compiled kernels (cpu_kernels.py,
moe_kernels.cpp), and so do the grouped dispatch's routed experts together with the shared experts, because
there ~100 small PyTorch operators per layer cost as much as the expert matmuls at pilot microbatches
(BENCHMARKS.md). The layer is then two operators each way, the router and the experts, whose backward are C++
autograd nodes. Under torch.compile the layer then runs eagerly between the block's compiled parts
(MoE.forward), keeping them. Elsewhere (CUDA, autocast for the experts, a dispatch mode, group-limited
routing, no compiler) the reference operators below run, and are what torch.compile traces; both give the same
layer output bit for bit on the CPU.

Because the dispatches' gradients agree only to rounding, `model.moe_impl` and `model.cpu_kernels` are not
resume-free keys (config.RESUME_FREE_KEYS): a resume across a change of either needs `--allow-change`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pilotrun.model.balancing import balance_loss_terms, default_route_scale, router_z_loss, uses_expert_bias
from pilotrun.model.cpu_kernels import (
    FusedCombine,
    FusedExperts,
    FusedRouter,
    fused_experts_apply,
    fused_routing_applies,
)
from pilotrun.model.recompute import recomputing
from pilotrun.model.segment_buckets import PaddedSegments, bucket_rows, pads_segments


def count_per_expert(indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many (token, slot) pairs chose each expert, int64 [E]. A scatter_add into a fixed-size vector
    rather than `bincount`, whose output length depends on the data and breaks torch.compile graphs."""
    flat = indices.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )


class SortedLayout(NamedTuple):
    """The (token, slot) pairs sorted by expert: what the sorted and grouped dispatches share."""
    order: torch.Tensor  # [N*K] int64: flat slot ids t*K + k, stably sorted by expert id
    token_of_slot: torch.Tensor  # [N*K] int64: the token of each sorted slot (order // K)
    counts: torch.Tensor  # [E] int64: how many slots each expert got (its segment length)


def sorted_layout(indices: torch.Tensor, n_experts: int) -> SortedLayout:
    flat_experts = indices.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)  # fixed accumulation order -> deterministic
    return SortedLayout(order, order // indices.shape[1], count_per_expert(flat_experts, n_experts))


@dataclasses.dataclass
class Routing:
    """One forward's routing decision and what the loss and the statistics need from it."""
    indices: torch.Tensor  # [N, K] chosen experts (biased choice)
    weights: torch.Tensor  # [N, K] gate weights from the unbiased scores (differentiable)
    logits: torch.Tensor  # [N, E] router logits (differentiable; the z-loss reads them)
    balance_value: torch.Tensor  # mean balance term sum_i f_i P_i (differentiable)
    fused: bool  # made by the fused CPU kernel (then layout and statistics are set, scores is None)
    layout: SortedLayout | None = None
    scores: torch.Tensor | None = None  # [N, E], reference path only
    statistics: torch.Tensor | None = None  # fused path: ROUTER_STATISTICS sums, then the |logit| maximum
    # fused path: seq_aux_alpha * balance_value where the mode has it, else 0
    balance_loss: torch.Tensor | None = None
    recorded: bool = False  # the fused kernel already added this routing to the step's statistics


# torch >= 2.9 has torch._grouped_mm with a CPU implementation; later versions also name it F.grouped_mm.
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def grouped_matmul_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether GROUPED_MM runs on this device and dtype and equals one matmul per segment there.

    Probed once per (device, dtype) with ragged segments, an empty one included, because support differs by
    platform (CUDA kernels want bf16 on recent GPUs and have alignment rules; the CPU takes every dtype), and
    a wrong answer must fall back to the segment loop rather than train on it.
    """
    if GROUPED_MM is None:
        return False
    generator = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 8]
    rows = torch.randn(sum(counts), 16, generator=generator).to(device=device, dtype=dtype)
    stacked = torch.randn(len(counts), 16, 8, generator=generator).to(device=device, dtype=dtype)
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    try:
        grouped = GROUPED_MM(rows, stacked, offs=offsets)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    per_segment = torch.cat([segment @ stacked[i] for i, segment in enumerate(rows.split(counts))])
    return grouped.shape == per_segment.shape and torch.allclose(grouped.float(), per_segment.float(),
                                                                 rtol=1e-2, atol=1e-2)


class SwiGLU(nn.Module):
    """FFN(x) = W2 (silu(W1 x) * W3 x): the dense FFN of the first layers, and the shared experts."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    """Token-choice top-k router with the aux-free bias (V3 eq. 12-16)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, score_func: str, route_norm: bool,
                 route_scale: float, n_groups: int, n_limited_groups: int, use_bias: bool):
        super().__init__()
        self.n_experts = n_experts
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self.n_groups = n_groups
        self.n_limited_groups = n_limited_groups
        self.use_bias = use_bias
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        # A buffer, never a Parameter: it must not be trained, decayed or clipped (the optimizer only sees
        # parameters). Persistent,
        # so checkpoints carry it; fp32 whatever the model dtype. Always present (zeros when unused) so the
        # state dict has one shape for every balance mode.
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, d] -> (indices [N, K] int64, weights [N, K] fp32, scores [N, E] fp32, logits [N, E] fp32)."""
        logits = self.logits(x)
        return (*self.select(logits), logits)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, d] -> router logits [N, E] in fp32 (fp64 in oracle tests), autocast off: bf16 rounding
        would flip near-tied top-k choices."""
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.to(compute_dtype), self.weight.to(compute_dtype))

    def select(self, logits: torch.Tensor, force_balanced: bool = False) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
        """The reference routing: logits -> (indices, gate weights, scores), with PyTorch operators.

        force_balanced (the debug switch `model.force_balanced_routing`): token t takes experts (t*K + k) mod
        E instead of its top-k, so every expert gets the same load, and the gate weights are gathered from the
        scores as usual: the best case for dispatch throughput, and a way to tell routing bugs from others."""
        with torch.autocast(device_type=logits.device.type, enabled=False):
            if self.score_func == "sigmoid":
                scores = torch.sigmoid(logits)
            else:
                # over all experts, before top-k (DeepSeek, not Mixtral)
                scores = torch.softmax(logits, dim=-1)
            with torch.no_grad():
                indices = self.biased_choice(scores).topk(self.top_k, dim=-1, sorted=True).indices
                if force_balanced:
                    slots = torch.arange(indices.numel(), device=indices.device).view_as(indices)
                    indices = slots % self.n_experts
            weights = scores.gather(1, indices)  # gate weights from the UNBIASED scores
            if self.route_norm:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            weights = weights * self.route_scale
        return indices, weights, scores

    @torch.no_grad()
    def biased_choice(self, scores: torch.Tensor) -> torch.Tensor:
        """What top-k selects from: the scores plus the aux-free bias (which never weights), with the experts
        outside the best groups at -inf under group-limited routing."""
        choice = scores.detach()
        if self.use_bias:
            choice = choice + self.expert_bias.to(scores.dtype)
        if self.n_groups > 1:
            choice = self.limit_to_best_groups(choice)
        return choice

    def limit_to_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Keep the n_limited_groups groups with the best group score; the rest become -inf (V3
        node-limited)."""
        tokens = choice.shape[0]
        grouped = choice.view(tokens, self.n_groups, self.n_experts // self.n_groups)
        if self.use_bias:
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        else:
            group_score = grouped.amax(dim=-1)
        kept_groups = group_score.topk(self.n_limited_groups, dim=-1, sorted=True).indices
        keep = torch.zeros(tokens, self.n_groups, dtype=torch.bool, device=choice.device)
        keep.scatter_(1, kept_groups, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(tokens, self.n_experts)


class GroupedExperts(nn.Module):
    """E routed SwiGLU experts stored stacked: w1, w3 [E, F, d] and w2 [E, d, F] (torchtitan layout)."""

    def __init__(self, d_model: int, hidden: int, n_experts: int):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, d_model))

    def expert_weights(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per-expert (w1, w2, w3) views from one `unbind` per stacked tensor. Indexing `w1[e]` per expert
        instead would make autograd build a full [E, F, d] zero gradient for every slice (most of an MoE
        layer's CPU time at pilot microbatches); unbind's backward stacks the slice gradients once."""
        return list(zip(self.w1.unbind(0), self.w2.unbind(0), self.w3.unbind(0)))

    @staticmethod
    def expert_forward(
        weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        w1, w2, w3 = weights
        return torch.matmul(F.silu(torch.matmul(x, w1.t())) * torch.matmul(x, w3.t()), w2.t())

    @staticmethod
    def pads(x: torch.Tensor) -> bool:
        """Whether the experts' matmuls of x's forward take padded segments
        (segment_buckets.pads_segments)."""
        device = x.device.type
        return pads_segments(x.device, torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                             else x.dtype)

    def segment_forward(self, weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor], segment: torch.Tensor,
                        pad: bool) -> torch.Tensor:
        """One expert on its segment; with `pad` (CPU bf16/fp16), on the segment padded with zero rows to its
        bucket length (segment_buckets.py), so that the matmuls take a few shapes, not one per length."""
        if not pad:
            return self.expert_forward(weights, segment)
        rows = segment.shape[0]
        return self.expert_forward(weights, F.pad(segment, (0, 0, 0, bucket_rows(rows) - rows)))[:rows]

    def forward_sorted(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                       layout: SortedLayout | None = None, fused_combine: bool = False) -> torch.Tensor:
        layout = layout if layout is not None else sorted_layout(indices, self.n_experts)
        counts = layout.counts.tolist()  # the one host sync per layer
        # backward: one index_add (cheaper than indexing's)
        gathered = x.index_select(0, layout.token_of_slot)
        weights_per_expert = self.expert_weights()
        pad = self.pads(x)
        outputs = [self.segment_forward(weights_per_expert[expert], segment, pad)
                   for expert, segment in enumerate(gathered.split(counts)) if counts[expert] > 0]
        routed = torch.cat(outputs, dim=0) if outputs else gathered.new_zeros(0, x.shape[-1])
        return self.weight_and_combine(routed, weights, layout, x.shape[0], fused_combine)

    def forward_grouped(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                        layout: SortedLayout | None = None, fused_combine: bool = False) -> torch.Tensor:
        compute_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) \
            else torch.promote_types(x.dtype, self.w1.dtype)
        # grouped_mm's tracing (fake tensor) kernel accepts bf16 only, so torch.compile traces the segment
        # loop for other dtypes (inductor fuses that anyway).
        traced_unsupported = torch.compiler.is_compiling() and compute_dtype != torch.bfloat16
        if traced_unsupported or not grouped_matmul_works(x.device, compute_dtype):
            return self.forward_sorted(x, indices, weights, layout, fused_combine)
        layout = layout if layout is not None else sorted_layout(indices, self.n_experts)
        # Where each expert's segment ends: stays on the device, so no host sync.
        offsets = layout.counts.cumsum(0).to(torch.int32)
        # grouped_mm is not on autocast's lists: cast explicitly, as autocast does for the matmuls of
        # `sorted`, once per use, so that the two input gradients are summed in x's dtype as there (no-ops in
        # fp32).
        gathered = x.index_select(0, layout.token_of_slot)
        padded = (
            PaddedSegments(layout.counts.tolist(), x.device)
            if pads_segments(x.device, compute_dtype)
            else None
        )
        # CPU bf16/fp16: a few matmul shapes, not one per segment length (segment_buckets.py)
        if padded is not None:
            gathered, offsets = padded.pad(gathered), padded.offsets(x.device)
        w1, w2, w3 = (w.to(compute_dtype).transpose(-2, -1) for w in (self.w1, self.w2, self.w3))
        hidden = (F.silu(GROUPED_MM(gathered.to(compute_dtype), w1, offs=offsets))
                  * GROUPED_MM(gathered.to(compute_dtype), w3, offs=offsets))
        routed = GROUPED_MM(hidden, w2, offs=offsets)
        routed = padded.unpad(routed) if padded is not None else routed
        return self.weight_and_combine(routed, weights, layout, x.shape[0], fused_combine)

    def forward_fused(self, x: torch.Tensor, weights: torch.Tensor, layout: SortedLayout,
                      shared: SwiGLU | None = None) -> torch.Tensor:
        """forward_grouped's computation as one compiled CPU operator each way (cpu_kernels.FusedExperts): the
        gather, every expert's SwiGLU on its segment and the combine, without per-segment tensors or autograd
        nodes; with `shared`, plus that SwiGLU on every token (the layer's shared experts, added in the
        combine as the layer adds them). The caller checks cpu_kernels.fused_experts_apply."""
        shared_weights = (shared.w1.weight, shared.w2.weight, shared.w3.weight) if shared is not None else ()
        return FusedExperts.apply(x, weights, self.w1, self.w2, self.w3, layout.order, layout.token_of_slot,
                                  layout.counts, *shared_weights)

    @staticmethod
    def weight_and_combine(routed: torch.Tensor, weights: torch.Tensor, layout: SortedLayout, tokens: int,
                           fused: bool = False) -> torch.Tensor:
        """Scale each sorted expert output by its gate weight and add it into its token's row.

        In fp32 (or wider), whatever the autocast dtype of the expert matmuls. `fused`: one kernel
        pass each way (cpu_kernels.FusedCombine; same forward bit for bit). Otherwise index_select rather
        than indexing (its backward is an index_add, not an accumulating index_put), and index_add_ in place
        on the fresh zeros (the out-of-place form copies them once more)."""
        routed = routed.to(weights.dtype)
        if fused:
            return FusedCombine.apply(routed, weights, layout.order, layout.token_of_slot, tokens)
        weighted = routed * weights.reshape(-1).index_select(0, layout.order).unsqueeze(-1)
        combined = torch.zeros(tokens, routed.shape[-1], device=routed.device, dtype=weights.dtype)
        return combined.index_add_(0, layout.token_of_slot, weighted)

    def forward_loop(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        output = torch.zeros(x.shape[0], x.shape[-1], device=x.device, dtype=weights.dtype)
        counts = count_per_expert(indices, self.n_experts).tolist()
        weights_per_expert = self.expert_weights()
        pad = self.pads(x)
        for expert in range(self.n_experts):
            if counts[expert] == 0:
                continue
            # each token picks an expert at most once: unique rows
            token, slot = torch.where(indices == expert)
            contribution = (self.segment_forward(weights_per_expert[expert], x[token], pad).to(weights.dtype)
                            * weights[token, slot].unsqueeze(-1))
            output = output.index_add(0, token, contribution)
        return output

    def forward_dense_reference(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        hidden = F.silu(torch.einsum("nd,efd->enf", x, self.w1)) * torch.einsum("nd,efd->enf", x, self.w3)
        every_output = torch.einsum("enf,edf->end", hidden, self.w2)  # [E, N, d]
        gate = torch.zeros(x.shape[0], self.n_experts, device=x.device, dtype=weights.dtype)
        gate = gate.scatter(1, indices, weights)  # zero outside the selection
        return torch.einsum("ne,end->nd", gate, every_output.to(gate.dtype))


@torch.compiler.disable
def run_eagerly(function, *args):
    """function(*args) outside torch.compile's graph: Dynamo breaks the graph here and the call runs
    eagerly."""
    return function(*args)


class MoE(nn.Module):
    """Shared experts + routed experts; returns the FFN output and this layer's auxiliary loss."""

    def __init__(
        self,
        d_model: int,
        moe_hidden: int,
        n_routed_experts: int,
        n_shared_experts: int,
        top_k: int,
        score_func: str = "sigmoid",
        route_norm: bool = True,
        route_scale: float = 0.0,
        n_expert_groups: int = 1,
        n_limited_groups: int = 1,
        balance: str = "aux_free+seq",
        seq_aux_alpha: float = 1e-4,
        z_loss_beta: float = 0.0,
        moe_impl: str = "grouped",
        cpu_kernels: bool = True,
        force_balanced_routing: bool = False,
    ):
        super().__init__()
        if route_scale == 0.0:  # 0 = default: Moonlight's formula for sigmoid routers, 1.0 for softmax
            route_scale = default_route_scale(n_routed_experts, top_k) if score_func == "sigmoid" else 1.0
        self.n_routed_experts = n_routed_experts
        self.top_k = top_k
        self.balance = balance
        self.seq_aux_alpha = seq_aux_alpha
        self.z_loss_beta = z_loss_beta
        self.moe_impl = moe_impl
        self.score_func = score_func
        # The compiled CPU kernels where they apply (cpu_kernels.fused_routing_applies, fused_experts_apply).
        self.cpu_kernels = cpu_kernels
        self.force_balanced_routing = force_balanced_routing  # debug switch: Router.select's force_balanced
        self.gate = Router(d_model, n_routed_experts, top_k, score_func, route_norm, route_scale,
                           n_expert_groups, n_limited_groups, use_bias=uses_expert_bias(balance))
        self.experts = GroupedExperts(d_model, moe_hidden, n_routed_experts)
        self.shared_experts = SwiGLU(d_model, n_shared_experts * moe_hidden) if n_shared_experts > 0 else None
        # Per-step statistics (training forwards only; reset by the trainer after each optimizer step).
        self.register_buffer("tokens_per_expert", torch.zeros(n_routed_experts), persistent=False)
        # Router sums, one vector so that a forward adds them with one op: see ROUTER_STATISTICS.
        self.register_buffer("router_statistics", torch.zeros(len(ROUTER_STATISTICS)), persistent=False)
        self.register_buffer("router_logit_absmax", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling() and self.kernels_may_apply(x):
            # Traced, the layer would lose its CPU kernels (opaque to Dynamo) for ~100 reference operators and
            # a host sync on the segment sizes; run eagerly instead, with them, between the block's compiled
            # parts.
            return run_eagerly(self.forward_layer, x)
        return self.forward_layer(x)

    def kernels_may_apply(self, x: torch.Tensor) -> bool:
        """Whether the CPU kernels can take this layer's forward: CPU fp32 tokens without autocast (the full
        conditions, checked eagerly, are cpu_kernels.fused_routing_applies and fused_experts_apply)."""
        return (self.cpu_kernels and x.device.type == "cpu" and x.dtype == torch.float32
                and not torch.is_autocast_enabled("cpu"))

    def forward_layer(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, d_model = x.shape
        flat = x.reshape(batch * seq, d_model)
        record = self.training and not recomputing()  # counted once, not again in an activation recompute
        routing = self.route(flat, batch, record)
        if (
            self.moe_impl == "grouped"
            and routing.fused
            and self.experts_kernel_applies(flat, routing.weights)
        ):
            # The shared experts run inside the experts operator: no separate SwiGLU, add or gradient sums.
            output = self.experts.forward_fused(flat, routing.weights, routing.layout, self.shared_experts)
        else:
            output = self.dispatch(flat, routing).to(x.dtype)
            if self.shared_experts is not None:
                output = output + self.shared_experts(flat)
        aux_loss = self.auxiliary_loss(routing)
        if record and not routing.recorded:
            self.record_statistics(routing)
        return output.reshape(batch, seq, d_model), aux_loss

    def route(self, flat: torch.Tensor, batch: int, record: bool = False) -> Routing:
        """Router logits, then the choice, gate weights and balance term: by the fused CPU kernel where it
        applies (which then also adds the routing to the step's statistics when `record`, and scales the
        balance loss), else by the reference operators (Router.select, balancing.balance_loss_terms).

        The balance term is computed in every mode (for the diagnostics), over each packed row (one row = one
        sequence) or, for balance="batch", over the whole microbatch."""
        groups = 1 if self.balance == "batch" else batch
        gate = self.gate
        # The router's dtype (Router.logits): fp32, or fp64 in oracle tests, whatever autocast would choose.
        dtype = torch.promote_types(flat.dtype, torch.float32)
        if (
            self.cpu_kernels
            and not self.force_balanced_routing
            and fused_routing_applies(flat, gate.n_groups, dtype)
        ):
            tokens = flat if flat.dtype == dtype else flat.to(dtype)
            weight = gate.weight if gate.weight.dtype == dtype else gate.weight.to(dtype)
            bias = gate.expert_bias if gate.expert_bias.dtype == dtype else gate.expert_bias.to(dtype)
            logits, weights, balance_value, balance_loss, indices, order, token_of_slot, counts, sums = (
                FusedRouter.apply(tokens, weight, bias if gate.use_bias else bias[:0], self.top_k,
                                  self.score_func == "sigmoid", gate.route_norm, gate.route_scale, groups,
                                  self.balance_loss_weight(), record, self.tokens_per_expert,
                                  self.router_statistics, self.router_logit_absmax))
            return Routing(indices, weights, logits, balance_value, fused=True,
                           layout=SortedLayout(order, token_of_slot, counts), statistics=sums,
                           balance_loss=balance_loss, recorded=record)
        logits = gate.logits(flat)
        indices, weights, scores = gate.select(logits, self.force_balanced_routing)
        experts, top_k = self.n_routed_experts, self.top_k
        term = balance_loss_terms(
            scores.view(groups, -1, experts), indices.view(groups, -1, top_k), experts, top_k, self.score_func
        )
        return Routing(indices, weights, logits, term.mean(), fused=False, scores=scores)

    def experts_kernel_applies(self, flat: torch.Tensor, gate_weights: torch.Tensor) -> bool:
        """Whether the experts operator takes this forward's grouped dispatch
        (cpu_kernels.fused_experts_apply), shared experts included: their weights must be fp32 too."""
        shared = self.shared_experts
        return fused_experts_apply(flat, gate_weights, self.experts.w1) and (
            shared is None or shared.w1.weight.dtype == shared.w2.weight.dtype == shared.w3.weight.dtype
            == torch.float32)

    def dispatch(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed experts' combined output with PyTorch operators (the shared experts are the
        caller's)."""
        if self.moe_impl == "grouped":
            return self.experts.forward_grouped(
                flat, routing.indices, routing.weights, routing.layout, routing.fused
            )
        if self.moe_impl == "sorted":
            return self.experts.forward_sorted(
                flat, routing.indices, routing.weights, routing.layout, routing.fused
            )
        if self.moe_impl == "loop":
            return self.experts.forward_loop(flat, routing.indices, routing.weights)
        if self.moe_impl == "dense_ref":
            return self.experts.forward_dense_reference(flat, routing.indices, routing.weights)
        raise ValueError(f"unknown moe_impl '{self.moe_impl}'")

    def balance_loss_weight(self) -> float:
        """alpha where the balance mode puts the balance term in the loss (aux_free+seq, seq, batch), else
        0."""
        return self.seq_aux_alpha if self.balance in ("aux_free+seq", "seq", "batch") else 0.0

    def auxiliary_loss(self, routing: Routing) -> torch.Tensor:
        """alpha * balance term where the mode puts it in the loss (aux_free+seq, seq, batch), plus beta *
        z-loss."""
        if routing.balance_loss is not None:  # the fused kernel's alpha * balance term (zeros where none)
            if self.z_loss_beta > 0:
                return routing.balance_loss + self.z_loss_beta * router_z_loss(routing.logits)
            return routing.balance_loss
        terms = []
        if self.balance in ("aux_free+seq", "seq", "batch"):
            terms.append(self.seq_aux_alpha * routing.balance_value)
        if self.z_loss_beta > 0:
            terms.append(self.z_loss_beta * router_z_loss(routing.logits))
        if not terms:
            return routing.logits.new_zeros(())
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]

    @torch.no_grad()
    def record_statistics(self, routing: Routing) -> None:
        """Counts from the actual (biased) selection, and the router sums of ROUTER_STATISTICS."""
        if routing.statistics is not None:  # the fused kernel summed them already
            self.tokens_per_expert.add_(routing.layout.counts)
            self.router_statistics.add_(routing.statistics[:-1].to(self.router_statistics.dtype))
            self.router_logit_absmax.copy_(
                torch.maximum(self.router_logit_absmax, routing.statistics[-1].float())
            )
            return
        indices, logits = routing.indices, routing.logits
        self.tokens_per_expert.add_(count_per_expert(indices, self.n_routed_experts).float())
        scores = routing.scores.detach()
        probabilities = scores / scores.sum(dim=-1, keepdim=True) if self.score_func == "sigmoid" else scores
        entropy = -(probabilities * torch.log(probabilities.clamp_min(1e-30))).sum(dim=-1)
        sums = torch.stack([
            torch.tensor(float(scores.shape[0]), device=scores.device, dtype=scores.dtype),
            entropy.sum(),
            # Spread across experts, per token: the population std, written out because `std` over a last
            # dimension of E = 8 takes a slow reduction path on the CPU, slower than these four ops together.
            (scores - scores.mean(dim=-1, keepdim=True)).square().mean(dim=-1).sqrt().sum(),
            scores.gather(1, indices).sum(),  # top-k mass before normalization
            routing.balance_value.detach(),
            *self.choice_figures(scores, indices),
            torch.ones((), device=scores.device, dtype=scores.dtype),
        ])
        self.router_statistics.add_(sums.to(self.router_statistics.dtype))
        self.router_logit_absmax.copy_(
            torch.maximum(self.router_logit_absmax, logits.detach().abs().max().float())
        )

    def choice_figures(
        self, scores: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing diagnostics, summed over tokens: the route margin (K-th minus (K+1)-th biased choice score,
        over the experts the routing could pick; 0 where none is left out) and how many tokens the bias moved
        to another expert set than the top-k of the unbiased scores (0 without a bias)."""
        gate, top_k = self.gate, self.top_k
        choice = gate.biased_choice(scores)
        margin = scores.new_zeros(())
        if top_k < self.n_routed_experts:
            best = choice.topk(top_k + 1, dim=-1).values
            gap = best[:, top_k - 1] - best[:, top_k]
            margin = torch.where(torch.isfinite(gap), gap, torch.zeros_like(gap)).sum()  # group limit: -inf
        flips = scores.new_zeros(())
        if gate.use_bias:
            unbiased = scores.topk(top_k, dim=-1).indices.sort(dim=-1).values
            flips = (unbiased != indices.sort(dim=-1).values).any(dim=-1).sum().to(scores.dtype)
        return margin, flips


# What MoE.router_statistics sums over a step's training forwards (diagnostics turns them into means).
ROUTER_STATISTICS = (
    "tokens",
    "entropy",
    "score_spread",
    "topk_mass",
    "balance_term",
    "route_margin",
    "bias_flips",
    "microbatches",
)
