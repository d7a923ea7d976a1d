"""The checkpoint storages: one entry each in STORAGES, the only place a storage is registered.

A storage writes a state dict into a folder and reads it back (checkpointer.CheckpointStorage); the policy
around it (temp folder, rename, marker written last, pruning, rehashing) is the checkpointer's and never
looks inside the files. An entry names the storage as its markers record it, how to build it for this
process's place in the world, whether it is collective (every rank writes its own part, so any world size
can use it; otherwise one process writes everything, which only a single-process run can do) and a line of
what it is. `AUTOMATIC` is the choice a run makes unless it names a storage: DCP for several ranks,
torch.save for one. Every checkpoint is read with the storage its marker names, whatever a run chooses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pilotrun.common.errors import ConfigError
from pilotrun.training.checkpoint.checkpointer import CheckpointStorage
from pilotrun.training.checkpoint.dcp_storage import DCPStorage
from pilotrun.training.checkpoint.single_file import TorchSaveStorage
from pilotrun.training.distributed import DistributedContext

AUTOMATIC = "auto"


@dataclass(frozen=True)
class StorageKind:
    name: str  # what a checkpoint's marker records as its `storage`
    build: Callable[[DistributedContext], CheckpointStorage]
    collective: bool
    description: str


def _registered(*kinds: StorageKind) -> dict[str, StorageKind]:
    return {kind.name: kind for kind in kinds}


STORAGES: dict[str, StorageKind] = _registered(
    StorageKind(TorchSaveStorage.name, lambda context: TorchSaveStorage(), collective=False,
                description="torch.save shards written by one process (single_file.py)"),
    StorageKind(DCPStorage.name, DCPStorage, collective=True,
                description="torch.distributed.checkpoint, every rank writing its part (dcp_storage.py)"),
)


def chosen_storage(name: str, context: DistributedContext) -> str:
    """The registered storage a run that asks for `name` writes with, or the ConfigError saying why not."""
    if name == AUTOMATIC:
        return DCPStorage.name if context.is_distributed else TorchSaveStorage.name
    if name not in STORAGES:
        raise ConfigError(f"unknown checkpoint storage '{name}' (known: {', '.join((AUTOMATIC, *STORAGES))})")
    if context.is_distributed and not STORAGES[name].collective:
        collective = ", ".join(kind.name for kind in STORAGES.values() if kind.collective)
        raise ConfigError(f"checkpoint storage '{name}' is written by one process; a run of "
                          f"{context.world_size} ranks needs a collective one ({collective})")
    return name
