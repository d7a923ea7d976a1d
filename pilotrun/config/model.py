"""The model's section of the recipe (`model.*`): a DeepSeek-V3-style decoder, its knobs, cross-key rules."""

from __future__ import annotations

from dataclasses import dataclass

from pilotrun.config.knob import knob, need

BALANCE_MODES = ("aux_free+seq", "aux_free", "seq", "batch", "none")
SCORE_FUNCS = ("sigmoid", "softmax")
ATTN_IMPLS = ("auto", "eager", "sdpa")
MOE_IMPLS = ("grouped", "sorted", "loop", "dense_ref")


@dataclass
class ModelConfig:
    """DeepSeek-V3-style decoder (docs/MODEL.md, "The model"). Names are the recipe's `model.*` keys."""

    vocab_size: int = knob(0, "vocabulary size; 0 takes it from the data folder's tokenizer at train time",
                           at_least=0)
    d_model: int = knob(64, "hidden width of the residual stream", above=0)
    n_layers: int = knob(2, "decoder blocks in total", above=0)
    n_dense_layers: int = knob(1, "leading blocks with a dense FFN instead of MoE")
    n_heads: int = knob(4, "attention heads", above=0)
    q_lora_rank: int = knob(0, "query compression rank; 0: no compression (wq), else wq_a -> q_norm -> wq_b",
                            at_least=0)
    kv_lora_rank: int = knob(32, "compressed key/value latent width (MLA)", above=0)
    qk_nope_head_dim: int = knob(16, "per-head query/key width without rotary position", above=0)
    qk_rope_head_dim: int = knob(8, "per-head query/key width carrying rotary position (even)", above=0,
                                 even=True)
    v_head_dim: int = knob(16, "per-head value width", above=0)
    n_routed_experts: int = knob(4, "routed experts per MoE layer")
    n_shared_experts: int = knob(1, "always-active shared experts per MoE layer", at_least=0)
    top_k: int = knob(2, "routed experts each token takes")
    moe_hidden: int = knob(64, "hidden width of one expert's FFN", above=0)
    dense_hidden: int = knob(192, "hidden width of the dense FFN", above=0)
    balance: str = knob("aux_free+seq", "expert load balancing: " + ", ".join(BALANCE_MODES),
                        choices=BALANCE_MODES)
    score_func: str = knob("sigmoid", "router scores: sigmoid or softmax", choices=SCORE_FUNCS)
    route_norm: bool = knob(True, "renormalize the chosen experts' gate weights to sum to 1")
    route_scale: float = knob(0.0, "gate weight scale; 0: Moonlight's formula for sigmoid routers, 1.0 for "
                              "softmax", at_least=0)
    n_expert_groups: int = knob(1, "expert groups for group-limited routing", at_least=1)
    n_limited_groups: int = knob(1, "groups a token may route into", at_least=1)
    bias_update_speed: float = knob(1e-3, "aux-free balancing: speed gamma of the per-expert routing bias",
                                    at_least=0)
    seq_aux_alpha: float = knob(1e-4, "weight of the sequence-wise balance loss")
    z_loss_beta: float = knob(0.0, "weight of the router z-loss; 0 disables it")
    rope_theta: float = knob(10000.0, "rotary position base")
    max_seq_len: int = knob(4096, "length of the rotary table; train.seq_len must fit", above=0)
    init_std: float = knob(0.006, "standard deviation of the weight initialization", above=0)
    norm_eps: float = knob(1e-6, "RMSNorm epsilon")
    attn_impl: str = knob("auto", "attention kernel: auto (eager on CPU for an exact max logit, sdpa on "
                          "CUDA), eager, sdpa", choices=ATTN_IMPLS)
    moe_impl: str = knob("grouped", "expert dispatch: grouped (grouped_mm where available, else sorted), "
                         "sorted, loop, dense_ref", choices=MOE_IMPLS)
    cpu_kernels: bool = knob(True, "CPU: routing, combine and routed experts as compiled kernels")
    # Recompute each block's forward in backward instead of keeping its activations (model/recompute.py):
    # less memory, ~1 more forward of compute; the same results bit for bit, so it may change on resume.
    activation_checkpointing: bool = knob(False, "recompute each block in backward: less memory, ~1 more "
                                          "forward", on_resume="free")
    # Debug: every token takes experts (t*K + k) mod E, perfectly balanced, gate weights from its scores;
    # for best-case dispatch throughput and to tell routing bugs from others. Never for a real run.
    force_balanced_routing: bool = knob(False, "debug only: route every token round-robin, perfectly "
                                        "balanced")


def check_model_rules(m: ModelConfig) -> None:
    """The model's rules that relate two of its keys (each key's own bounds are its knob's)."""
    need(0 <= m.n_dense_layers <= m.n_layers,
         f"model.n_dense_layers ({m.n_dense_layers}) must be between 0 and model.n_layers ({m.n_layers})")
    if m.n_layers > m.n_dense_layers:  # at least one MoE layer
        check_routing_rules(m)


def check_routing_rules(m: ModelConfig) -> None:
    need(m.n_routed_experts >= 1, "model.n_routed_experts must be >= 1 when MoE layers exist")
    need(1 <= m.top_k <= m.n_routed_experts,
         f"model.top_k ({m.top_k}) must be between 1 and model.n_routed_experts ({m.n_routed_experts})")
    need(not (m.score_func == "sigmoid" and m.route_norm and m.top_k < 2),
         "model.top_k must be >= 2 with a sigmoid router and route_norm (with K=1 the router gets no "
         "gradient)")
    need(m.n_routed_experts % m.n_expert_groups == 0,
         f"model.n_routed_experts ({m.n_routed_experts}) must be divisible by model.n_expert_groups "
         f"({m.n_expert_groups})")
    need(m.n_limited_groups <= m.n_expert_groups,
         "model.n_limited_groups must be between 1 and model.n_expert_groups")
    need(m.top_k <= m.n_limited_groups * (m.n_routed_experts // m.n_expert_groups),
         "model.top_k exceeds the experts reachable in model.n_limited_groups groups")
