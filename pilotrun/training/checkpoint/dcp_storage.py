"""Checkpoints through torch.distributed.checkpoint (DCP): every rank writes its own shards, one commit.

The Checkpointer (checkpointer.py) keeps the policy: a temp folder, an atomic rename, a COMMITTED.json marker
written last with every file's sha256, pruning. Under data parallelism that policy still runs once, on rank
0; what changes is the storage. `DCPStorage.write` is collective: rank 0 names the temp folder, every rank
writes its part of the state into it with `dcp.save` (DDP's replicated tensors are written once, by one
rank; FSDP2's shards by their owners), each rank hashes the files it wrote and rank 0 gathers the hashes
for the marker. Only then does rank 0 rename and commit, so a crash of any rank at any moment leaves a
folder without a marker, which is never loaded: the same rule as the single-process storage.

Each rank's RNG differs (the data order is global, but dropout-like draws and generator positions are not
shared), so the keys named in `per_rank_keys` (default: "rng") are stored once per rank as `rng__rank<R>`
and each rank reads back its own. Everything else in the state is the same on every rank and DCP stores it
once.

The checkpointer for any world size, which chooses this storage or another and reads a checkpoint with the
one its marker names, is distributed_checkpointer.py; the storages are registered in storages.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from pilotrun.common.errors import CheckpointError
from pilotrun.common.files import fsync_directory, sha256_of_file
from pilotrun.training.checkpoint.dcp_safe_read import read_dcp_metadata, safe_dcp_load
from pilotrun.training.distributed import SINGLE_PROCESS, DistributedContext, broadcast_object

PER_RANK_SEPARATOR = "__rank"
METADATA_FILE = ".metadata"


def _per_rank_key(key: str, rank: int) -> str:
    return f"{key}{PER_RANK_SEPARATOR}{rank}"


def _rank_of_file(name: str) -> int | None:
    """DCP's FileSystemWriter names data files `__<rank>_<index>.distcp`."""
    if name.startswith("__") and name.endswith(".distcp"):
        head = name[2:].split("_", 1)[0]
        if head.isdigit():
            return int(head)
    return None


class DCPStorage:
    """A CheckpointStorage for torch.distributed.checkpoint. `write` and `read` are collective: every rank
    calls them (rank 0 from inside Checkpointer.save / load, the others from DistributedCheckpointer), and
    `write_started` / `write_finished` tell that checkpointer where a failed save stopped."""

    name = "torch_dcp"

    def __init__(
        self, context: DistributedContext = SINGLE_PROCESS, per_rank_keys: tuple[str, ...] = ("rng",)
    ):
        self.context = context
        self.per_rank_keys = per_rank_keys
        # Let DistributedCheckpointer tell where rank 0 failed: before the collective write (the other ranks
        # wait for a folder name), inside it (DCP raises on every rank) or after it (they wait for the
        # commit).
        self.write_started = False
        self.write_finished = False

    # ------------------------------------------------------------------------------------------ write
    def write(self, state: dict[str, Any], folder: Path | None) -> dict[str, tuple[str, int]]:
        """Rank 0 passes the temp folder; the other ranks pass None and receive it. Returns, on rank 0, every
        file in the folder with its sha256 and size; {} on the other ranks."""
        self.write_started = True
        message = broadcast_object(self.context, ("folder", str(folder) if folder is not None else None))
        if message[0] != "folder":  # rank 0 failed before writing: stop here instead of waiting forever
            raise CheckpointError(f"checkpoint save failed on rank 0: {message[1]}")
        target = Path(message[1])
        flat = self.flat_state(state)
        writer = dcp.FileSystemWriter(target, single_file_per_rank=True, sync_files=True)
        # dcp.save returns on every rank only after the coordinator has written .metadata from every rank's
        # results, so after it every file of the checkpoint exists and is fsynced.
        dcp.save(flat, storage_writer=writer, no_dist=not self.context.is_distributed)
        own = {}
        for path in sorted(target.iterdir()):
            if _rank_of_file(path.name) == self.context.rank:  # hash what this rank wrote, in parallel
                own[path.name] = (sha256_of_file(path), path.stat().st_size)
        gathered = self._gather_to_main(own)
        self.write_finished = True
        if not self.context.is_main_process:
            return {}
        files: dict[str, tuple[str, int]] = {}
        for part in gathered:
            files.update(part)
        for path in sorted(target.iterdir()):  # .metadata and anything a rank did not claim
            if path.is_file() and path.name not in files:
                files[path.name] = (sha256_of_file(path), path.stat().st_size)
        fsync_directory(target)
        return files

    def flat_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The state as DCP writes it: each per-rank key under this rank's own name, the rest as it is."""
        flat = {k: v for k, v in state.items() if k not in self.per_rank_keys}
        for key in self.per_rank_keys:
            if key in state:
                flat[_per_rank_key(key, self.context.rank)] = state[key]
        return flat

    def _gather_to_main(self, own: dict[str, tuple[str, int]]) -> list[dict[str, tuple[str, int]]]:
        if not self.context.is_distributed:
            return [own]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.context.world_size
        dist.all_gather_object(gathered, own)
        return gathered

    # ------------------------------------------------------------------------------------------ read
    def read(self, folder: Path, files: list[str], template: dict[str, Any] | None = None) -> dict[str, Any]:
        """Load into `template` (DCP loads in place: tensors keep their device, dtype and sharding) or,
        without one, everything as plain tensors. Each rank gets its own per-rank entries; a rank that has
        none (the checkpoint came from fewer ranks) gets rank (R mod saved ranks)'s, and `read_notes` says
        so."""
        self.read_notes: list[str] = []
        saved_ranks = sorted(self._saved_ranks(folder))
        source_rank = self.context.rank
        if saved_ranks and source_rank not in saved_ranks:
            source_rank = saved_ranks[self.context.rank % len(saved_ranks)]
            self.read_notes.append(f"rank {self.context.rank}: the checkpoint has no RNG state for this rank "
                                   f"(written by {len(saved_ranks)} rank(s)); restored rank {source_rank}'s")
        no_dist = not self.context.is_distributed
        try:
            if template is None:
                with warnings.catch_warnings():  # "assuming ... a single process": intended
                    warnings.filterwarnings(
                        "ignore", message="torch.distributed is disabled", category=UserWarning
                    )
                    loaded = safe_dcp_load(folder, None, no_dist)
                flat = {k: v for k, v in loaded.items() if PER_RANK_SEPARATOR not in k}
                for key in self.per_rank_keys:
                    if _per_rank_key(key, source_rank) in loaded:
                        flat[key] = loaded[_per_rank_key(key, source_rank)]
                return flat
            flat = {k: v for k, v in template.items() if k not in self.per_rank_keys}
            for key in self.per_rank_keys:
                if key in template:
                    flat[_per_rank_key(key, source_rank)] = template[key]
            with warnings.catch_warnings():
                # One process reading a checkpoint written by several is intended (a world-size change).
                warnings.filterwarnings(
                    "ignore", message="torch.distributed is disabled", category=UserWarning
                )
                safe_dcp_load(folder, flat, no_dist)
        except CheckpointError:
            raise
        except Exception as exc:  # DCP wraps rank failures; name the folder and the first line of the cause
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"checkpoint {folder} cannot be read with torch.distributed.checkpoint: "
                                  f"{first_line}") from None
        state = {k: v for k, v in flat.items() if PER_RANK_SEPARATOR not in k}
        for key in self.per_rank_keys:
            if _per_rank_key(key, source_rank) in flat:
                state[key] = flat[_per_rank_key(key, source_rank)]
        return state

    def _saved_ranks(self, folder: Path) -> set[int]:
        metadata = read_dcp_metadata(folder)
        ranks = set()
        for fqn in metadata.state_dict_metadata:
            top = fqn.split(".", 1)[0]
            for key in self.per_rank_keys:
                prefix = f"{key}{PER_RANK_SEPARATOR}"
                if top.startswith(prefix) and top[len(prefix):].isdigit():
                    ranks.add(int(top[len(prefix):]))
        return ranks


# ---------------------------------------------------------------------------------------------- model +
# optimizer
def model_and_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """State dicts keyed by parameter name (not by position), that DCP can save and load in place: plain
    tensors under DDP or a single process, DTensor shards under FSDP2. The optimizer state is created
    (one zero-learning-rate step) when it does not exist yet, so that a fresh optimizer is a load template."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer)


def load_model_and_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                                   optimizer_state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def check_parts(state: dict[str, Any], parts: list[str], step: int) -> None:
    """A marker that lists fewer files than a save writes still verifies (every listed hash matches): name the
    part it lacks instead of failing on a missing key."""
    missing = [part for part in parts if part not in state]
    if missing:
        raise CheckpointError(f"checkpoint step {step} lacks {', '.join(missing)} (its marker does not list "
                              "the file): the checkpoint is damaged")
