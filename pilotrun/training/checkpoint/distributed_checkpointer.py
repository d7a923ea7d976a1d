"""The checkpointer for any world size: the policy of checkpointer.py run on rank 0, a storage chosen by name
from storages.py for writing, and every checkpoint read with the storage its marker names.

By default (`storage="auto"`) it writes with DCP when the world has more than one rank and with torch.save
otherwise; a run may name a registered storage instead, provided it can write with this many ranks. Because
reading follows the marker, a checkpoint written by 2 ranks can be read by 1 process and vice versa; the
trainer decides whether such a resume is allowed (see
`pilotrun.training.checkpoint.compatibility.reconcile_world_size`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pilotrun.common.errors import CheckpointError
from pilotrun.training.checkpoint import checkpointer as checkpoint_policy
from pilotrun.training.checkpoint import storages as registry
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.checkpoint.dcp_storage import DCPStorage
from pilotrun.training.checkpoint.single_file import TorchSaveStorage
from pilotrun.training.checkpoint.storages import AUTOMATIC, chosen_storage
from pilotrun.training.distributed import SINGLE_PROCESS, DistributedContext, barrier, broadcast_object


class DistributedCheckpointer(Checkpointer):
    """The Checkpointer for any world size. Writes: torch.save for one process, DCP for several (the policy
    and its marker rule run on rank 0 only; the other ranks join the collective write). Reads: with the
    storage named in the marker, so checkpoints move between world sizes. Hashes are verified on rank 0 and
    the outcome is shared, so every rank refuses a damaged checkpoint together."""

    def __init__(self, run_dir: str | Path, keep: int, context: DistributedContext = SINGLE_PROCESS, *,
                 keep_every: int = 0, keep_steps: tuple[int, ...] | list[int] = (),
                 storage: str = AUTOMATIC) -> None:
        self.context = context
        # Every registered storage, so that any checkpoint reads with the one its marker names.
        self.storages = {name: kind.build(context) for name, kind in registry.STORAGES.items()}
        writer = self.storages[chosen_storage(storage, context)]
        # _recover_interrupted_replacements (called by the base __init__) renames folders: rank 0 only.
        super().__init__(run_dir, keep, writer, keep_every=keep_every, keep_steps=keep_steps)
        barrier(context)

    @property
    def dcp_storage(self) -> DCPStorage:
        return self.storages[DCPStorage.name]

    @property
    def torch_save_storage(self) -> TorchSaveStorage:
        return self.storages[TorchSaveStorage.name]

    def _recover_interrupted_replacements(self) -> None:
        if self.context.is_main_process:
            super()._recover_interrupted_replacements()

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> Path:
        if not self.context.is_distributed:
            return super().save(step, state, meta)
        # Under several ranks the storage is collective (chosen_storage refuses any other): every rank writes.
        self.storage.write_started = self.storage.write_finished = False
        if self.context.is_main_process:
            try:
                path = super().save(step, state, meta)
            except BaseException as exc:
                # A failure inside the DCP collective already raised on every rank; any other failure must be
                # announced, or the other ranks would wait for a folder name or a commit that never comes.
                if not self.storage.write_started or self.storage.write_finished:
                    broadcast_object(self.context, ("error", f"{type(exc).__name__}: {exc}"))
                raise
            broadcast_object(self.context, ("ok", str(path)))
            return path
        self.storage.write(state, None)
        outcome = broadcast_object(self.context, None)
        if outcome[0] != "ok":
            raise CheckpointError(f"checkpoint save at step {step} failed on rank 0: {outcome[1]}")
        return Path(outcome[1])

    def verify(self, step: int) -> checkpoint_policy.CommittedCheckpoint:
        if not self.context.is_distributed:
            return super().verify(step)
        outcome: tuple[str, str] = ("ok", "")
        if self.context.is_main_process:
            try:
                super().verify(step)
            except CheckpointError as exc:
                outcome = ("error", str(exc))
        outcome = broadcast_object(self.context, outcome)
        if outcome[0] != "ok":
            raise CheckpointError(outcome[1])
        return next(c for c in self.committed() if c.step == step)

    def storage_name(self, step: int) -> str:
        """Which storage wrote the committed checkpoint at `step` (its marker says)."""
        for checkpoint in self.committed():
            if checkpoint.step == step:
                return str(checkpoint.marker.get("storage", TorchSaveStorage.name))
        raise CheckpointError(f"no committed checkpoint at step {step} in {self.root}")

    def load(self, step: int | None = None, template: dict[str, Any] | None = None
             ) -> tuple[dict[str, Any], dict[str, Any]]:
        # Rank 0 chooses the step, so that ranks never load different checkpoints from a folder that
        # changes underneath them (nor while its own prune still removes older ones).
        self.wait_for_prune()
        if step is None:
            steps = self.committed_steps() if self.context.is_main_process else []
            step = broadcast_object(self.context, steps[-1] if steps else None)
            if step is None:
                return super().load(None, template)  # raises the base class's "no committed checkpoint"
        checkpoint = self.verify(step)
        # A marker that names no storage, or one not registered, is read as torch.save wrote it.
        storage_name = checkpoint.marker.get("storage", TorchSaveStorage.name)
        storage = self.storages.get(storage_name, self.torch_save_storage)
        state = storage.read(checkpoint.path, sorted(checkpoint.marker["files"]), template)
        self.notes.extend(getattr(storage, "read_notes", []))
        return state, checkpoint.marker.get("meta", {})
