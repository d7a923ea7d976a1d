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
"""

from __future__ import annotations

import copy
import ctypes
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
        return self._copy(state_dict, ())

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` copied everything before it returned."""

    def close(self) -> None:
        self._buffers.clear()

    def _copy(self, value: Any, where: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value.detach(), where)
        if isinstance(value, dict):
            return {key: self._copy(item, (*where, key)) for key, item in value.items()}
        if isinstance(value, list):
            return [self._copy(item, (*where, index)) for index, item in enumerate(value)]
        if isinstance(value, tuple):
            return tuple(self._copy(item, (*where, index)) for index, item in enumerate(value))
        return copy.deepcopy(value)

    def _copy_tensor(self, source: torch.Tensor, where: tuple[Any, ...]) -> torch.Tensor:
        buffer = self._buffers.get(where)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            pinned = source.device.type == "cuda"
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pinned)
            self._buffers[where] = buffer
        if source.device.type == "cpu" and source.is_contiguous():
            nbytes = source.numel() * source.element_size()
            if nbytes:
                ctypes.memmove(buffer.data_ptr(), source.data_ptr(), nbytes)
        else:
            buffer.copy_(source)
        return buffer
