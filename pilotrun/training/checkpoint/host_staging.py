"""The copy a background save waits for: every tensor of the state into host buffers kept for the session.

DCP's own stager copies with `Tensor.copy_`, which splits a large copy over the loop's intra-op threads; on a
loaded machine the copy then waits for the slowest of them (a thread the kernel has descheduled), and the loop
blocks many times longer than the copy itself takes. Here a CPU tensor is copied by one plain memcpy
(`ctypes.memmove`, which releases the GIL) into a buffer allocated at the first save and reused at every
later one, so the loop waits for the memory bandwidth of one core, however busy the others are. A tensor on
an accelerator is copied with `copy_` into a pinned host buffer (the device's own copy engine does the work).

Every other value (counters, RNG positions, lists) is deep-copied, so that nothing the loop changes after the
call reaches the write. A state holding tensor subclasses (DTensor shards) is not staged here: `stages(state)`
says so, and the caller keeps DCP's stager for it.

The copy need not all happen while the loop waits. The parameters and the optimizer's state change only when
the optimizer steps; the next update's forward and backward only read them. `stage_deferring` takes the
storages that stay unchanged until then (`stable`), copies every other tensor and value at once, and leaves
the stable ones to a staging thread (`copy_later`; memmove releases the GIL), returning a Future of the staged
state that DCP's write thread waits on. The caller then holds the next optimizer step until that Future is
done (callbacks/checkpointing.py), so the loop waits only for what the copy has not finished by then.
"""

from __future__ import annotations

import copy
import ctypes
import threading
from collections.abc import Collection
from concurrent.futures import Future
from typing import Any

import torch


def stages(state: Any) -> bool:
    """True when every tensor in `state` is a plain torch.Tensor (what this stager copies)."""
    if isinstance(state, torch.Tensor):
        return type(state) is torch.Tensor or type(state) is torch.nn.Parameter
    if isinstance(state, dict):
        return all(stages(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return all(stages(value) for value in state)
    return True


class HostCopyStager:
    """An `AsyncStager` for dcp.async_save: `stage` returns the staged copy before it returns (nothing to
    synchronize afterwards). Reusing the buffers is safe because at most one background save is in flight:
    the previous write has finished before the next save stages."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self._copy(state_dict, (), frozenset(), [])

    def stage_deferring(self, state_dict: dict[str, Any], stable: Collection[int]) -> Any:
        """Copy every tensor whose storage (`untyped_storage().data_ptr()`) is not in `stable`, and every
        other value, before returning; the rest in a staging thread. Returns the staged state when nothing
        was left for the thread, else a Future of it, done once every copy is."""
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = self._copy(state_dict, (), stable, later)
        if not later:
            return staged
        future: Future = Future()
        threading.Thread(target=copy_later, args=(later, staged, future), name="pilotrun-staging",
                         daemon=True).start()
        return future

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` copied everything before it returned."""

    def close(self) -> None:
        self._buffers.clear()

    def _copy(self, value: Any, where: tuple[Any, ...], stable: Collection[int], later: list) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value.detach(), where, stable, later)
        if isinstance(value, dict):
            return {key: self._copy(item, (*where, key), stable, later) for key, item in value.items()}
        if isinstance(value, list):
            return [self._copy(item, (*where, index), stable, later) for index, item in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self._copy(item, (*where, index), stable, later) for index, item in enumerate(value))
        return copy.deepcopy(value)

    def _copy_tensor(self, source: torch.Tensor, where: tuple[Any, ...], stable: Collection[int],
                     later: list) -> torch.Tensor:
        buffer = self._buffers.get(where)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            pinned = source.device.type == "cuda"
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pinned)
            self._buffers[where] = buffer
        if source.numel() and source.untyped_storage().data_ptr() in stable:
            later.append((buffer, source))
        else:
            copy_bytes(buffer, source)
        return buffer


def copy_bytes(buffer: torch.Tensor, source: torch.Tensor) -> None:
    """One tensor into its host buffer: a plain memcpy for a contiguous CPU tensor, else `copy_`."""
    if source.device.type == "cpu" and source.is_contiguous():
        nbytes = source.numel() * source.element_size()
        if nbytes:
            ctypes.memmove(buffer.data_ptr(), source.data_ptr(), nbytes)
    else:
        buffer.copy_(source)


def copy_later(pairs: list[tuple[torch.Tensor, torch.Tensor]], staged: dict[str, Any],
               future: Future) -> None:
    """The staging thread: the deferred copies, then `future` holds the staged state (or the copy's failure,
    which DCP's write thread then raises as the save's)."""
    try:
        for buffer, source in pairs:
            copy_bytes(buffer, source)
    except BaseException as exc:
        future.set_exception(exc)
        return
    future.set_result(staged)
