"""The decoder: embedding, L pre-norm blocks (MLA + dense FFN or MoE), final RMSNorm, untied head.

Parameter names follow the names of DeepSeek-V3's reference inference model so that the optimizer partition
and QK-Clip address parameters by name. `build_model(cfg)` is deterministic given the torch seed at call time:
parameters are created, then initialized in one fixed order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pilotrun.config import ModelConfig
from pilotrun.model.mla import MLA, RMSNorm
from pilotrun.model.moe import MoE, SwiGLU
from pilotrun.model.recompute import checkpointed_call, recomputing
from pilotrun.model.rope import build_rope_table


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V] in the autocast dtype (fp32 without autocast)
    loss: torch.Tensor | None  # what backward uses: ce_loss + aux_loss; None without targets
    ce_loss: torch.Tensor | None  # mean token cross-entropy (fp32); None without targets
    aux_loss: torch.Tensor  # sum over MoE layers of the balance losses and z-losses (0 when disabled)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = MLA(cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                        cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.attn_impl, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.is_moe = layer_index >= cfg.n_dense_layers
        # The block output RMS diagnostic: sum of squares and element count of this block's outputs over the
        # training forwards since the last reset (per rank; diagnostics.block_output_rms turns them into the
        # RMS).
        self.register_buffer("output_square_sum", torch.zeros((), dtype=torch.float64), persistent=False)
        self.register_buffer("output_elements", torch.zeros((), dtype=torch.float64), persistent=False)
        if self.is_moe:
            self.ffn: nn.Module = MoE(
                cfg.d_model,
                cfg.moe_hidden,
                cfg.n_routed_experts,
                cfg.n_shared_experts,
                cfg.top_k,
                cfg.score_func,
                cfg.route_norm,
                cfg.route_scale,
                cfg.n_expert_groups,
                cfg.n_limited_groups,
                cfg.balance,
                cfg.seq_aux_alpha,
                cfg.z_loss_beta,
                cfg.moe_impl,
                cfg.cpu_kernels,
                cfg.force_balanced_routing,
            )
        else:
            self.ffn = SwiGLU(cfg.d_model, cfg.dense_hidden)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        aux_loss = None
        if self.is_moe:
            ffn_output, aux_loss = self.ffn(self.ffn_norm(x))
        else:
            ffn_output = self.ffn(self.ffn_norm(x))
        x = x + ffn_output
        if self.training and not recomputing():
            with torch.no_grad():
                self.output_square_sum.add_(x.detach().double().square().sum())
                self.output_elements.add_(x.numel())
        return x, aux_loss


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (> 0) before building the model")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, index) for index in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = build_rope_table(cfg.qk_rope_head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # The final norm, head and cross-entropy as train.compile compiled them (compile_blocks_and_output);
        # None: they run eagerly, as output_logits_and_loss.
        self.compiled_output: Callable | None = None

    def moe_layers(self) -> list[MoE]:
        return [block.ffn for block in self.layers if block.is_moe]

    def attention_layers(self) -> list[MLA]:
        return [block.attn for block in self.layers]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> ModelOutput:
        seq = tokens.shape[1]
        if seq > self.rope_cos.shape[0]:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.rope_cos.shape[0]}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.embed(tokens)
        aux_loss = torch.zeros((), device=x.device, dtype=torch.float32)
        recompute = self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.layers:
            x, layer_aux = checkpointed_call(block, x, cos, sin) if recompute else block(x, cos, sin)
            if layer_aux is not None:
                aux_loss = aux_loss + layer_aux  # summed over MoE layers
        output = self.compiled_output or output_logits_and_loss
        logits, ce_loss = output(self.norm, self.head, x, targets)
        if ce_loss is None:
            return ModelOutput(logits=logits, loss=None, ce_loss=None, aux_loss=aux_loss)
        return ModelOutput(logits=logits, loss=ce_loss + aux_loss, ce_loss=ce_loss, aux_loss=aux_loss)


def output_logits_and_loss(norm: nn.Module, head: nn.Module, x: torch.Tensor, targets: torch.Tensor | None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The last hidden states x [B, T, d] -> the logits [B, T, V] and, with targets, the mean token
    cross-entropy in fp32 (else None): one function, so that train.compile can compile the final norm, the
    head and the loss as one graph (compile_blocks_and_output), where the softmax's passes over the [B*T, V]
    logits fuse."""
    logits = head(norm(x))
    if targets is None:
        return logits, None
    return logits, F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def initialize_parameters(model: Transformer) -> None:
    """"deepseek" initialization: every matrix, the embedding and the router ~ N(0, init_std^2); RMSNorm gains
    1; the expert bias 0. Never zero the router: equal scores make top-k pick experts 0..K-1 for every
    token."""
    std = model.cfg.init_std
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):
            parameter.fill_(1.0)
        else:
            parameter.normal_(mean=0.0, std=std)
    for moe in model.moe_layers():
        moe.gate.expert_bias.zero_()


def build_model(cfg: ModelConfig) -> Transformer:
    """A freshly initialized model on the CPU in fp32 (move it with `.to(device)`; keep parameters fp32)."""
    model = Transformer(cfg)
    initialize_parameters(model)
    return model


def compile_blocks_and_output(model: Transformer, backend: str) -> None:
    """torch.compile every decoder block in place (nn.Module.compile), as torchtitan does: one small graph
    compiled once and reused by every layer of the same shape, where compiling the whole model would trace it
    as one graph; parameter names, the state dict, DDP/FSDP wrapping and activation checkpointing stay as
    they are. The final norm, head and cross-entropy are compiled too, as one function
    (output_logits_and_loss): eager, the loss makes several passes over the [B*T, V] logits forward and
    back (the log-softmax, its saved output, the gradient's zeros and scatter), which the compiled graph
    fuses; with the blocks alone compiled they were most of a forward + backward's time outside the blocks
    (BENCHMARKS.md, bench_fwdbwd_parts). Dynamo state is reset first so that an earlier model's graphs are
    not reused by mistake."""
    import torch._dynamo  # only where compiling: dynamo's import takes seconds

    torch._dynamo.reset()
    for block in model.layers:
        block.compile(backend=backend)
    model.compiled_output = torch.compile(output_logits_and_loss, backend=backend)
