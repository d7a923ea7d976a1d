"""The optimizer's section of the recipe (`optim.*`): Muon for matrices, AdamW for the rest, QK-Clip and the
LR schedule, their knobs and cross-key rules."""

from __future__ import annotations

from dataclasses import dataclass, field

from pilotrun.config.knob import knob, need

SCHEDULE_KINDS = ("cosine", "wsd", "constant")
MUON_SCALE_MODES = ("moonlight", "keller")
MUON_NS_VARIANTS = ("quintic", "hybrid", "polar_express")
MUON_GRANULARITIES = ("param", "per_head")
ROUTER_OPTIMIZERS = ("adamw", "muon")


@dataclass
class MuonConfig:
    lr: float = knob(3e-3, "Muon base learning rate (matrices)", at_least=0)
    weight_decay: float = knob(0.1, "Muon decoupled weight decay", at_least=0)
    momentum: float = knob(0.95, "Muon momentum, in [0, 1)", at_least=0, below=1)
    nesterov: bool = knob(True, "Nesterov momentum")
    ns_steps: int = knob(5, "Newton-Schulz iterations per orthogonalization", at_least=1)
    scale_mode: str = knob("moonlight", "update scaling: moonlight (match AdamW RMS) or keller",
                           choices=MUON_SCALE_MODES)
    ns_variant: str = knob("quintic", "Newton-Schulz coefficients: quintic, hybrid (8 quintic + 2 "
                           "pinning), or polar_express (per-iteration minimax quintics: ns_steps of them; "
                           "4 come as close to orthogonal as 5 quintic)", choices=MUON_NS_VARIANTS)
    # "per_head" is an ablation; DECISION D9 keeps "param".
    granularity: str = knob("param", "orthogonalize per parameter (per expert slice) or per_head",
                            choices=MUON_GRANULARITIES)
    # Under DDP each rank runs Newton-Schulz for 1/world of the matrices and one all_gather shares the results
    # (MuonAdamW.distribute_orthogonalization): the same update bit for bit, less replicated work, so it may
    # change on resume.
    distribute_newton_schulz: bool = knob(True, "DDP: split Newton-Schulz across ranks (same result, less "
                                          "work)", on_resume="free")


@dataclass
class AdamWConfig:
    lr: float = knob(3e-3, "AdamW base learning rate (embeddings, head, norms, router)", at_least=0)
    weight_decay: float = knob(0.1, "AdamW decoupled weight decay", at_least=0)
    betas: list[float] = knob(meaning="AdamW (beta1, beta2)", factory=lambda: [0.9, 0.95], length=2,
                              at_least=0, below=1)
    eps: float = knob(1e-8, "AdamW epsilon")


# A `qk_clip` event is logged for a head clipped for the first time in the run or with gamma (its scale) below
# this. Part of QK-Clip's definition, so it lives beside its config: the writer is pilotrun.optim.qk_clip, the
# reader that checks each event against it is summarize, and neither imports the other.
QK_CLIP_HARD_GAMMA = 0.5


@dataclass
class QKClipConfig:
    enabled: bool = knob(True, "rescale query/key weights of heads whose max logit exceeds tau")
    tau: float = knob(100.0, "QK-Clip threshold on the max attention logit", above=0)


@dataclass
class ScheduleConfig:
    """LR multiplier as a pure function of the applied-update count and this horizon: raising max_steps on a
    resume changes nothing already run."""

    kind: str = knob("cosine", "LR shape after warm-up: cosine, wsd (warmup-stable-decay) or constant",
                     choices=SCHEDULE_KINDS)
    warmup_steps: int = knob(10, "linear warm-up length in applied updates", at_least=0)
    # Independent of train.max_steps so that raising max_steps on resume continues the same curve.
    horizon: int = knob(1000, "the schedule's own length in applied updates; set it to train.max_steps to "
                        "decay fully")
    min_lr_ratio: float = knob(0.1, "final LR as a fraction of the base LR (cosine, wsd)", at_least=0,
                               at_most=1)
    decay_fraction: float = knob(0.2, "wsd: final fraction of the horizon spent decaying", above=0, at_most=1)
    # The routing settles before training ends.
    bias_freeze_fraction: float = knob(0.03, "final fraction of the horizon with the expert bias frozen",
                                       at_least=0, below=1)


@dataclass
class OptimConfig:
    muon: MuonConfig = field(default_factory=MuonConfig)
    adamw: AdamWConfig = field(default_factory=AdamWConfig)
    grad_clip: float = knob(1.0, "global gradient-norm clip; 0 disables clipping (the norm is still "
                            "measured)", at_least=0)
    qk_clip: QKClipConfig = field(default_factory=QKClipConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    router_optimizer: str = knob("adamw", "optimizer of the router weights: adamw or muon",
                                 choices=ROUTER_OPTIMIZERS)
    wd_norms: bool = knob(True, "weight decay on RMSNorm gains")


def check_optim_rules(o: OptimConfig) -> None:
    """The optimizer's rules that relate two of its keys."""
    s = o.schedule
    need(s.horizon >= 1 and s.horizon >= s.warmup_steps,
         f"optim.schedule.horizon ({s.horizon}) must be >= 1 and >= warmup_steps ({s.warmup_steps})")
