"""bench_update's second yardstick: an MoE of torch modules whose matrices are pilotrun's, one for one.

The dense reference (bench_update.ReferenceGPT, on the same BlockStackLM frame) does pilotrun's ACTIVE matmul
work per token, but its optimizer orthogonalises only its active matrices, while an MoE's Muon orthogonalises
every expert at every step. This one has the same total matrices: per layer MLA's projections of pilotrun's
shapes (wq_a, wq_b or wq, wkv_a, wkv_b, wo, with pilotrun's RMSNorms on the latent vectors; no rotary
embedding, elementwise work), a dense SwiGLU in the first `n_dense_layers`, and after them a router,
`n_routed_experts` SwiGLU experts (each matrix its own 2-D parameter, as torch.optim.Muon requires) of width
`moe_hidden` with top-k sigmoid routing, and the shared experts as one SwiGLU of width n_shared_experts x
moe_hidden. Its optimizers are bench_update.reference_optimizers' (torch.optim.Muon on every hidden matrix,
the router with AdamW as pilotrun's default puts it), so Newton-Schulz does exactly pilotrun's work per step,
and the forward the same active work per token. The routing runs one expert at a time over the tokens routed
to it (index_add_), the plain eager form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d_model, hidden, bias=False), nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LatentAttention(nn.Module):
    """MLA's projections at pilotrun's shapes, attention by F.scaled_dot_product_attention."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d, heads = cfg.d_model, cfg.n_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(cfg.q_lora_rank)
            self.wq_b = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(d, heads * qk, bias=False)
        self.wkv_a = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(cfg.kv_lora_rank)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * cfg.v_head_dim, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, (batch, seq, _) = self.cfg, x.shape
        heads = cfg.n_heads
        q = self.wq_b(self.q_norm(self.wq_a(x))) if cfg.q_lora_rank else self.wq(x)
        q = q.view(batch, seq, heads, -1).transpose(1, 2)
        latent, k_rope = self.wkv_a(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, heads, -1)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, heads, -1)], dim=-1).transpose(1, 2)
        attended = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        return self.wo(attended.transpose(1, 2).reshape(batch, seq, -1))


class RoutedExperts(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.d_model, cfg.n_routed_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.d_model, cfg.moe_hidden) for _ in range(cfg.n_routed_experts))
        self.shared = SwiGLU(cfg.d_model, cfg.moe_hidden * cfg.n_shared_experts) \
            if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))
        scores = torch.sigmoid(self.gate(flat))
        weights, chosen = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.shared(flat) if self.shared is not None else torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            token, slot = (chosen == index).nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view_as(x)


class MoEBlock(nn.Module):
    def __init__(self, cfg, dense: bool):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.RMSNorm(cfg.d_model), nn.RMSNorm(cfg.d_model)
        self.attn = LatentAttention(cfg)
        self.ffn = SwiGLU(cfg.d_model, cfg.dense_hidden) if dense else RoutedExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class BlockStackLM(nn.Module):
    """The frame both references share: an embedding, the blocks `make_blocks()` builds (called after the
    embedding, so that both draw their initial weights in the same order as when each wrote its own frame), a
    final RMSNorm and an untied head, every 2-D weight drawn from N(0, 0.02); the loss is cross-entropy."""

    def __init__(self, vocab: int, d_model: int, make_blocks) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(make_blocks())
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        for p in self.parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class ReferenceMoE(BlockStackLM):
    def __init__(self, cfg):
        super().__init__(cfg.vocab_size, cfg.d_model, lambda: (
            MoEBlock(cfg, dense=index < cfg.n_dense_layers) for index in range(cfg.n_layers)))


def muon_matrices(model: nn.Module) -> list[torch.Tensor]:
    """The matrices its Muon orthogonalises: every 2-D weight in the layers but the router's."""
    return [p for name, p in model.named_parameters()
            if p.ndim == 2 and name.startswith("layers.") and ".gate." not in name]


def muon_shapes(matrices: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Each matrix's (short side, long side), a 3-D stack counted per slice: what Newton-Schulz sees."""
    shapes = []
    for p in matrices:
        a, b = sorted(p.shape[-2:])
        shapes += [(a, b)] * (p.numel() // (a * b))
    return sorted(shapes)
