"""The training section of the recipe (`train.*`): batch geometry, precision and the machine's settings, and
the sections each component is built from (log, eval, downstream, checkpoint, profile, spike); their knobs and
cross-key rules.

What a resume may do with each key is its knob's `on_resume` (config/knob.py). Machine settings say how fast
this machine computes the updates or who watches them, never what an update computes: free on resume, and a
lock neither holds a long run to the pilot's nor freezes them (a pilot on 2 CPU threads says nothing about the
thread count of the long run's node). Another thread count may reorder a reduction's additions: a resume on it
is free but not promised bit-exact, and run.json says so (training/checkpoint/compatibility.py `not_exact`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pilotrun.config.knob import knob, need

PRECISIONS = ("fp32", "bf16", "fp16")
DATA_MODES = ("successive", "repeat_batch")
PARALLELISMS = ("ddp", "fsdp")
COMPILE_MODES = ("none", "inductor", "eager")
CHECKPOINT_MODES = ("auto", "background", "sync")
# The registered checkpoint storages (training/checkpoint/storages.py, which the config cannot import: it sits
# above it); tests/training/checkpoint/test_storages.py holds the two lists equal.
CHECKPOINT_STORAGES = ("auto", "torch_save", "torch_dcp")
TRACKER_NAMES = ("tensorboard", "wandb", "mlflow", "trackio")  # built-in mirrors (run/sinks.py)
# What a detected loss spike does (training/spikes/detector.py).
SPIKE_POLICIES = ("record", "skip", "rollback")


def device_problem(device: str) -> str | None:
    return None if device in ("auto", "cpu") or device.startswith("cuda") else "must be auto, cpu or cuda[:N]"


def skip_range_problem(ranges: list[list[int]]) -> str | None:
    whole = all(len(r) == 2 and r[0] >= 0 and r[1] >= 1 for r in ranges)
    return None if whole else "entries are [first_batch >= 0, batches >= 1]"


@dataclass
class ProfileConfig:
    """A torch.profiler window over a few updates (training/callbacks/profiling.py); off while `steps` is 0.
    Profiling observes updates without changing them: every key is a machine setting."""

    start_step: int = knob(1, "the first profiled update is the one that makes this step", at_least=1,
                           on_resume="machine")
    steps: int = knob(0, "consecutive update attempts to profile; 0: no profiling", at_least=0,
                      on_resume="machine")
    top_operators: int = knob(30, "rows of the operator table written beside the Chrome trace", at_least=1,
                              on_resume="machine")
    record_shapes: bool = knob(False, "also group operators by input shapes (more overhead)",
                               on_resume="machine")
    profile_memory: bool = knob(False, "also record allocations per operator (more overhead)",
                                on_resume="machine")
    with_stack: bool = knob(False, "Python stacks in the trace (much more overhead and a bigger trace)",
                            on_resume="machine")


@dataclass
class SpikeConfig:
    """Loss spikes: detected in the loop, answered by policy (training/spikes/detector.py,
    training/spikes/rollback.py)."""

    policy: str = knob(
        "record",
        "record (a spike event), skip (not applied, reason spike) or rollback (to "
        "the last committed checkpoint before it, its documents to their end plus margin skipped)",
        choices=SPIKE_POLICIES,
    )
    window: int = knob(50, "applied updates whose losses and gradient norms the running bound is taken over",
                       at_least=3)
    factor: float = knob(6.0, "spike: not finite or > median + factor x floored 1.4826 MAD of window "
                         "(training/spikes/bound.py)", above=0)
    min_history: int = knob(20, "applied updates in the window before finite values are judged", at_least=1)
    margin: int = knob(2, "rollback: updates' worth of data skipped at least after the spiking update's own",
                       at_least=0)
    max_rollbacks: int = knob(3, "rollbacks per run; the spike that would need one more stops the run "
                              "(stopped)", at_least=0, on_resume="free")
    # A replay restores all it touched: it costs time, changes no update.
    replay: bool = knob(True, "replay a spike (its batch, then the next) to name its cause (spikes.CAUSES)",
                        on_resume="machine")


@dataclass
class LogConfig:
    """The logged train windows and the trackers that mirror the record (training/callbacks/window_log.py)."""

    every: int = knob(10, "updates per logged train window", at_least=1, on_resume="free")
    # Mirrors of the record, not part of the training (tensorboard: the alias loaded_recipe folds).
    trackers: list[str] = knob(meaning="trackers that mirror the record live on rank 0: any of tensorboard, "
                               "wandb, mlflow, trackio (each needs its extra, pilotrun[NAME]; a failing one "
                               "warns once)", factory=list, choices=TRACKER_NAMES, unique=True,
                               on_resume="machine")
    tensorboard: bool = knob(
        False,
        "alias: true is read as `tensorboard` in train.log.trackers (folded in when "
        "the recipe is loaded, so it reads back false)",
        on_resume="machine",
    )


@dataclass
class EvalConfig:
    """The val loss in the loop (training/callbacks/evaluation.py)."""

    every: int = knob(50, "updates between val evaluations; 0: no evaluation", at_least=0, on_resume="free")
    batches: int = knob(4, "val batches per evaluation (batch_size x (seq_len+1) tokens each)", at_least=1,
                        on_resume="free")


@dataclass
class DownstreamConfig:
    """Multiple-choice tasks scored in the loop (training/callbacks/downstream_eval.py). They watch the model
    without changing an update; their files' paths differ between machines, and the lock names the pilot's
    tasks by sha256 (its watch section) for the long run's watch to compare: machine settings."""

    tasks: list[str] = knob(
        meaning="multiple-choice task files (JSONL: context, choices, label) scored in the "
        "loop (training/multiple_choice.py)",
        factory=list,
        on_resume="machine",
    )
    every: int = knob(0, "updates between scorings of train.downstream.tasks; 0: none", at_least=0,
                      on_resume="machine")
    limit: int = knob(0, "first examples of each downstream task scored in the loop; 0: all", at_least=0,
                      on_resume="machine")


@dataclass
class CheckpointConfig:
    """When checkpoints are written and which are kept (training/callbacks/checkpointing.py,
    training/checkpoint/retention.py)."""

    every: int = knob(50, "updates between checkpoints; 0: only at the end and on interruption", at_least=0,
                      on_resume="free")
    # When the same state is written, never what it holds.
    mode: str = knob("auto", "cadence saves: background (beside training), sync, or auto (cuda: background)",
                     choices=CHECKPOINT_MODES, on_resume="machine")
    # How the same state is written; every checkpoint is read with the storage its marker names.
    storage: str = knob(
        "auto",
        "auto (torch_dcp for several ranks, torch_save for one), torch_save (one process "
        "writes every file) or torch_dcp (torch.distributed.checkpoint, each rank its part)",
        choices=CHECKPOINT_STORAGES,
        on_resume="machine",
    )
    keep: int = knob(3, "newest committed checkpoints kept", at_least=1, on_resume="free")
    keep_every: int = knob(0, "also keep every N-th step's checkpoint for good; 0: none", at_least=0,
                           on_resume="free")
    keep_steps: list[int] = knob(meaning="steps whose checkpoints are never pruned", factory=list, at_least=0,
                                 on_resume="free")


@dataclass
class TrainConfig:
    batch_size: int = knob(4, "sequences per microbatch per rank", at_least=1)
    seq_len: int = knob(32, "tokens per sequence", at_least=1)
    gradient_accumulation_steps: int = knob(1, "microbatches per update", at_least=1)
    max_steps: int = knob(100, "applied updates to train; does not move the LR schedule "
                          "(optim.schedule.horizon)", at_least=1, on_resume="free")
    precision: str = knob("fp32", "fp32, bf16 (autocast) or fp16 (autocast + loss scaling)",
                          choices=PRECISIONS)
    loss_scale_init: float = knob(65536.0, "fp16: initial loss scale", above=0)
    loss_scale_growth_interval: int = knob(2000, "fp16: updates without overflow before the scale doubles",
                                           at_least=1)
    max_consecutive_skips: int = knob(50, "stop the run with a clear reason after this many skipped updates "
                                      "in a row", at_least=1, on_resume="free")
    seed: int = knob(0, "seed of every generator (initialization, data order)")
    data_mode: str = knob("successive", "successive (read the stream) or repeat_batch (one batch, for "
                          "overfitting)", choices=DATA_MODES)
    device: str = knob("auto", "auto (cuda when available, else cpu), cpu or cuda[:N]", check=device_problem)
    num_threads: int = knob(0, "intra-op CPU threads; 0: chosen per run (free CPUs, a short timing; kept on "
                            "resume)", at_least=0, on_resume="machine")
    parallelism: str = knob("ddp", "under torchrun: ddp or fsdp", choices=PARALLELISMS)
    memory_budget_gb: float = knob(0.0, "peak memory the verdict checks against; 0: no check",
                                   on_resume="free")
    # "inductor" generates fused kernels (the first update pays the compile), "eager" only traces with Dynamo
    # (checks that the model compiles; no speed-up). Each block is compiled, and the final norm, head and loss
    # as one more graph. On the CPU the MoE layers run eagerly with their kernels.
    compile: str = knob("none", "torch.compile each block and the loss: none, inductor (fused code) or eager "
                        "(trace only)", choices=COMPILE_MODES)
    # Ranges may be added on resume; the checkpoint's stay (resume_plan.kept_skip_ranges).
    skip_data: list[list[int]] = knob(meaning="data the loader steps over: [first_batch, batches] global "
                                      "batch cursor ranges, besides the rollbacks' own (trainer state)",
                                      factory=list, check=skip_range_problem, on_resume="free")
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)


def check_train_rules(t: TrainConfig) -> None:
    """The training section's rules that relate two of its keys."""
    sp = t.spike
    need(sp.min_history <= sp.window,
         f"train.spike.min_history ({sp.min_history}) must be <= train.spike.window ({sp.window})")
