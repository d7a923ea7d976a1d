"""Multi-head Latent Attention with decoupled RoPE, and the per-head max-logit tracker for QK-Clip.

Training path: keys and values are materialized from the latent. QK-Clip (docs/MODEL.md) needs each head's
largest pre-softmax logit measured here, and its rows addressable: the weight layout is head-major so that
QK-Clip can address one head's rows with `weight.view(H, rows_per_head, in)`:
  wq / wq_b rows per head: [0, d_n) content query W^UQ_h, [d_n, d_n + d_r) rotary query W^QR_h
  wkv_a rows:              [0, r_kv) latent W^DKV, [r_kv, r_kv + d_r) the one shared rotary key W^KR
  wkv_b rows per head:     [0, d_n) content key W^UK_h, [d_n, d_n + d_v) value W^UV_h

Attention implementations (`attn_impl`):
  eager -- materializes the fp32 logits, in blocks of query rows that multiply only the keys they can see;
           the exact per-head max logit comes for free (CPU default, tests).
  sdpa  -- `scaled_dot_product_attention` with the explicit scale; in training mode a chunked, no-grad
           pass over Q K^T measures the max logit. Its cost: per query chunk only the visible keys are
           multiplied, so about half of one Q K^T product (plus chunk-diagonal waste) and a mask + amax over
           those logits, forward only, nothing kept for backward; attention forward + backward does ~6
           products of that size (QK^T, PV, dQ, dK, dV, dP), so it adds a small share of one MLA layer's
           forward + backward, not a doubling (BENCHMARKS.md, "Cost of the max-logit tracker with sdpa").
           Eval forwards skip it entirely.
  auto  -- eager on CPU, sdpa on CUDA.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pilotrun.model.recompute import recomputing
from pilotrun.model.rope import apply_rope

# Query rows per block of eager attention (MLA.eager_attention). On the d 512 MLA layer at 256 tokens, 128
# took 0.93x (eager) and 0.91x (compiled) the time of one block, 64 0.89x and 0.90x: 64 skips more of the
# square, but its smaller products cost more per FLOP. With 128 that layer's output and input gradient
# equalled one block's bit for bit on this project's CPU (the masked zeros a block leaves out add nothing);
# no test relies on it.
EAGER_QUERY_CHUNK = 128
MAX_LOGIT_QUERY_CHUNK = 256  # query rows per chunk of the sdpa max-logit pass: bounds its memory to B*H*256*T


def causal_mask(first_row: int, rows_end: int, device: torch.device) -> torch.Tensor:
    """[rows_end - first_row, rows_end] bool: for the query rows first_row..rows_end-1 and the keys
    0..rows_end-1, True where the key comes after the query (what the query must not see). Eagerly built once
    per block and device, not at every attention forward; traced, built in the graph (the compiler folds
    it)."""
    if torch.compiler.is_compiling():
        return upper_triangle(first_row, rows_end, device)
    return cached_upper_triangle(first_row, rows_end, device)


def upper_triangle(first_row: int, rows_end: int, device: torch.device) -> torch.Tensor:
    return torch.ones(rows_end - first_row, rows_end, dtype=torch.bool, device=device).triu(first_row + 1)


cached_upper_triangle = functools.cache(upper_triangle)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32, output in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normalized = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normalized * self.weight.float()).to(x.dtype)


class MLA(nn.Module):
    """Multi-head Latent Attention (DeepSeek-V2/V3), causal, with a training-only max-logit tracker."""

    def __init__(self, d_model: int, n_heads: int, q_lora_rank: int, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, attn_impl: str = "auto", norm_eps: float = 1e-6):
        super().__init__()
        self.n_heads = n_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.attn_impl = attn_impl
        # The paper's softmax denominator sqrt(d_n + d_r) (V3 eq. 10); no YaRN mscale in these configs.
        self.softmax_scale = self.qk_head_dim**-0.5
        # Pad v up to d_qk for sdpa so the flash backend (equal head dims) can be chosen, then slice the
        # output. None: on CUDA only (where flash exists); True/False force it (tests exercise the padded path
        # on CPU).
        self.pad_value_for_flash: bool | None = None
        if q_lora_rank == 0:
            self.wq = nn.Linear(d_model, n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(d_model, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(d_model, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, d_model, bias=False)
        # Running max of the softmax input per head over this optimizer step's training forwards (QK-Clip).
        self.register_buffer("qk_max_logit", torch.full((n_heads,), float("-inf")), persistent=False)

    def project_queries_keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k [B, H, T, d_qk] and v [B, H, T, d_v], with RoPE applied to the rotary slices only."""
        batch, seq, _ = x.shape
        heads, d_n, d_r = self.n_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_lora_rank == 0:
            q = self.wq(x)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(batch, seq, heads, self.qk_head_dim)
        q_content, q_rotary = q.split([d_n, d_r], dim=-1)
        q_rotary = apply_rope(q_rotary, cos, sin)
        latent, k_rotary = self.wkv_a(x).split([self.kv_lora_rank, d_r], dim=-1)
        k_rotary = apply_rope(k_rotary.unsqueeze(2), cos, sin)  # [B, T, 1, d_r]: ONE rotary key for all heads
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, heads, d_n + self.v_head_dim)
        k_content, v = kv.split([d_n, self.v_head_dim], dim=-1)
        q = torch.cat([q_content, q_rotary], dim=-1)
        k = torch.cat([k_content, k_rotary.expand(-1, -1, heads, -1)], dim=-1)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def resolved_impl(self, device: torch.device) -> str:
        if self.attn_impl != "auto":
            return self.attn_impl
        return "sdpa" if device.type == "cuda" else "eager"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.project_queries_keys_values(x, cos, sin)
        if self.resolved_impl(x.device) == "eager":
            output = self.eager_attention(q, k, v)
        else:
            output = self.sdpa_attention(q, k, v)
        output = output.transpose(1, 2).reshape(batch, seq, self.n_heads * self.v_head_dim)
        return self.wo(output)

    def eager_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over materialized fp32 logits, EAGER_QUERY_CHUNK query rows at a time: a block
        multiplies only the keys up to its last row, so a long sequence skips most of the masked square (at
        T = 256, 3/4 of the T x T products), while a sequence of one block runs as one product as before."""
        seq = q.shape[2]
        track = self.training and not recomputing()  # not again in an activation recompute (recompute.py)
        outputs, per_head_max = [], None
        for first_row in range(0, seq, EAGER_QUERY_CHUNK):
            rows_end = min(first_row + EAGER_QUERY_CHUNK, seq)
            keys = k[:, :, :rows_end].transpose(-1, -2)
            logits = torch.matmul(q[:, :, first_row:rows_end], keys).float() * self.softmax_scale  # fp32
            # In place: the scaled logits are this function's own fresh tensor and the scaling's backward does
            # not read them, so the mask needs no second buffer (the same values as masked_fill).
            logits = logits.masked_fill_(causal_mask(first_row, rows_end, q.device), float("-inf"))
            if track:
                with torch.no_grad():  # masked entries are -inf and never win the max
                    block_max = logits.detach().amax(dim=(0, 2, 3))
                    if per_head_max is not None:
                        block_max = torch.maximum(per_head_max, block_max)
                    per_head_max = block_max
            probabilities = torch.softmax(logits, dim=-1).to(v.dtype)
            outputs.append(torch.matmul(probabilities, v[:, :, :rows_end]))
        if track:
            self.record_max_logit(per_head_max)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)

    def sdpa_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.training and not recomputing():
            self.record_max_logit(self.chunked_max_logit(q, k))
        d_v = self.v_head_dim
        pad = q.is_cuda if self.pad_value_for_flash is None else self.pad_value_for_flash
        if pad and d_v < self.qk_head_dim:
            v = F.pad(v, (0, self.qk_head_dim - d_v))
        output = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return output[..., :d_v]

    @torch.no_grad()
    def chunked_max_logit(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Exact max over batch, query i and unmasked key j <= i of scale * q_i . k_j, per head, fp32.

        Query rows go in chunks; a chunk multiplies only the keys it can see: the keys before it (all visible,
        no mask needed) and its own diagonal block (masked). Memory stays at B*H*chunk*T and the work is about
        half of a full Q K^T. The scale is applied to the [H] maxima, not to every logit: rounding is
        monotone, so max(fl(scale * s)) == fl(scale * max(s)) exactly, the value eager attention records.
        """
        q, k = q.detach(), k.detach()
        seq = q.shape[2]
        per_head_max = torch.full((q.shape[1],), float("-inf"), device=q.device, dtype=torch.float32)
        for start in range(0, seq, MAX_LOGIT_QUERY_CHUNK):
            stop = min(start + MAX_LOGIT_QUERY_CHUNK, seq)
            queries = q[:, :, start:stop]
            if start > 0:
                visible = torch.matmul(queries, k[:, :, :start].transpose(-1, -2))
                per_head_max = torch.maximum(per_head_max, visible.amax(dim=(0, 2, 3)).float())
            diagonal = torch.matmul(queries, k[:, :, start:stop].transpose(-1, -2))
            above_diagonal = torch.ones(stop - start, stop - start, dtype=torch.bool, device=q.device).triu(1)
            diagonal = diagonal.masked_fill(above_diagonal, float("-inf"))
            per_head_max = torch.maximum(per_head_max, diagonal.amax(dim=(0, 2, 3)).float())
        return per_head_max * self.softmax_scale

    @torch.no_grad()
    def record_max_logit(self, per_head_max: torch.Tensor) -> None:
        self.qk_max_logit.copy_(torch.maximum(self.qk_max_logit, per_head_max.float()))
