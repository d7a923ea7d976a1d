"""Atomic checkpoints: policy (which steps exist, which is newest, what to prune) apart from storage.

Layout: run_dir/checkpoints/step-00000100/ holds the storage's files and, written LAST, COMMITTED.json:
the step, every file's sha256 and size, and the caller's meta (effective recipe, data identity, ...).
A save goes:

    1. write every file into run_dir/checkpoints/.tmp-step-00000100-<pid>/, fsync each file and the folder
    2. rename the folder to step-00000100 (atomic on POSIX), fsync checkpoints/
    3. write COMMITTED.json through a temp file + fsync + rename, fsync the folder
    4. only now prune the committed checkpoints no retention tier keeps (retention.py: the newest `keep`,
       every `keep_every`-th step, protected steps)

A crash before 3 completes leaves a folder without a marker: it is never loaded (and is removed by the next
save). A committed folder whose files do not match their recorded sha256 raises CheckpointError naming the
file, so a damaged checkpoint is never restored silently; `load(step=N)` picks an earlier one.

Storage is a small interface (`write(state, folder) -> {file: (sha256, bytes)}`, `read(folder, files,
template) -> state`) so that a torch.distributed.checkpoint storage, where every rank writes its shards into
the same folder, can replace the single-process torch.save one without touching the policy here.

The single-file storage (torch.save) is single_file.py, the distributed one dcp_storage.py; storages.py
registers them by the name a marker records.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pilotrun.common.errors import CheckpointError, PilotrunError
from pilotrun.common.files import fsync_directory, open_for_write, sha256_of_file
from pilotrun.common.parsing import read_json_file
from pilotrun.common.thread_priority import yield_to_training
from pilotrun.run.marker import MARKER_NAME, marker_files_problem, marker_step_problem, step_folder_name
from pilotrun.run.record import CHECKPOINTS_DIR
from pilotrun.training.checkpoint.retention import PROTECT_USER, doomed_steps, merge_protected
from pilotrun.training.checkpoint.single_file import TorchSaveStorage

DAMAGED_KEY = "__damaged__"  # set (in memory only) on a marker that could not be read
FORMAT_VERSION = 1
STEP_FOLDER_PATTERN = re.compile(r"^step-(\d{8,})$")
TEMP_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"


class CheckpointStorage(Protocol):
    """Writes a state dict into a folder and reads it back. The policy never looks inside the files."""

    name: str

    def write(self, state: dict[str, Any], folder: Path) -> dict[str, tuple[str, int]]:
        """Write `state` into the (existing, empty) `folder`; every file durable (fsynced) on return.
        Returns {relative file name: (sha256 hex, bytes)} for every file written."""
        ...

    def read(self, folder: Path, files: list[str], template: dict[str, Any] | None = None) -> dict[str, Any]:
        """Read the state back (into `template` where the storage loads in place, as DCP does)."""
        ...




@dataclass
class CommittedCheckpoint:
    step: int
    path: Path
    marker: dict[str, Any] = field(repr=False)


class Checkpointer:
    """Policy over run_dir/checkpoints/. Single writer: under data parallelism only the process that owns the
    run folder (rank 0) saves with the torch.save storage."""

    def __init__(self, run_dir: str | Path, keep: int, storage: CheckpointStorage | None = None, *,
                 keep_every: int = 0, keep_steps: tuple[int, ...] | list[int] = ()) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS_DIR
        self.keep = keep
        self.keep_every = keep_every
        # Steps never pruned, with the reason (retention.py); the markers' own lists are added at each save.
        self.protected: dict[int, str] = {int(step): PROTECT_USER for step in keep_steps}
        self.storage = storage or TorchSaveStorage()
        self.notes: list[str] = []  # what the policy did on its own (cleanups, recoveries), for the run log
        # A background save's prune, running beside the loop (prune_in_background); joined before anything
        # else lists, writes or loads checkpoints.
        self._pruning: threading.Thread | None = None
        self._prune_failure: BaseException | None = None
        # Reading never renames or deletes anything (a reader may run beside the writing trainer); repairs of
        # interrupted saves happen in save(), in the one process that writes.

    # ------------------------------------------------------------------------------------------ reading
    def _read_marker(self, folder: Path, step: int) -> dict[str, Any] | None:
        marker_path = folder / MARKER_NAME
        if folder.is_symlink() or marker_path.is_symlink():
            # A link can point into another run: loading through it reads that run, pruning would delete it.
            link = folder if folder.is_symlink() else marker_path
            return {
                "files": {},
                DAMAGED_KEY: f"checkpoint {link} is a symbolic link; refused (checkpoints are "
                "plain folders and files inside the run)",
            }
        if not marker_path.is_file():
            return None
        # The marker is written through a temp file and a rename, so a torn marker means outside damage. It
        # still counts as a checkpoint (so that --resume does not silently fall back past it), marked damaged:
        # verify/load/meta of that step raise, and the other steps stay loadable.
        try:  # the bounded reader: a marker nested 200,000 deep is damage, named, never a RecursionError
            marker = read_json_file(marker_path, f"checkpoint marker {marker_path} is unreadable:")
        except (OSError, PilotrunError) as exc:
            return {"files": {}, DAMAGED_KEY: str(exc)}
        if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict) or "step" not in marker:
            return {"files": {}, DAMAGED_KEY: f"checkpoint marker {marker_path} lacks 'files' or 'step'"}
        # The step check is summarize's (run/marker.py): a marker whose step is Infinity, NaN or 4.0 is damage
        # here too, so --resume refuses what summarize --require-step refuses.
        problem = marker_files_problem(marker["files"]) or marker_step_problem(marker, step)
        if problem:
            return {"files": {}, DAMAGED_KEY: f"checkpoint marker {marker_path} {problem}"}
        return marker

    def _step_folders(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = STEP_FOLDER_PATTERN.match(child.name)
            if match and (child.is_dir() or child.is_symlink()):  # a link is listed, then refused as damaged
                found.append((int(match.group(1)), child))
        return sorted(found)

    def _refuse_linked_root(self) -> None:
        # run_dir/checkpoints as a link would make every save prune, and every resume load, another folder.
        if self.root.is_symlink():
            raise CheckpointError(f"{self.root} is a symbolic link; refused (checkpoints are a plain folder "
                                  "inside the run)")

    def committed(self) -> list[CommittedCheckpoint]:
        if self._pruning is not None and self._pruning is not threading.current_thread():
            self.wait_for_prune()  # never list folders a prune is removing (in this process)
        self._refuse_linked_root()
        found: dict[int, CommittedCheckpoint] = {}
        for step, folder in self._step_folders():
            marker = self._read_marker(folder, step)
            if marker is not None:
                found[step] = CommittedCheckpoint(step, folder, marker)
        # A save that replaced a step and died before committing the new copy leaves the old, committed copy
        # under .replaced-step-N: it is still that step's checkpoint (save() moves it back).
        if self.root.is_dir():
            for old in self.root.glob(f"{REPLACED_PREFIX}step-*"):
                match = STEP_FOLDER_PATTERN.match(old.name[len(REPLACED_PREFIX):])
                if match and int(match.group(1)) not in found:
                    marker = self._read_marker(old, int(match.group(1)))
                    if marker is not None:
                        found[int(match.group(1))] = CommittedCheckpoint(int(match.group(1)), old, marker)
        return [found[step] for step in sorted(found)]

    def committed_steps(self) -> list[int]:
        """Steps of every committed checkpoint, ascending (markers are read; file hashes are checked by
        load)."""
        return [c.step for c in self.committed()]

    def uncommitted_folders(self) -> list[Path]:
        """Folders left by interrupted saves: temp folders and step folders without a marker. Never loaded."""
        if not self.root.is_dir():
            return []
        leftovers = [p for p in self.root.iterdir() if p.name.startswith(TEMP_PREFIX) and not p.is_symlink()]
        leftovers += [folder for _, folder in self._step_folders()
                      if not folder.is_symlink() and not (folder / MARKER_NAME).is_file()]
        return sorted(leftovers)

    def verify(self, step: int) -> CommittedCheckpoint:
        """The committed checkpoint at `step` with every listed file rehashed; CheckpointError names a bad
        one."""
        by_step = {c.step: c for c in self.committed()}
        if step not in by_step:
            available = ", ".join(str(s) for s in sorted(by_step)) or "none"
            raise CheckpointError(
                f"no committed checkpoint at step {step} in {self.root} (committed: {available})"
            )
        checkpoint = by_step[step]
        earlier = [s for s in sorted(by_step) if s < step]
        hint = f"; resume from an earlier one with --from-step {earlier[-1]}" if earlier else ""
        if DAMAGED_KEY in checkpoint.marker:
            raise CheckpointError(checkpoint.marker[DAMAGED_KEY] + hint)
        files = checkpoint.marker["files"]
        for file_name, entry in files.items():
            path = checkpoint.path / file_name
            if path.is_symlink():
                raise CheckpointError(f"checkpoint file {path} is a symbolic link; refused{hint}")
            if not path.is_file():
                raise CheckpointError(f"checkpoint file {path} is missing{hint}")
            size = path.stat().st_size
            if size != entry["bytes"]:
                raise CheckpointError(f"checkpoint file {path} has {size} bytes, its marker records "
                                      f"{entry['bytes']}: the file is damaged{hint}")
        # Rehash the files concurrently (hashlib releases the GIL): resume time is bound by sha256, not the
        # disk.
        names = sorted(files, key=lambda name: -files[name]["bytes"])
        workers = max(1, min(8, os.cpu_count() or 1, len(names)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            digests = dict(zip(names, pool.map(lambda name: sha256_of_file(checkpoint.path / name), names)))
        for file_name in sorted(files):
            if digests[file_name] != files[file_name]["sha256"]:
                raise CheckpointError(
                    f"checkpoint file {checkpoint.path / file_name} does not match its recorded "
                    f"sha256: the file is damaged{hint}"
                )
        return checkpoint

    def load(self, step: int | None = None, template: dict[str, Any] | None = None
             ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(state, meta) of the committed checkpoint at `step` (default: the newest), files verified first."""
        self.wait_for_prune()
        if step is None:
            steps = self.committed_steps()
            if not steps:
                leftovers = self.uncommitted_folders()
                extra = (f" ({len(leftovers)} uncommitted folder(s) from interrupted saves are ignored)"
                         if leftovers else "")
                raise CheckpointError(f"no committed checkpoint in {self.root}{extra}")
            step = steps[-1]
        checkpoint = self.verify(step)
        state = self.storage.read(checkpoint.path, sorted(checkpoint.marker["files"]), template)
        return state, checkpoint.marker.get("meta", {})

    def meta(self, step: int) -> dict[str, Any]:
        """The meta recorded with a committed checkpoint, without reading its tensors."""
        for checkpoint in self.committed():
            if checkpoint.step == step:
                if DAMAGED_KEY in checkpoint.marker:
                    return self.verify(step).marker  # raises, naming the marker and an earlier step
                return checkpoint.marker.get("meta", {})
        raise CheckpointError(f"no committed checkpoint at step {step} in {self.root}")

    # ------------------------------------------------------------------------------------------ writing
    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write, fsync, rename, commit with the marker, then prune. Returns the committed folder."""
        temp, meta_json = self.begin_save(step, meta)
        try:
            files = self.storage.write(state, temp)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        return self.commit_written(step, temp, files, meta_json, self.storage.name)

    def begin_save(self, step: int, meta: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
        """A save's first part: checks, repairs of interrupted saves, and the fresh temp folder the files go
        into; returns it with the meta as JSON. (A background save writes between this and commit_written.)"""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.wait_for_prune()
        try:
            meta_json = json.loads(json.dumps(meta, allow_nan=True))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"checkpoint meta must be JSON-serialisable: {exc}") from None
        self._refuse_linked_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self._recover_interrupted_replacements()
        self._remove_uncommitted()
        temp = self.root / f"{TEMP_PREFIX}{step_folder_name(step)}-{os.getpid()}"
        temp.mkdir()
        return temp, meta_json

    def commit_written(
        self,
        step: int,
        temp: Path,
        files: dict[str, tuple[str, int]],
        meta_json: dict[str, Any],
        storage_name: str,
        prune: bool = True,
    ) -> Path:
        """A save's last part, once every file in `temp` is durable and hashed: rename, marker, prune (unless
        `prune` is False: the caller prunes later, with prune_in_background)."""
        final = self.root / step_folder_name(step)
        replaced = None
        if final.exists():
            # The same step saved again (e.g. a resume that ends where it started): move the old one aside
            # first; _recover_interrupted_replacements puts it back if we die before the new marker lands.
            replaced = self.root / f"{REPLACED_PREFIX}{final.name}"
            if replaced.exists():
                shutil.rmtree(replaced)
            os.rename(final, replaced)
        os.rename(temp, final)
        fsync_directory(self.root)
        self._commit(
            final,
            {
                "format": FORMAT_VERSION,
                "step": step,
                "storage": storage_name,
                "files": {
                    name: {"sha256": digest, "bytes": size} for name, (digest, size) in sorted(files.items())
                },
                "committed_at": time.time(),
                "run_id": meta_json.get("run_id"),  # whose checkpoint this is: a resume refuses another run's
                "meta": meta_json,
                "protected": {str(s): reason for s, reason in sorted(self.all_protected().items())},
            },
        )
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        if prune:
            self._prune(step)
        return final

    def prune_in_background(self, newest_step: int) -> None:
        """The prune after a commit, in a thread of its own, so that the loop does not wait for the removal
        of older checkpoints (gigabytes each): it runs while the loop trains, and the next save or load waits
        for it first (wait_for_prune). A crash halfway leaves what _prune leaves: markers go first."""
        self.wait_for_prune()

        def prune() -> None:
            yield_to_training()  # its own thread: the removal takes the CPU the training leaves
            try:
                self._prune(newest_step)
            except BaseException as exc:  # raised where the loop next waits for it
                self._prune_failure = exc

        self._pruning = threading.Thread(target=prune, name=f"pilotrun-prune-{newest_step}")
        self._pruning.start()

    def wait_for_prune(self) -> None:
        """Join the prune running beside the loop (if any); its failure is raised here."""
        pruning, self._pruning = self._pruning, None
        if pruning is not None:
            pruning.join()
        failure, self._prune_failure = self._prune_failure, None
        if failure is not None:
            raise failure

    def protect(self, step: int, reason: str) -> None:
        """Never prune the checkpoint at `step` (recorded in every later marker, so later sessions keep it
        too)."""
        self.protected.setdefault(step, reason)

    def all_protected(self) -> dict[int, str]:
        """This checkpointer's protected steps and every committed marker's, {step: reason}."""
        protected = dict(self.protected)
        for checkpoint in self.committed():
            merge_protected(protected, checkpoint.marker.get("protected"))
        return protected

    def _commit(self, folder: Path, marker: dict[str, Any]) -> None:
        """Write the marker into the renamed step folder, last: from here on the checkpoint is loadable."""
        marker_temp = folder / f"{MARKER_NAME}.tmp"
        with open_for_write(marker_temp, "w") as handle:
            json.dump(marker, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.rename(marker_temp, folder / MARKER_NAME)
        fsync_directory(folder)

    def _remove_uncommitted(self) -> None:
        for folder in self.uncommitted_folders():
            shutil.rmtree(folder, ignore_errors=True)
            self.notes.append(f"removed uncommitted checkpoint folder {folder.name} (an interrupted save)")

    def _recover_interrupted_replacements(self) -> None:
        if not self.root.is_dir():
            return
        for old in sorted(self.root.glob(f"{REPLACED_PREFIX}step-*")):
            final = self.root / old.name[len(REPLACED_PREFIX):]
            if old.is_symlink() or final.is_symlink():
                continue  # never rename or delete through a link; loading refuses it by name
            if (final / MARKER_NAME).is_file():
                shutil.rmtree(old, ignore_errors=True)  # the replacement was committed; the old copy is stale
            elif (old / MARKER_NAME).is_file():
                if final.exists():
                    shutil.rmtree(final)
                os.rename(old, final)
                fsync_directory(self.root)
                self.notes.append(f"restored {final.name}: a save replacing it was interrupted before commit")

    def check_later_removable(self, step: int) -> None:
        """Before a session resumed from `step` trains: every committed checkpoint after it (an abandoned
        timeline, removed at the first save, or moved aside when that very step is saved again) must be
        movable and its marker removable; else CheckpointError now, not after the updates were trained into a
        temporary folder that can never be committed. Probed by moving each aside and back, as a save
        replacing it does (a crash in between is put right by _recover_interrupted_replacements)."""
        for checkpoint in self.committed():
            if checkpoint.step <= step or checkpoint.path.is_symlink():
                continue
            aside = self.root / f"{REPLACED_PREFIX}{checkpoint.path.name}"
            marker, probe = checkpoint.path / MARKER_NAME, checkpoint.path / f"{MARKER_NAME}.probe"
            try:
                os.rename(checkpoint.path, aside)
                os.rename(aside, checkpoint.path)
                os.rename(marker, probe)
                os.rename(probe, marker)
            except OSError as exc:
                raise CheckpointError(
                    f"{checkpoint.path}: a checkpoint after the resumed step {step} cannot be "
                    f"moved aside or removed ({exc.strerror or exc}); make it writable (or move it "
                    f"away) before resuming from step {step}"
                ) from None

    def _prune(self, newest_step: int) -> None:
        """Remove what no retention tier keeps (retention.py), and every checkpoint *after* `newest_step`:
        those belong to a timeline abandoned by a resume from an earlier step (--from-step), and left in place
        they would be picked as "newest" by the next --resume."""
        committed = self.committed()
        doomed_at = set(doomed_steps([c.step for c in committed], newest_step, self.keep, self.keep_every,
                                     self.all_protected()))
        for checkpoint in (c for c in committed if c.step in doomed_at):
            if checkpoint.path.is_symlink():
                # Deleting through a link would delete another run's checkpoint; leave it, loading refuses it.
                self.notes.append(f"left {checkpoint.path.name} in place: a symbolic link is never pruned")
                continue
            # Remove the marker first: a crash halfway through the rmtree leaves an uncommitted folder,
            # never a committed one with files missing.
            (checkpoint.path / MARKER_NAME).unlink(missing_ok=True)
            fsync_directory(checkpoint.path)
            shutil.rmtree(checkpoint.path, ignore_errors=True)
            if checkpoint.step > newest_step:
                self.notes.append(f"removed {checkpoint.path.name}: later than the resumed timeline's "
                                  f"step {newest_step}")
