"""Parameter counts and a FLOPs-per-token estimate, from the config alone (no model needed).

Counts follow the parameter names and shapes of transformer.py; "active" parameters are those one token uses:
everything except the routed experts it did not choose (K of E routed experts, all shared experts, the
router). The tests check both against the built model's tensors, and the FLOPs against torch's
FlopCounterMode.

FLOPs per token (training, forward + backward), the figure MFU divides by: 6 * (active matmul parameters)  +
6 * L * H * (d_qk + d_v) * keys_attended
- active matmul parameters = active parameters minus the embedding (a lookup, not a matmul) and the RMSNorm
  gains; the LM head and the router do count. Backward = 2x forward for every matmul (input and weight grads).
- attention: per query and head, Q.K^T costs 2*d_qk and P.V costs 2*d_v per attended key. With causal=True
  (the default, what the attention actually needs) a query at position t attends t+1 keys, (T+1)/2 on average;
  causal=False counts the full T as PaLM-style MFU figures and dense implementations do. Elementwise work
  (norms, RoPE, softmax, SiLU, routing) is left out, as is conventional.
"""

from __future__ import annotations

from pilotrun.config import ModelConfig


def attention_parameters(cfg: ModelConfig) -> int:
    d, heads = cfg.d_model, cfg.n_heads
    qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank == 0:
        query = heads * qk_head_dim * d
    else:
        query = cfg.q_lora_rank * d + cfg.q_lora_rank + heads * qk_head_dim * cfg.q_lora_rank
    key_value = ((cfg.kv_lora_rank + cfg.qk_rope_head_dim) * d + cfg.kv_lora_rank
                 + heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank)
    output = d * heads * cfg.v_head_dim
    return query + key_value + output


def moe_parameters(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters of one MoE FFN: router + shared experts + E (resp. K) routed experts."""
    one_expert = 3 * cfg.moe_hidden * cfg.d_model
    router = cfg.n_routed_experts * cfg.d_model
    shared = cfg.n_shared_experts * one_expert
    return router + shared + cfg.n_routed_experts * one_expert, router + shared + cfg.top_k * one_expert


def count_parameters(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) trainable parameters, embedding and head included (buffers are not)."""
    d = cfg.d_model
    n_moe_layers = cfg.n_layers - cfg.n_dense_layers
    per_layer_common = attention_parameters(cfg) + 2 * d  # + attn_norm, ffn_norm
    dense_ffn = 3 * cfg.dense_hidden * d
    moe_total, moe_active = moe_parameters(cfg) if n_moe_layers else (0, 0)
    outside_layers = 2 * cfg.vocab_size * d + d  # embed, head, final norm
    common = outside_layers + cfg.n_layers * per_layer_common + cfg.n_dense_layers * dense_ffn
    return common + n_moe_layers * moe_total, common + n_moe_layers * moe_active


def norm_parameters(cfg: ModelConfig) -> int:
    # q_norm only exists when q_lora_rank > 0
    per_layer = 2 * cfg.d_model + cfg.kv_lora_rank + cfg.q_lora_rank
    return cfg.n_layers * per_layer + cfg.d_model


def active_matmul_parameters(cfg: ModelConfig) -> int:
    """Active parameters that take part in a matmul: everything active except the embedding and RMSNorm
    gains."""
    _, active = count_parameters(cfg)
    return active - cfg.vocab_size * cfg.d_model - norm_parameters(cfg)


def flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs (forward + backward) per token at this sequence length; see the module docstring."""
    keys_attended = (seq_len + 1) / 2 if causal else float(seq_len)
    attention_per_layer = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    forward = 2 * active_matmul_parameters(cfg) + 2 * cfg.n_layers * attention_per_layer * keys_attended
    return 3.0 * forward
