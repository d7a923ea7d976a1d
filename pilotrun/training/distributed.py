"""Data parallelism on PyTorch's own engine: torchrun's process group, rank helpers, agreed statistics.

`torchrun --nproc_per_node=N -m pilotrun train ...` starts N copies of the trainer with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the environment. `init_distributed()` reads them and opens the
default process group (gloo on CPU, NCCL on CUDA); without them it returns a one-process context and
touches nothing, so the single-process path has no distributed code in it at all.

Every rank must take the same decision at every point where a decision is taken (skip an fp16 update, clip
a head, move an expert bias), or the replicas drift apart silently. DDP already averages gradients, so the
gradient norm and the overflow check agree; the per-step statistics that the model gathers in buffers do
not go through DDP, so `all_reduce_step_statistics` combines them explicitly: expert token counts are
summed (the bias rule needs the global load), QK max logits take the maximum (QK-Clip bounds the largest
logit any rank saw). Each kind is packed into one flat buffer so a step costs two collectives, not one per
layer.
"""

from __future__ import annotations

import datetime
import inspect
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from pilotrun.common.errors import ConfigError
from pilotrun.common.files import canonical_sha256

T = TypeVar("T")

@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the job. A single process is rank 0 of a world of 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: no process group (single process)
    device: str = "cpu"  # this rank's device, e.g. "cpu" or "cuda:3"

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict[str, Any]:
        """JSON-ready, for run.json's hardware section."""
        return {"world_size": self.world_size, "rank": self.rank, "local_rank": self.local_rank,
                "backend": self.backend, "device": self.device}


SINGLE_PROCESS = DistributedContext()


def launched_by_torchrun(environ: dict[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return all(name in environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _read_int_env(environ: dict[str, str], name: str) -> int:
    raw = environ.get(name, "")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"environment variable {name}='{raw}' is not an integer (set by torchrun)"
        ) from None


def resolve_device(device_preference: str, local_rank: int = 0) -> str:
    """`auto` -> this rank's GPU when CUDA is available, else cpu. An explicit `cuda` picks cuda:LOCAL_RANK
    so that N processes on one node do not all land on GPU 0."""
    if device_preference == "auto":
        device_preference = "cuda" if torch.cuda.is_available() else "cpu"
    if device_preference == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise ConfigError(f"train.device is '{device_preference}' but CUDA is not available on this machine")
    if device_preference == "cuda":
        return f"cuda:{local_rank}"
    return device_preference


def init_distributed(device_preference: str = "auto", timeout_minutes: float = 30.0,
                     environ: dict[str, str] | None = None) -> DistributedContext:
    """Open the default process group when launched by torchrun with WORLD_SIZE > 1.

    Idempotent: when a default group already exists (a test harness, a second Trainer in the same process)
    it is reused. The backend follows the device: NCCL moves CUDA tensors, gloo moves CPU tensors.
    """
    environ = dict(os.environ) if environ is None else environ
    if not launched_by_torchrun(environ):
        return DistributedContext(device=resolve_device(device_preference, 0))
    rank = _read_int_env(environ, "RANK")
    world_size = _read_int_env(environ, "WORLD_SIZE")
    local_rank = _read_int_env(environ, "LOCAL_RANK")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"torchrun environment is inconsistent: RANK={rank}, WORLD_SIZE={world_size}")
    if world_size > 1 and device_preference.startswith("cuda:"):
        # A fixed GPU index would put every rank of a node on that one GPU.
        raise ConfigError(
            f"train.device={device_preference} under torchrun with {world_size} ranks would put every "
            "rank on one GPU; use train.device=auto or cuda (each rank takes cuda:LOCAL_RANK)"
        )
    device = resolve_device(device_preference, local_rank)
    if world_size == 1:
        return DistributedContext(rank=0, world_size=1, local_rank=local_rank, device=device)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
        store = restart_store(environ, world_size, timeout)
        if store is not None:
            kwargs.update(store=store, rank=rank, world_size=world_size)
        if backend == "nccl":
            kwargs["device_id"] = torch.device(device)  # binds the communicator eagerly, avoids a guess later
        dist.init_process_group(**kwargs)
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ConfigError(f"a process group already exists with rank {dist.get_rank()} of "
                          f"{dist.get_world_size()}, but torchrun says rank {rank} of {world_size}")
    return DistributedContext(rank=rank, world_size=world_size, local_rank=local_rank,
                              backend=dist.get_backend(), device=device)


def restart_store(environ: dict[str, str], world_size: int, timeout: datetime.timedelta) -> Any:
    """The process group's store under torchrun's agent, one key space per restart of the group; None: torch's
    own (env://). torchrun's agent hosts one TCPStore for every restart of its workers, and torch's env://
    store does not separate the restarts' keys: a rank of a restarted group could read a peer's address that
    the previous group published and connect to a process that is gone (gloo: "connectFullMesh failed ...
    Connection refused" after a restart under `--max-restarts`). Prefixed by TORCHELASTIC_RESTART_COUNT, each
    restart's group reads only its own keys."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in environ:
        return None
    store = dist.TCPStore(environ["MASTER_ADDR"], _read_int_env(environ, "MASTER_PORT"), world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"pilotrun/restart-{environ['TORCHELASTIC_RESTART_COUNT']}", store)


def shutdown_distributed(context: DistributedContext) -> None:
    """Close the default group opened by `init_distributed` (a no-op for a single process)."""
    if context.is_distributed and dist.is_initialized():
        dist.destroy_process_group()


def barrier(context: DistributedContext) -> None:
    if context.is_distributed:
        if context.backend == "nccl":
            dist.barrier(device_ids=[torch.device(context.device).index or 0])
        else:
            dist.barrier()


def broadcast_object(context: DistributedContext, value: T) -> T:
    """Rank 0's value on every rank (a run id, a chosen checkpoint step): one agreed choice, not N guesses."""
    if not context.is_distributed:
        return value
    box = [value if context.is_main_process else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def _collective_device(context: DistributedContext) -> torch.device:
    return torch.device(context.device if context.backend == "nccl" else "cpu")


def all_reduce_packed(context: DistributedContext, tensors: dict[str, torch.Tensor],
                      op: str) -> dict[str, torch.Tensor]:
    """All-reduce several tensors with one collective: flatten them into one float64 buffer, reduce, unpack.

    float64 because expert token counts are integers and fp32 is exact only up to 2**24 (16.7M), which 8
    ranks of 1M tokens each with top-8 routing exceed in one step: in float64 every partial sum of the ring
    is exact, so the result does not depend on the order the collective adds in and is rounded once, on the
    way back to the caller's dtype. Results come back in each tensor's own dtype and device, as new tensors
    (the inputs are not modified).
    """
    if op not in ("sum", "max", "min"):
        raise ValueError(f"op must be sum, max or min, got {op!r}")
    if not context.is_distributed or not tensors:
        return {name: t.detach().clone() for name, t in tensors.items()}
    device = _collective_device(context)
    flat = torch.cat(
        [t.detach().reshape(-1).to(device=device, dtype=torch.float64) for t in tensors.values()]
    )
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    dist.all_reduce(flat, op=reduce_op)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, t in tensors.items():
        n = t.numel()
        out[name] = flat[offset:offset + n].reshape(t.shape).to(device=t.device, dtype=t.dtype)
        offset += n
    return out


def all_reduce_step_statistics(context: DistributedContext, tokens_per_expert: torch.Tensor,
                               qk_max_logit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Global step statistics from each rank's: expert token counts SUM, QK max logits MAX.

    A NaN max logit on any rank must stay NaN (QK-Clip then skips that layer and says so): MAX in the
    collectives does not promise to propagate NaN, so the NaN positions are counted in the SUM buffer and
    put back after the reduction. Every rank gets bit-identical results, so every rank decides the same.
    """
    if not context.is_distributed:
        return tokens_per_expert.detach().clone(), qk_max_logit.detach().clone()
    qk = qk_max_logit.detach()
    nan_mask = torch.isnan(qk)
    summed = all_reduce_packed(context, {"tokens_per_expert": tokens_per_expert,
                                         "qk_nan_count": nan_mask.to(torch.float32)}, "sum")
    maxed = all_reduce_packed(context, {"qk_max_logit": torch.where(nan_mask, torch.full_like(qk, -torch.inf),
                                                                    qk)}, "max")
    qk_global = maxed["qk_max_logit"]
    qk_global[summed["qk_nan_count"] > 0] = torch.nan
    return summed["tokens_per_expert"], qk_global


def mean_across_ranks(context: DistributedContext, values: dict[str, float]) -> dict[str, float]:
    """The mean over ranks of per-rank scalars (a window's mean loss): each rank saw an equal share of the
    global batch, so the mean of the means is the global mean."""
    if not context.is_distributed:
        return dict(values)
    summed = all_reduce_packed(
        context, {k: torch.tensor(float(v), dtype=torch.float64) for k, v in values.items()}, "sum"
    )
    return {k: float(v.item()) / context.world_size for k, v in summed.items()}


def any_across_ranks(context: DistributedContext, flag: bool) -> bool:
    """True on every rank when it is true on any (stop requests, a skip decision that must be shared)."""
    if not context.is_distributed:
        return bool(flag)
    return bool(
        all_reduce_packed(context, {"flag": torch.tensor(1.0 if flag else 0.0)}, "max")["flag"].item() > 0
    )


def first_across_ranks(context: DistributedContext, value: Any) -> Any:
    """The first rank's non-None `value` in rank order, on every rank (None when no rank has one). Costs one
    flag all-reduce when no rank has one; the objects are gathered only when some rank does (a stop request
    that one rank alone found, a shard whose hash differs there, must be told in the same words on all)."""
    if not any_across_ranks(context, value is not None):
        return None
    if not context.is_distributed:
        return value
    gathered: list[Any] = [None] * context.world_size
    dist.all_gather_object(gathered, value)
    return next(v for v in gathered if v is not None)


def check_same_on_all_ranks(context: DistributedContext, name: str, value: Any) -> None:
    """Refuse to go on when ranks disagree about something that must be shared (a config hash, a data
    identity, a checkpoint step): better one clear error than N replicas training different things."""
    if not context.is_distributed:
        return
    gathered: list[Any] = [None] * context.world_size
    dist.all_gather_object(gathered, value)
    if any(v != gathered[0] for v in gathered):
        raise ConfigError(
            f"ranks disagree on {name}: " + ", ".join(f"rank {i}: {v!r}" for i, v in enumerate(gathered))
        )


class ReplicasDivergedError(RuntimeError):
    """DDP replicas that should be identical are not: a bug (some decision was taken differently), not bad
    input, so an ordinary exception with a traceback rather than a PilotrunError."""


def check_replicas_identical(context: DistributedContext, model: nn.Module) -> int:
    """Under DDP every rank holds the whole model and must hold the same one; nothing in DDP checks that, and
    a checkpoint stores replicated tensors once, so a rank that had drifted would be lost without a trace.
    Compares a fingerprint of every tensor in the state dict (parameters and persistent buffers such as the
    expert biases): its float64 sum and sum of squares, all-gathered. Returns the number of tensors checked;
    raises ReplicasDivergedError naming the first tensor that differs. A no-op for one process and for FSDP2
    (whose ranks hold different shards by design)."""
    if not context.is_distributed or is_fully_sharded(model):
        return 0
    state = unwrap_model(model).state_dict()
    names = sorted(state)
    fingerprint = torch.stack(
        [
            torch.stack([state[n].detach().double().sum(), state[n].detach().double().square().sum()])
            for n in names
        ]
    ).to(_collective_device(context))
    gathered = [torch.empty_like(fingerprint) for _ in range(context.world_size)]
    dist.all_gather(gathered, fingerprint)
    for rank, other in enumerate(gathered):
        if not torch.equal(other.nan_to_num(nan=0.5), gathered[0].nan_to_num(nan=0.5)):
            row = int((other.nan_to_num(nan=0.5) != gathered[0].nan_to_num(nan=0.5)).any(dim=1).nonzero()[0])
            raise ReplicasDivergedError(f"DDP replicas differ: '{names[row]}' on rank {rank} is not rank 0's "
                                        f"(sum {other[row, 0].item()!r} vs {gathered[0][row, 0].item()!r})")
    return len(names)


def check_same_run_on_all_ranks(
    context: DistributedContext, recipe: dict[str, Any], data_identity: str
) -> None:
    """Every rank must train the same recipe on the same data. On several nodes each reads its own copy of the
    config and the data folder, and a stale copy on one node would give replicas that differ silently; this
    compares the data's metadata_sha256 and a sha256 of the canonical recipe, and refuses with one line."""
    recipe_sha = canonical_sha256(recipe)
    check_same_on_all_ranks(context, "the data folder's metadata_sha256", data_identity)
    check_same_on_all_ranks(context, "the recipe (sha256 of the effective config)", recipe_sha[:16])


# ---------------------------------------------------------------------------------------------- wrapping
def wrap_model(model: nn.Module, context: DistributedContext, parallelism: str = "ddp",
               precision: str = "fp32") -> nn.Module:
    """Wrap for data parallelism: DDP (every rank holds the whole model) or FSDP2 (`fully_shard`: each rank
    holds a 1/N slice of every parameter, gathered per block for compute). A single process is unwrapped.

    DDP must not broadcast buffers at each forward: the model accumulates per-rank step statistics
    (tokens_per_expert, qk_max_logit) in buffers across microbatches, and a broadcast from rank 0 would
    overwrite the other ranks' counts before they are all-reduced. The persistent buffers (expert biases) stay
    equal without it, because every rank updates them from the same all-reduced counts.

    Build the optimizer after wrapping (session.build_session does): FSDP2 replaces each parameter by a
    sharded DTensor, and an optimizer built before would hold, and update, the unsharded originals.
    """
    if parallelism not in ("ddp", "fsdp"):
        raise ConfigError(f"train.parallelism must be ddp or fsdp, got '{parallelism}'")
    if not context.is_distributed:
        return model
    if parallelism == "fsdp" and precision == "fp16":
        # GradScaler checks each rank's gradient *shard* for inf/NaN and backs its scale off on its own, so
        # under FSDP2 the ranks' loss scales could drift apart: refused rather than silently different.
        raise ConfigError(
            "train.parallelism=fsdp with train.precision=fp16 is not supported (the loss scaler's "
            "overflow check would see only each rank's gradient shard); use bf16 or fp32, or ddp"
        )
    if parallelism == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        kwargs: dict[str, Any] = {}
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
            kwargs["forward_sync_buffers"] = False  # torch >= 2.13 name
        else:
            kwargs["broadcast_buffers"] = False
        device_ids = [torch.device(context.device).index] if context.device.startswith("cuda") else None
        return DistributedDataParallel(model, device_ids=device_ids, **kwargs)
    return _fully_shard_model(model, context)


def _fully_shard_model(model: nn.Module, context: DistributedContext) -> nn.Module:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 kept it under _composable
        raise ConfigError(
            "train.parallelism=fsdp needs torch.distributed.fsdp.fully_shard (torch >= 2.6)"
        ) from None
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if context.device.startswith("cuda") else "cpu"
    mesh = init_device_mesh(device_type, (context.world_size,))
    # One FSDP unit per transformer block: its parameters are gathered just before the block runs and freed
    # after, which is what bounds memory; the root unit takes what is left (embedding, final norm, head).
    blocks = getattr(model, "layers", None)
    if blocks is not None:
        for block in blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model itself under a DDP wrapper (FSDP2 modifies the module in place and needs no unwrapping)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def is_fully_sharded(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


@contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Inside gradient accumulation, reduce gradients once per update (on the last microbatch), not once per
    microbatch: `no_sync` for DDP, `set_requires_gradient_sync` for FSDP2; nothing for a plain module."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        with nullcontext() if sync else model.no_sync():
            yield
        return
    if is_fully_sharded(model):
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]
        return
    yield
