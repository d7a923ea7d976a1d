"""Reading a torch.distributed.checkpoint folder without ever executing code stored in it.

DCP's own FileSystemReader reads `.metadata` with plain `pickle.load`, and its DefaultLoadPlanner reads every
non-tensor entry with `torch.load(weights_only=False)`: a checkpoint folder someone else wrote (or damaged on
purpose) could run arbitrary code on `--resume`, even when its marker's hashes are right (whoever crafts the
folder also writes the marker). Here both paths are closed:

- `SafeFileSystemReader.read_metadata` unpickles `.metadata` with `RestrictedMetadataUnpickler`, which admits
  only DCP's metadata dataclasses and the few plain types they are made of (torch.Size, dtypes, layouts,
  paths); any other global refuses the checkpoint with CheckpointError.
- `SafeLoadPlanner` / `SafeEmptyStateDictLoadPlanner` read non-tensor entries with `torch.load(weights_only=
  True)` (tensors, numbers, strings, containers only), the same rule the torch.save storage follows.

Every DCP read in pilotrun goes through `safe_dcp_load` or `read_dcp_metadata`, single-process and torchrun
alike.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from pilotrun.common.errors import CheckpointError

# (module, name) pairs a DCP `.metadata` pickle may name. Each is a data holder or a pure constructor of one:
# building it from attacker-chosen arguments allocates an object and does nothing else.
ALLOWED_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
})


class RestrictedMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any class or function outside ALLOWED_METADATA_GLOBALS is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in ALLOWED_METADATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"names {module}.{name}, which is not part of checkpoint metadata")


def unpickle_dcp_metadata(data: bytes, where: Path) -> Metadata:
    """The Metadata object of a `.metadata` file's bytes, or CheckpointError naming the file and the
    reason."""
    try:
        metadata = RestrictedMetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # UnpicklingError, EOFError, TypeError from a damaged stream: all mean "refuse"
        raise CheckpointError(f"checkpoint metadata {where} refused: {exc}".splitlines()[0]) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint metadata {where} refused: it holds a {type(metadata).__name__}, "
                              "not torch.distributed.checkpoint Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is read by the restricted unpickler (see the module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        if path.is_symlink():
            raise CheckpointError(f"checkpoint metadata {path} is a symbolic link; refused")
        try:
            with self.fs.create_stream(path, "rb") as handle:
                data = handle.read()
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint metadata {path} cannot be read: {exc.strerror or exc}"
            ) from None
        metadata = unpickle_dcp_metadata(data, path)
        for info in (metadata.storage_data or {}).values():
            # DCP opens each item's file by this name: confine it to the step folder like the marker's names.
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name:
                raise CheckpointError(f"checkpoint metadata {path} refused: it names the data file {name!r}, "
                                      "not a plain file name inside the step folder")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_bytes_weights_only(read_item: ReadItem, value: io.BytesIO) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except Exception:  # weights_only refuses any global beyond tensors and plain values; torch's text is long
        raise CheckpointError(
            f"checkpoint entry '{read_item.dest_index.fqn}' refused: it is not made of tensors "
            "and plain values only (a weights-only load failed)"
        ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor entries with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _store_loaded_bytes(self, read_item, _load_bytes_weights_only(read_item, value))


class SafeEmptyStateDictLoadPlanner(_EmptyStateDictLoadPlanner):
    """The planner that rebuilds a state dict from the metadata alone, with weights_only=True for bytes."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _store_loaded_bytes(self, read_item, _load_bytes_weights_only(read_item, value))


def _store_loaded_bytes(planner: DefaultLoadPlanner, read_item: ReadItem, loaded: Any) -> None:
    # The same placement as DefaultLoadPlanner.load_bytes, only the unpickling differs.
    from torch.distributed.checkpoint._traverse import set_element

    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


def read_dcp_metadata(folder: Path) -> Metadata:
    return SafeFileSystemReader(folder).read_metadata()


def safe_dcp_load(folder: Path, template: dict[str, Any] | None, no_dist: bool) -> dict[str, Any]:
    """Load a DCP folder into `template` in place (returned), or without one, everything it holds as plain
    tensors and values (the single-process form of DCP's _load_state_dict_from_keys)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeFileSystemReader(folder)
    try:
        if template is None:
            state: dict[str, Any] = {}
            _load_state_dict(state, storage_reader=reader, planner=SafeEmptyStateDictLoadPlanner(),
                             no_dist=not (dist.is_available() and dist.is_initialized()))
            return state
        dcp.load(template, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
        return template
    except CheckpointException as wrapped:  # a BaseException: unwrap the first rank's cause into one line
        causes = [
            failure[0] if isinstance(failure, tuple) else failure for failure in wrapped.failures.values()
        ]
        for cause in causes:
            if isinstance(cause, CheckpointError):
                raise CheckpointError(str(cause)) from None
        cause = causes[0] if causes else wrapped
        text = str(cause).strip()
        raise CheckpointError(f"checkpoint {folder} cannot be read with torch.distributed.checkpoint: "
                              f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}") from None
