"""Typed recipe: the model, optimizer and training sections of a YAML config, validated in one place.

A recipe is a `RunConfig` of three dataclasses. YAML files and `--set key=value` overrides are merged
into the defaults below; unknown keys, wrong types and impossible geometry each raise one `ConfigError`
that names the key. `config_to_dict` gives the canonical, JSON-ready form that run.json and checkpoints
record, and `config_from_dict` reads it back, so a restored recipe is exactly the one that ran.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pilotrun.common.errors import ConfigError
from pilotrun.common.files import not_regular
from pilotrun.common.parsing import parse_yaml_text, read_text_bounded, shown

PRECISIONS = ("fp32", "bf16", "fp16")
DATA_MODES = ("successive", "repeat_batch")
BALANCE_MODES = ("aux_free+seq", "aux_free", "seq", "batch", "none")
SCORE_FUNCS = ("sigmoid", "softmax")
ATTN_IMPLS = ("auto", "eager", "sdpa")
MOE_IMPLS = ("grouped", "sorted", "loop", "dense_ref")
SCHEDULE_KINDS = ("cosine", "wsd", "constant")
MUON_SCALE_MODES = ("moonlight", "keller")
MUON_NS_VARIANTS = ("quintic", "hybrid")
MUON_GRANULARITIES = ("param", "per_head")
ROUTER_OPTIMIZERS = ("adamw", "muon")
PARALLELISMS = ("ddp", "fsdp")
COMPILE_MODES = ("none", "inductor", "eager")
TRACKER_NAMES = ("tensorboard", "wandb", "mlflow", "trackio")  # built-in mirrors (run/sinks.py)
SPIKE_POLICIES = ("record", "skip", "rollback")  # what a detected loss spike does (training/spikes/detector.py)


def knob(default: Any = dataclasses.MISSING, meaning: str = "", *, factory: Any = dataclasses.MISSING) -> Any:
    """A config field with its one-line meaning kept beside it (`pilotrun config` prints it)."""
    return field(default=default, default_factory=factory, metadata={"meaning": meaning})


@dataclass
class ModelConfig:
    """DeepSeek-V3-style decoder (docs/MODEL.md, "The model"). Names are the recipe's `model.*` keys."""

    vocab_size: int = knob(0, "vocabulary size; 0 takes it from the data folder's tokenizer at train time")
    d_model: int = knob(64, "hidden width of the residual stream")
    n_layers: int = knob(2, "decoder blocks in total")
    n_dense_layers: int = knob(1, "leading blocks with a dense FFN instead of MoE")
    n_heads: int = knob(4, "attention heads")
    q_lora_rank: int = knob(0, "query compression rank; 0: no compression (wq), else wq_a -> q_norm -> wq_b")
    kv_lora_rank: int = knob(32, "compressed key/value latent width (MLA)")
    qk_nope_head_dim: int = knob(16, "per-head query/key width without rotary position")
    qk_rope_head_dim: int = knob(8, "per-head query/key width carrying rotary position (even)")
    v_head_dim: int = knob(16, "per-head value width")
    n_routed_experts: int = knob(4, "routed experts per MoE layer")
    n_shared_experts: int = knob(1, "always-active shared experts per MoE layer")
    top_k: int = knob(2, "routed experts each token takes")
    moe_hidden: int = knob(64, "hidden width of one expert's FFN")
    dense_hidden: int = knob(192, "hidden width of the dense FFN")
    balance: str = knob("aux_free+seq", "expert load balancing: " + ", ".join(BALANCE_MODES))
    score_func: str = knob("sigmoid", "router scores: sigmoid or softmax")
    route_norm: bool = knob(True, "renormalize the chosen experts' gate weights to sum to 1")
    route_scale: float = knob(0.0, "gate weight scale; 0: Moonlight's formula for sigmoid routers, 1.0 for softmax")
    n_expert_groups: int = knob(1, "expert groups for group-limited routing")
    n_limited_groups: int = knob(1, "groups a token may route into")
    bias_update_speed: float = knob(1e-3, "aux-free balancing: speed gamma of the per-expert routing bias")
    seq_aux_alpha: float = knob(1e-4, "weight of the sequence-wise balance loss")
    z_loss_beta: float = knob(0.0, "weight of the router z-loss; 0 disables it")
    rope_theta: float = knob(10000.0, "rotary position base")
    max_seq_len: int = knob(4096, "length of the rotary table; train.seq_len must fit")
    init_std: float = knob(0.006, "standard deviation of the weight initialization")
    norm_eps: float = knob(1e-6, "RMSNorm epsilon")
    attn_impl: str = knob("auto", "attention kernel: auto (eager on CPU for an exact max logit, sdpa on CUDA), "
                          "eager, sdpa")
    moe_impl: str = knob("grouped", "expert dispatch: grouped (grouped_mm where available, else sorted), sorted, "
                         "loop, dense_ref")
    cpu_kernels: bool = knob(True, "CPU: routing, combine and routed experts as compiled kernels")
    # Recompute each block's forward in backward instead of keeping its activations (model/recompute.py):
    # less memory, ~1 more forward of compute; the same results bit for bit, so it may change on resume.
    activation_checkpointing: bool = knob(False, "recompute each block in backward: less memory, ~1 more forward")
    # Debug: every token takes experts (t*K + k) mod E, perfectly balanced, gate weights from its scores;
    # for best-case dispatch throughput and to tell routing bugs from others. Never for a real run.
    force_balanced_routing: bool = knob(False, "debug only: route every token round-robin, perfectly balanced")


@dataclass
class MuonConfig:
    lr: float = knob(3e-3, "Muon base learning rate (matrices)")
    weight_decay: float = knob(0.1, "Muon decoupled weight decay")
    momentum: float = knob(0.95, "Muon momentum, in [0, 1)")
    nesterov: bool = knob(True, "Nesterov momentum")
    ns_steps: int = knob(5, "Newton-Schulz iterations per orthogonalization")
    scale_mode: str = knob("moonlight", "update scaling: moonlight (match AdamW RMS) or keller")
    ns_variant: str = knob("quintic", "Newton-Schulz coefficients: quintic, or hybrid (8 quintic + 2 pinning)")
    # "per_head" is an ablation; DECISION D9 keeps "param".
    granularity: str = knob("param", "orthogonalize per parameter (per expert slice) or per_head")
    # Under DDP each rank runs Newton-Schulz for 1/world of the matrices and one all_gather shares the results
    # (MuonAdamW.distribute_orthogonalization): the same update bit for bit, less replicated work.
    distribute_newton_schulz: bool = knob(True, "DDP: split Newton-Schulz across ranks (same result, less work)")


@dataclass
class AdamWConfig:
    lr: float = knob(3e-3, "AdamW base learning rate (embeddings, head, norms, router)")
    weight_decay: float = knob(0.1, "AdamW decoupled weight decay")
    betas: list[float] = knob(meaning="AdamW (beta1, beta2)", factory=lambda: [0.9, 0.95])
    eps: float = knob(1e-8, "AdamW epsilon")


# A `qk_clip` event is logged for a head clipped for the first time in the run or with gamma (its scale) below
# this. Part of QK-Clip's definition, so it lives beside its config: the writer is pilotrun.optim.qk_clip, the
# reader that checks each event against it is summarize, and neither imports the other.
QK_CLIP_HARD_GAMMA = 0.5


@dataclass
class QKClipConfig:
    enabled: bool = knob(True, "rescale query/key weights of heads whose max logit exceeds tau")
    tau: float = knob(100.0, "QK-Clip threshold on the max attention logit")


@dataclass
class ScheduleConfig:
    """LR multiplier as a pure function of the applied-update count and this horizon: raising max_steps on a resume changes nothing already run."""

    kind: str = knob("cosine", "LR shape after warm-up: cosine, wsd (warmup-stable-decay) or constant")
    warmup_steps: int = knob(10, "linear warm-up length in applied updates")
    # Independent of train.max_steps so that raising max_steps on resume continues the same curve.
    horizon: int = knob(1000, "the schedule's own length in applied updates; set it to train.max_steps to "
                        "decay fully")
    min_lr_ratio: float = knob(0.1, "final LR as a fraction of the base LR (cosine, wsd)")
    decay_fraction: float = knob(0.2, "wsd: final fraction of the horizon spent decaying")
    # The routing settles before training ends.
    bias_freeze_fraction: float = knob(0.03, "final fraction of the horizon with the expert bias frozen")


@dataclass
class OptimConfig:
    muon: MuonConfig = field(default_factory=MuonConfig)
    adamw: AdamWConfig = field(default_factory=AdamWConfig)
    grad_clip: float = knob(1.0, "global gradient-norm clip; 0 disables clipping (the norm is still measured)")
    qk_clip: QKClipConfig = field(default_factory=QKClipConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    router_optimizer: str = knob("adamw", "optimizer of the router weights: adamw or muon")
    wd_norms: bool = knob(True, "weight decay on RMSNorm gains")


@dataclass
class ProfileConfig:
    """A torch.profiler window over a few updates (training/callbacks/profiling.py); off while `steps` is 0."""

    start_step: int = knob(1, "the first profiled update is the one that makes this step")
    steps: int = knob(0, "consecutive update attempts to profile; 0: no profiling")
    top_operators: int = knob(30, "rows of the operator table written beside the Chrome trace")
    record_shapes: bool = knob(False, "also group operators by input shapes (more overhead)")
    profile_memory: bool = knob(False, "also record allocations per operator (more overhead)")
    with_stack: bool = knob(False, "Python stacks in the trace (much more overhead and a bigger trace)")


@dataclass
class SpikeConfig:  # loss spikes: detected in the loop, answered by policy (training/spikes/detector.py, callbacks/spike_rollback.py)
    policy: str = knob("record", "record (a spike event), skip (not applied, reason spike) or rollback (to the "
                       "last committed checkpoint before it, its documents to their end plus margin skipped)")
    window: int = knob(50, "applied updates whose losses and gradient norms the running bound is taken over")
    factor: float = knob(6.0, "spike: not finite or > median + factor x floored 1.4826 MAD of window (training/spikes/bound.py)")
    min_history: int = knob(20, "applied updates in the window before finite values are judged")
    margin: int = knob(2, "rollback: updates' worth of data skipped at least after the spiking update's own")
    max_rollbacks: int = knob(3, "rollbacks per run; the spike that would need one more stops the run (stopped)")
    replay: bool = knob(True, "replay a spike (its batch, then the next) to name its cause (spikes.CAUSES)")


@dataclass
class TrainConfig:
    batch_size: int = knob(4, "sequences per microbatch per rank")
    seq_len: int = knob(32, "tokens per sequence")
    gradient_accumulation_steps: int = knob(1, "microbatches per update")
    max_steps: int = knob(100, "applied updates to train; does not move the LR schedule (optim.schedule.horizon)")
    precision: str = knob("fp32", "fp32, bf16 (autocast) or fp16 (autocast + loss scaling)")
    loss_scale_init: float = knob(65536.0, "fp16: initial loss scale")
    loss_scale_growth_interval: int = knob(2000, "fp16: updates without overflow before the scale doubles")
    max_consecutive_skips: int = knob(50, "stop the run with a clear reason after this many skipped updates in a row")
    seed: int = knob(0, "seed of every generator (initialization, data order)")
    data_mode: str = knob("successive", "successive (read the stream) or repeat_batch (one batch, for overfitting)")
    log_every: int = knob(10, "updates per logged train window")
    eval_every: int = knob(50, "updates between val evaluations; 0: no evaluation")
    eval_batches: int = knob(4, "val batches per evaluation (batch_size x (seq_len+1) tokens each)")
    downstream_tasks: list[str] = knob(meaning="multiple-choice task files (JSONL: context, choices, label) scored "
                                       "in the loop (training/multiple_choice.py)", factory=list)
    downstream_every: int = knob(0, "updates between scorings of train.downstream_tasks; 0: none")
    downstream_limit: int = knob(0, "first examples of each downstream task scored in the loop; 0: all")
    checkpoint_every: int = knob(50, "updates between checkpoints; 0: only at the end and on interruption")
    keep_checkpoints: int = knob(3, "newest committed checkpoints kept")
    keep_every: int = knob(0, "also keep every N-th step's checkpoint for good; 0: none")
    keep_steps: list[int] = knob(meaning="steps whose checkpoints are never pruned", factory=list)
    checkpoint_mode: str = knob("auto", "cadence saves: background (beside training), sync, or auto (cuda: background)")
    device: str = knob("auto", "auto (cuda when available, else cpu), cpu or cuda[:N]")
    num_threads: int = knob(0, "intra-op CPU threads; 0: chosen per run (free CPUs, a short timing; kept on resume)")
    parallelism: str = knob("ddp", "under torchrun: ddp or fsdp")
    memory_budget_gb: float = knob(0.0, "peak memory the verdict checks against; 0: no check")
    # "inductor" generates fused kernels (the first update pays the compile), "eager" only traces with Dynamo
    # (checks that the model compiles; no speed-up). On the CPU the MoE layers run eagerly with their kernels.
    compile: str = knob("none", "torch.compile each block: none, inductor (fused code) or eager (trace only)")
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    skip_data: list[list[int]] = knob(meaning="data the loader steps over: [first_batch, batches] global batch "
                                      "cursor ranges, besides the rollbacks' own (trainer state)", factory=list)
    tensorboard: bool = knob(False, "alias: true is read as `tensorboard` in train.trackers (folded in when the "
                             "recipe is loaded, so it reads back false)")
    trackers: list[str] = knob(meaning="trackers that mirror the record live on rank 0: any of tensorboard, wandb, "
                               "mlflow, trackio (each needs its extra, pilotrun[NAME]; a failing one warns once)",
                               factory=list)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# Machine settings, not recipe: how fast this machine computes the updates or who watches them, never what an
# update computes. They may change on resume without --allow-change, each session records its own, and a frozen
# lock neither holds a long run to the pilot's nor freezes them (a pilot on 2 CPU threads says nothing about the
# thread count of the long run's node). Another thread count may reorder a reduction's additions: a resume on
# it is free but not promised bit-exact, and run.json says so (checkpoint/compatibility.py `not_exact`).
MACHINE_KEYS = (
    "train.num_threads",
    # Profiling observes updates without changing them.
    "train.profile.start_step", "train.profile.steps", "train.profile.top_operators",
    "train.profile.record_shapes", "train.profile.profile_memory", "train.profile.with_stack",
    # Mirrors of the record, not part of the training (train.tensorboard: the alias loaded_recipe folds).
    "train.tensorboard", "train.trackers",
    "train.spike.replay",  # a replay restores all it touched: it costs time, changes no update
    # Downstream tasks watch the model without changing an update; their files' paths differ between machines,
    # and the lock names the pilot's tasks by sha256 (its watch section) for the long run's watch to compare.
    "train.downstream_tasks", "train.downstream_every", "train.downstream_limit",
    "train.checkpoint_mode",  # when the same state is written, never what it holds
)

# Keys that may change on resume without ceremony (the checkpoint compatibility check consults this).
CHECKPOINT_MODES = ("auto", "background", "sync")

RESUME_FREE_KEYS = (
    *MACHINE_KEYS,
    "model.activation_checkpointing", "optim.muon.distribute_newton_schulz",
    "train.max_steps", "train.log_every", "train.eval_every", "train.eval_batches", "train.checkpoint_every",
    "train.keep_checkpoints", "train.keep_every", "train.keep_steps", "train.max_consecutive_skips",
    "train.memory_budget_gb", "train.spike.max_rollbacks",
    "train.skip_data",  # ranges may be added; the checkpoint's stay (resume_plan.kept_skip_ranges)
)


def config_to_dict(config: Any) -> dict[str, Any]:
    """Canonical nested dict (JSON-ready) of a config dataclass."""
    return dataclasses.asdict(config)


def config_from_dict(data: dict[str, Any], cls: type = RunConfig, where: str = "") -> Any:
    """Build a config dataclass from a nested dict; unknown keys and wrong types raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted((k for k in data if k not in known), key=str)  # YAML keys may be numbers too
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ConfigError(f"unknown config key '{shown(key)}'{nearest_hint(str(unknown[0]), known)} (known here: "
                          f"{', '.join(sorted(known))})")
    values = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        values[name] = _coerce(value, hints[name], key)
    return cls(**values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return config_from_dict(value, hint, key)
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"config key '{key}' must be a list, got {shown(value)}")
        (item_hint,) = typing.get_args(hint)[:1]
        return [_coerce(v, item_hint, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"internal: unsupported union type for '{key}'")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint in (int, float):
        if isinstance(value, str):  # YAML 1.1 reads `1e6` (no dot) as a string: accept it as a number
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):  # YAML's .inf / .nan: a range check like `lr >= 0` would let inf pass
                raise ConfigError(f"config key '{key}' must be a finite number, got {shown(value)}")
            if hint is float:
                return float(value)
            if float(value).is_integer():
                return int(value)
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be str, got {shown(value)} (YAML reads yes/no/on/off/true/false "
                              "as booleans: quote the word, e.g. '\"off\"')")
    else:
        raise ConfigError(f"internal: unsupported type {hint!r} for '{key}'")
    raise ConfigError(f"config key '{key}' must be {hint.__name__}, got {shown(value)}")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.max_steps=200` -> (['train', 'max_steps'], 200); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got '{shown(text)}'")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"--set has an empty key part in '{shown(text)}'")
    value = parse_yaml_text(raw, f"--set {shown(key)}")
    return path, value


def nearest_hint(name: str, known: Any) -> str:
    """"; did you mean 'x'?" for the closest known name (a typo's most likely target), or nothing."""
    import difflib

    close = difflib.get_close_matches(name, [str(k) for k in known], n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def check_override_keys(overrides: list[str]) -> None:
    """Each `--set` key names a config key: a typo is blamed on the flag, with the nearest known key, before
    it could be mistaken for a fault of the recipe file."""
    leaves = set(flatten(config_to_dict(RunConfig())))
    for text in overrides:
        path, _ = parse_override(text)
        key = ".".join(path)
        if key in leaves:
            continue
        # The first part of the key that names nothing: 'nosection' of nosection.x, all of train.bogus.
        for depth in range(1, len(path) + 1):
            prefix = ".".join(path[:depth])
            if prefix not in leaves and not any(leaf.startswith(prefix + ".") for leaf in leaves):
                raise ConfigError(f"--set {shown(key)}: unknown config key '{shown(prefix)}'"
                                  f"{nearest_hint(key, sorted(leaves))} (`pilotrun config` lists every key)")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted `key=value` overrides to a nested dict (a copy); section names must exist."""
    import copy

    merged = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = merged
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {'.'.join(path)}: '{part}' is not a section")
        node[path[-1]] = value
    return merged


def packaged_configs_dir() -> Path:
    """The recipes shipped inside the package (pilotrun/configs/); the repository's configs/ links here."""
    return Path(__file__).resolve().parent / "configs"


def resolve_recipe_path(path: str | Path) -> Path:
    """An existing file as given, else a packaged recipe by name: `stability`, `stability.yaml`, `gpu/h100`
    or `configs/stability.yaml` (so README commands work from any folder and after a wheel install)."""
    given = Path(path)
    if given.is_file():
        return given
    name = given.as_posix().removeprefix("configs/")
    candidate = packaged_configs_dir() / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if not given.is_absolute() and candidate.is_file():
        return candidate
    odd = not_regular(given)
    if odd is not None:
        raise ConfigError(f"config file {path} is {odd}")
    shipped = sorted(p.relative_to(packaged_configs_dir()).with_suffix("").as_posix()
                     for p in packaged_configs_dir().rglob("*.yaml"))
    raise ConfigError(f"config file not found: {path} (packaged recipes by name: {', '.join(shipped)})")


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = resolve_recipe_path(path)
    data = parse_yaml_text(read_text_bounded(path, error=ConfigError), str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def load_run_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Defaults <- YAML file <- `--set` overrides, then validated."""
    check_override_keys(overrides or [])
    data = load_yaml(path) if path is not None else {}
    return loaded_recipe_from(apply_overrides(data, overrides or []), overrides or [], path)


def loaded_recipe_from(data: dict[str, Any], overrides: list[str], source: Any) -> RunConfig:
    """loaded_recipe, its error naming where the bad value came from (the line is all the user sees): the
    `--set` flag whose key the error names, else `source` (the recipe file, a lock; None: nothing to add)."""
    try:
        return loaded_recipe(data)
    except ConfigError as exc:
        flag = next((t for t in overrides if re.search(rf"(?<![\w.]){re.escape(t.split('=', 1)[0].strip())}"
                                                       r"(?![\w.])", str(exc))), None)
        if flag is None and source is None:
            raise
        raise ConfigError(f"--set {shown(flag)}: {exc}" if flag else f"{source}: {exc}") from None


def loaded_recipe(data: dict[str, Any]) -> RunConfig:
    """The recipe a command was given (a YAML, a lock's, an API caller's; after --set), built and validated, with
    the alias `train.tensorboard: true` folded into `train.trackers`, so that the trainer reads one list."""
    # Only a recipe loaded for a session is folded, never one read back from a record (run.json, a checkpoint,
    # a lock), which keeps its sha256; both keys are machine keys, free on resume and outside a lock's
    # comparison, so the folded form continues any run or lock that said true.
    config = config_from_dict(data)
    t = config.train
    if t.tensorboard:
        t.trackers, t.tensorboard = (t.trackers if "tensorboard" in t.trackers else ["tensorboard", *t.trackers]), False
    validate_run_config(config)
    return config


def validate_run_config(config: RunConfig) -> None:
    """Impossible geometry and out-of-range values, one clear error each."""
    m, o, t = config.model, config.optim, config.train

    def need(condition: bool, message: str) -> None:
        if not condition:
            raise ConfigError(message)

    for name in ("d_model", "n_layers", "n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim", "moe_hidden", "dense_hidden", "max_seq_len"):
        need(getattr(m, name) > 0, f"model.{name} must be positive, got {getattr(m, name)}")
    need(m.vocab_size >= 0, f"model.vocab_size must be >= 0 (0 = from the data), got {m.vocab_size}")
    need(m.q_lora_rank >= 0, f"model.q_lora_rank must be >= 0, got {m.q_lora_rank}")
    need(0 <= m.n_dense_layers <= m.n_layers,
         f"model.n_dense_layers ({m.n_dense_layers}) must be between 0 and model.n_layers ({m.n_layers})")
    need(m.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim must be even, got {m.qk_rope_head_dim}")
    need(m.balance in BALANCE_MODES, f"model.balance must be one of {BALANCE_MODES}, got '{m.balance}'")
    need(m.score_func in SCORE_FUNCS, f"model.score_func must be one of {SCORE_FUNCS}, got '{m.score_func}'")
    need(m.attn_impl in ATTN_IMPLS, f"model.attn_impl must be one of {ATTN_IMPLS}, got '{m.attn_impl}'")
    need(m.moe_impl in MOE_IMPLS, f"model.moe_impl must be one of {MOE_IMPLS}, got '{m.moe_impl}'")
    if m.n_layers > m.n_dense_layers:  # at least one MoE layer
        need(m.n_routed_experts >= 1, "model.n_routed_experts must be >= 1 when MoE layers exist")
        need(1 <= m.top_k <= m.n_routed_experts,
             f"model.top_k ({m.top_k}) must be between 1 and model.n_routed_experts ({m.n_routed_experts})")
        need(m.n_shared_experts >= 0, "model.n_shared_experts must be >= 0")
        need(not (m.score_func == "sigmoid" and m.route_norm and m.top_k < 2),
             "model.top_k must be >= 2 with a sigmoid router and route_norm (with K=1 the router gets no gradient)")
        need(m.n_expert_groups >= 1 and m.n_routed_experts % m.n_expert_groups == 0,
             f"model.n_routed_experts ({m.n_routed_experts}) must be divisible by model.n_expert_groups "
             f"({m.n_expert_groups})")
        need(1 <= m.n_limited_groups <= m.n_expert_groups,
             "model.n_limited_groups must be between 1 and model.n_expert_groups")
        need(m.top_k <= m.n_limited_groups * (m.n_routed_experts // m.n_expert_groups),
             "model.top_k exceeds the experts reachable in model.n_limited_groups groups")
    need(m.route_scale >= 0, "model.route_scale must be >= 0 (0 = default)")
    need(m.bias_update_speed >= 0, "model.bias_update_speed must be >= 0")
    need(m.init_std > 0, "model.init_std must be positive")

    need(o.muon.scale_mode in MUON_SCALE_MODES,
         f"optim.muon.scale_mode must be one of {MUON_SCALE_MODES}, got '{o.muon.scale_mode}'")
    need(o.muon.ns_steps >= 1, "optim.muon.ns_steps must be >= 1")
    need(o.muon.granularity in MUON_GRANULARITIES,
         f"optim.muon.granularity must be one of {MUON_GRANULARITIES}, got '{o.muon.granularity}'")
    need(o.muon.ns_variant in MUON_NS_VARIANTS,
         f"optim.muon.ns_variant must be one of {MUON_NS_VARIANTS}, got '{o.muon.ns_variant}'")
    need(0 <= o.muon.momentum < 1, "optim.muon.momentum must be in [0, 1)")
    need(len(o.adamw.betas) == 2 and all(0 <= b < 1 for b in o.adamw.betas),
         f"optim.adamw.betas must be two numbers in [0, 1), got {o.adamw.betas}")
    for name, value in (("optim.muon.lr", o.muon.lr), ("optim.adamw.lr", o.adamw.lr),
                        ("optim.muon.weight_decay", o.muon.weight_decay),
                        ("optim.adamw.weight_decay", o.adamw.weight_decay), ("optim.grad_clip", o.grad_clip)):
        need(value >= 0, f"{name} must be >= 0, got {value}")
    need(o.qk_clip.tau > 0, f"optim.qk_clip.tau must be positive, got {o.qk_clip.tau}")
    need(o.router_optimizer in ROUTER_OPTIMIZERS,
         f"optim.router_optimizer must be one of {ROUTER_OPTIMIZERS}, got '{o.router_optimizer}'")
    s = o.schedule
    need(s.kind in SCHEDULE_KINDS, f"optim.schedule.kind must be one of {SCHEDULE_KINDS}, got '{s.kind}'")
    need(s.warmup_steps >= 0, "optim.schedule.warmup_steps must be >= 0")
    need(s.horizon >= 1 and s.horizon >= s.warmup_steps,
         f"optim.schedule.horizon ({s.horizon}) must be >= 1 and >= warmup_steps ({s.warmup_steps})")
    need(0 <= s.min_lr_ratio <= 1, "optim.schedule.min_lr_ratio must be in [0, 1]")
    need(0 < s.decay_fraction <= 1, "optim.schedule.decay_fraction must be in (0, 1]")
    need(0 <= s.bias_freeze_fraction < 1, "optim.schedule.bias_freeze_fraction must be in [0, 1)")

    for name in ("batch_size", "seq_len", "gradient_accumulation_steps", "max_steps", "eval_batches",
                 "keep_checkpoints", "max_consecutive_skips", "log_every"):
        need(getattr(t, name) >= 1, f"train.{name} must be >= 1, got {getattr(t, name)}")
    need(t.checkpoint_mode in CHECKPOINT_MODES,
         f"train.checkpoint_mode must be one of {CHECKPOINT_MODES}, got '{t.checkpoint_mode}'")
    need(all(type(s) is int and s >= 0 for s in t.keep_steps), f"train.keep_steps must be steps >= 0: {t.keep_steps}")
    for name in ("eval_every", "checkpoint_every", "num_threads", "keep_every", "downstream_every",
                 "downstream_limit"):
        need(getattr(t, name) >= 0, f"train.{name} must be >= 0, got {getattr(t, name)}")
    need(t.precision in PRECISIONS, f"train.precision must be one of {PRECISIONS}, got '{t.precision}'")
    need(t.data_mode in DATA_MODES, f"train.data_mode must be one of {DATA_MODES}, got '{t.data_mode}'")
    need(t.compile in COMPILE_MODES, f"train.compile must be one of {COMPILE_MODES}, got '{t.compile}'")
    need(t.parallelism in PARALLELISMS, f"train.parallelism must be one of {PARALLELISMS}, got '{t.parallelism}'")
    for name in t.trackers:
        need(name in TRACKER_NAMES, f"train.trackers: unknown tracker '{name}' (known: {', '.join(TRACKER_NAMES)})")
    need(len(set(t.trackers)) == len(t.trackers), f"train.trackers names a tracker twice: {t.trackers}")
    need(t.profile.steps >= 0, f"train.profile.steps must be >= 0 (0: off), got {t.profile.steps}")
    need(t.profile.start_step >= 1, f"train.profile.start_step must be >= 1, got {t.profile.start_step}")
    need(t.profile.top_operators >= 1, f"train.profile.top_operators must be >= 1, got {t.profile.top_operators}")
    need(t.loss_scale_init > 0, "train.loss_scale_init must be positive")
    sp = t.spike
    need(sp.policy in SPIKE_POLICIES, f"train.spike.policy must be one of {SPIKE_POLICIES}, got '{sp.policy}'")
    need(sp.window >= 3 and 1 <= sp.min_history <= sp.window and sp.factor > 0 and sp.margin >= 0
         and sp.max_rollbacks >= 0, f"train.spike: need window >= 3, 1 <= min_history <= window, factor > 0, "
         f"margin >= 0, max_rollbacks >= 0; got {sp}")
    need(all(len(e) == 2 and e[0] >= 0 and e[1] >= 1 for e in t.skip_data),
         f"train.skip_data entries are [first_batch >= 0, batches >= 1], got {t.skip_data}")
    need(t.loss_scale_growth_interval >= 1, "train.loss_scale_growth_interval must be >= 1")
    need(t.seq_len <= m.max_seq_len,
         f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}), the RoPE table's length")
    need(t.device == "auto" or t.device == "cpu" or t.device.startswith("cuda"),
         f"train.device must be auto, cpu or cuda[:N], got '{t.device}'")


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'seq_len': 32}} -> {'train.seq_len': 32}: the form compatibility checks compare."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out
