"""pilotrun.model: a DeepSeek-V3-style decoder (MLA + routed MoE) and what the trainer needs to watch it.

- rope.py         decoupled RoPE tables and the interleaved rotation (fp32)
- mla.py          RMSNorm; Multi-head Latent Attention (eager / sdpa) with the per-head max-logit tracker
- moe.py          SwiGLU, the fp32 router (sigmoid/softmax, aux-free bias, group limit), stacked experts,
                  sorted / loop / dense_ref dispatch, the MoE layer and its per-step counters
- balancing.py    default route scale, balance-loss terms, z-loss, the centered sign rule for the bias
- transformer.py  Block, Transformer, ModelOutput, initialization, build_model
- diagnostics.py  collect / reset the per-step statistics; JSON-ready MoE and attention figures
- accounting.py   parameter counts (total, active) and training FLOPs per token
- presets.py      the tiny / cpu / gpu-100m sizes

The model and its update in words: docs/MODEL.md; where to extend the package: docs/EXTENDING.md.
"""
