"""Atomic checkpoints: policy (which steps exist, which is newest, what to prune) apart from storage.

Layout: run_dir/checkpoints/step-00000100/ holds the storage's files and, written LAST, COMMITTED.json:
the step, every file's sha256 and size, and the caller's meta (effective recipe, data identity, ...).
A save goes:

    1. write every file into run_dir/checkpoints/.tmp-step-00000100-<pid>/, fsync each file and the folder
    2. rename the folder to step-00000100 (atomic on POSIX), fsync checkpoints/
    3. write COMMITTED.json through a temp file + fsync + rename, fsync the folder
    4. only now prune older committed checkpoints beyond `keep`

A crash before 3 completes leaves a folder without a marker: it is never loaded (and is removed by the next
save). A committed folder whose files do not match their recorded sha256 raises CheckpointError naming the
file, so a damaged checkpoint is never restored silently; `load(step=N)` picks an earlier one.

Storage is a small interface (`write(state, folder) -> {file: (sha256, bytes)}`, `read(folder, files,
template) -> state`) so that a torch.distributed.checkpoint storage, where every rank writes its shards into
the same folder, can replace the single-process torch.save one without touching the policy here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from pilotrun.errors import CheckpointError
from pilotrun.train.compat import ResumeCompatibility, check_resume_compatibility

__all__ = ["Checkpointer", "CheckpointStorage", "TorchSaveStorage", "ResumeCompatibility",
           "check_resume_compatibility", "step_folder_name", "MARKER_NAME"]

MARKER_NAME = "COMMITTED.json"
FORMAT_VERSION = 1
STEP_FOLDER_PATTERN = re.compile(r"^step-(\d{8,})$")
TEMP_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"
# Test-only hooks: seconds to sleep after each file is written / after the rename, before the marker, so that
# a test can SIGKILL a process inside a checkpoint write deterministically. Unset in normal use.
WRITE_DELAY_ENV = "PILOTRUN_TEST_CHECKPOINT_WRITE_DELAY_S"
COMMIT_DELAY_ENV = "PILOTRUN_TEST_CHECKPOINT_COMMIT_DELAY_S"
HASH_CHUNK_BYTES = 8 << 20


def step_folder_name(step: int) -> str:
    return f"step-{step:08d}"


def fsync_directory(path: Path) -> None:
    """Make a rename or a new file inside `path` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _test_delay(variable: str = WRITE_DELAY_ENV) -> None:
    delay = os.environ.get(variable)
    if delay:
        time.sleep(float(delay))


class _HashingWriter:
    """A file wrapper that hashes bytes as they are written, so the sha256 costs no second read.
    torch.save's zip writer writes strictly sequentially (checked by the tests against a reread)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.bytes_written = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.digest.update(view)
        self.bytes_written += view.nbytes
        return self.handle.write(view)

    def flush(self) -> None:
        self.handle.flush()


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


class TorchSaveStorage:
    """Single process: one torch.save file per top-level key (model.pt, optimizer.pt, ...), so that a damaged
    file is named by what it holds. Loaded with weights_only=True: a checkpoint is tensors, numbers, strings,
    lists and dicts, nothing that runs code when read."""

    name = "torch_save"

    def write(self, state: dict[str, Any], folder: Path) -> dict[str, tuple[str, int]]:
        written: dict[str, tuple[str, int]] = {}
        for key, value in state.items():
            if not re.fullmatch(r"[A-Za-z0-9_]+", key):
                raise ValueError(f"checkpoint state key '{key}' must be a plain identifier (it names a file)")
            file_name = f"{key}.pt"
            with open(folder / file_name, "wb") as handle:
                writer = _HashingWriter(handle)
                torch.save(value, writer)
                handle.flush()
                os.fsync(handle.fileno())
            written[file_name] = (writer.digest.hexdigest(), writer.bytes_written)
            _test_delay()
        fsync_directory(folder)
        return written

    def read(self, folder: Path, files: list[str], template: dict[str, Any] | None = None) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for file_name in files:
            if not file_name.endswith(".pt"):
                continue
            try:
                state[file_name[:-3]] = torch.load(folder / file_name, map_location="cpu", weights_only=True)
            except Exception as exc:  # a file that passed its hash but cannot be unpickled: say which
                raise CheckpointError(f"checkpoint file {folder / file_name} cannot be read: {exc}") from None
        return state


@dataclass
class CommittedCheckpoint:
    step: int
    path: Path
    marker: dict[str, Any] = field(repr=False)


class Checkpointer:
    """Policy over run_dir/checkpoints/. Single writer: under data parallelism only the process that owns the
    run folder (rank 0) saves with the torch.save storage."""

    def __init__(self, run_dir: str | Path, keep: int, storage: CheckpointStorage | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "checkpoints"
        self.keep = keep
        self.storage = storage or TorchSaveStorage()
        self.notes: list[str] = []  # what the policy did on its own (cleanups, recoveries), for the run log
        self._recover_interrupted_replacements()

    # ------------------------------------------------------------------------------------------ reading
    def _read_marker(self, folder: Path) -> dict[str, Any] | None:
        marker_path = folder / MARKER_NAME
        if not marker_path.is_file():
            return None
        try:
            marker = json.loads(marker_path.read_text())
        except (OSError, ValueError) as exc:
            # The marker is written through a temp file and a rename, so a torn marker means outside damage.
            raise CheckpointError(f"checkpoint marker {marker_path} is unreadable: {exc}") from None
        if not isinstance(marker, dict) or "files" not in marker or "step" not in marker:
            raise CheckpointError(f"checkpoint marker {marker_path} lacks 'files' or 'step'")
        return marker

    def _step_folders(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = STEP_FOLDER_PATTERN.match(child.name)
            if match and child.is_dir():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def committed(self) -> list[CommittedCheckpoint]:
        out = []
        for step, folder in self._step_folders():
            marker = self._read_marker(folder)
            if marker is not None:
                out.append(CommittedCheckpoint(step, folder, marker))
        return out

    def committed_steps(self) -> list[int]:
        """Steps of every committed checkpoint, ascending (markers are read; file hashes are checked by load)."""
        return [c.step for c in self.committed()]

    def uncommitted_folders(self) -> list[Path]:
        """Folders left by interrupted saves: temp folders and step folders without a marker. Never loaded."""
        if not self.root.is_dir():
            return []
        leftovers = [p for p in self.root.iterdir() if p.name.startswith(TEMP_PREFIX)]
        leftovers += [folder for _, folder in self._step_folders() if not (folder / MARKER_NAME).is_file()]
        return sorted(leftovers)

    def verify(self, step: int) -> CommittedCheckpoint:
        """The committed checkpoint at `step` with every listed file rehashed; CheckpointError names a bad one."""
        by_step = {c.step: c for c in self.committed()}
        if step not in by_step:
            available = ", ".join(str(s) for s in sorted(by_step)) or "none"
            raise CheckpointError(f"no committed checkpoint at step {step} in {self.root} (committed: {available})")
        checkpoint = by_step[step]
        earlier = [s for s in sorted(by_step) if s < step]
        hint = f"; resume from an earlier one with --from-step {earlier[-1]}" if earlier else ""
        for file_name, entry in checkpoint.marker["files"].items():
            path = checkpoint.path / file_name
            if not path.is_file():
                raise CheckpointError(f"checkpoint file {path} is missing{hint}")
            size = path.stat().st_size
            if size != entry["bytes"]:
                raise CheckpointError(f"checkpoint file {path} has {size} bytes, its marker records "
                                      f"{entry['bytes']}: the file is damaged{hint}")
            if sha256_of_file(path) != entry["sha256"]:
                raise CheckpointError(f"checkpoint file {path} does not match its recorded sha256: "
                                      f"the file is damaged{hint}")
        return checkpoint

    def load(self, step: int | None = None, template: dict[str, Any] | None = None
             ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(state, meta) of the committed checkpoint at `step` (default: the newest), files verified first."""
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
                return checkpoint.marker.get("meta", {})
        raise CheckpointError(f"no committed checkpoint at step {step} in {self.root}")

    # ------------------------------------------------------------------------------------------ writing
    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write, fsync, rename, commit with the marker, then prune. Returns the committed folder."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        try:
            meta_json = json.loads(json.dumps(meta, allow_nan=True))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"checkpoint meta must be JSON-serialisable: {exc}") from None
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_uncommitted()
        final = self.root / step_folder_name(step)
        temp = self.root / f"{TEMP_PREFIX}{step_folder_name(step)}-{os.getpid()}"
        temp.mkdir()
        try:
            files = self.storage.write(state, temp)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
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
        _test_delay(COMMIT_DELAY_ENV)
        marker = {
            "format": FORMAT_VERSION,
            "step": step,
            "storage": self.storage.name,
            "files": {name: {"sha256": digest, "bytes": size} for name, (digest, size) in sorted(files.items())},
            "committed_at": time.time(),
            "meta": meta_json,
        }
        marker_temp = final / f"{MARKER_NAME}.tmp"
        with open(marker_temp, "w") as handle:
            json.dump(marker, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.rename(marker_temp, final / MARKER_NAME)
        fsync_directory(final)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        self._prune(step)
        return final

    def _remove_uncommitted(self) -> None:
        for folder in self.uncommitted_folders():
            shutil.rmtree(folder, ignore_errors=True)
            self.notes.append(f"removed uncommitted checkpoint folder {folder.name} (an interrupted save)")

    def _recover_interrupted_replacements(self) -> None:
        if not self.root.is_dir():
            return
        for old in sorted(self.root.glob(f"{REPLACED_PREFIX}step-*")):
            final = self.root / old.name[len(REPLACED_PREFIX):]
            if (final / MARKER_NAME).is_file():
                shutil.rmtree(old, ignore_errors=True)  # the replacement was committed; the old copy is stale
            elif (old / MARKER_NAME).is_file():
                if final.exists():
                    shutil.rmtree(final)
                os.rename(old, final)
                fsync_directory(self.root)
                self.notes.append(f"restored {final.name}: a save replacing it was interrupted before commit")

    def _prune(self, newest_step: int) -> None:
        """Keep the `keep` newest committed checkpoints up to `newest_step`. Checkpoints *after* it belong to
        a timeline abandoned by a resume from an earlier step (--from-step): left in place they would be
        picked as "newest" by the next --resume, so they are removed."""
        committed = self.committed()
        later = [c for c in committed if c.step > newest_step]
        current = [c for c in committed if c.step <= newest_step]
        doomed = later + current[: max(0, len(current) - self.keep)]
        for checkpoint in doomed:
            # Remove the marker first: a crash halfway through the rmtree leaves an uncommitted folder,
            # never a committed one with files missing.
            (checkpoint.path / MARKER_NAME).unlink(missing_ok=True)
            fsync_directory(checkpoint.path)
            shutil.rmtree(checkpoint.path, ignore_errors=True)
            if checkpoint.step > newest_step:
                self.notes.append(f"removed {checkpoint.path.name}: later than the resumed timeline's "
                                  f"step {newest_step}")
