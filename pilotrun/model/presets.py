"""Named model sizes, as ModelConfig field values.

- tiny:     the smallest geometry (d 64, 2 layers, E 4 / K 2) for unit tests; ~0.17M parameters at
            vocab 256.
- cpu:      for the CPU stability pilot: the smoke geometry (d 128, 4 layers with 1 dense, 8
            routed experts + 1 shared, top-2, query and KV low-rank). A few million parameters with a 4k BPE
            vocabulary; trains hundreds of updates of a few thousand tokens each in minutes on 2 cores
            (see BENCHMARKS.md, `python -m benchmarks.run_all bench_model`).
- gpu-100m: the GPU pilot size (d 512, 10 layers, 16 routed experts); 104.7M parameters (55.1M active)
            at vocab 32768, ~122.6M with GPT-2's 50257.

vocab_size stays 0 in every preset: the trainer takes it from the data folder's tokenizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pilotrun.common.errors import ConfigError
from pilotrun.config import ModelConfig

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        d_model=64, n_layers=2, n_dense_layers=1, n_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
        top_k=2, moe_hidden=64, dense_hidden=192,
    ),
    "cpu": dict(
        d_model=128, n_layers=4, n_dense_layers=1, n_heads=4, q_lora_rank=64, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
        top_k=2, moe_hidden=128, dense_hidden=384,
    ),
    "gpu-100m": dict(
        d_model=512, n_layers=10, n_dense_layers=1, n_heads=8, q_lora_rank=0, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, n_shared_experts=1,
        top_k=2, moe_hidden=256, dense_hidden=1408,
    ),
}


def model_preset(name: str, **changes: Any) -> ModelConfig:
    """The preset's ModelConfig (defaults for every field it does not set), with `changes` applied."""
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset '{name}' (known: {', '.join(MODEL_PRESETS)})")
    return dataclasses.replace(ModelConfig(**MODEL_PRESETS[name]), **changes)
