"""Activation checkpointing of the decoder blocks, with the per-step statistics counted exactly once.

`model.activation_checkpointing: true` keeps only each block's input for backward and runs the block's forward
again inside backward (torch.utils.checkpoint, non-reentrant): activation memory falls from every block's
intermediates to one block's, for about one extra forward of compute. The recomputed forward must not count
again (the bias update and the diagnostics would see doubled expert counts): the MoE expert counts and
router sums, and the attention max-logit tracker, are recorded only in the original forward. `recomputing()`
says which one is running; torch's checkpoint enters `recompute_context`'s second context around every
recomputation.

A process-wide depth, not a thread-local flag: on CUDA the autograd engine runs backward (and so the
recomputation) on its own device thread. Forward and backward never overlap in the trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import checkpoint

_recompute_depth = 0


def recomputing() -> bool:
    """True while torch's checkpoint is recomputing a block's forward for backward."""
    return _recompute_depth > 0


@contextlib.contextmanager
def _inside_recomputation() -> Iterator[None]:
    global _recompute_depth
    _recompute_depth += 1
    try:
        yield
    finally:
        _recompute_depth -= 1


def recompute_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """checkpoint's context_fn: nothing around the original forward, the flag around the recomputation."""
    return contextlib.nullcontext(), _inside_recomputation()


def checkpointed_call(module: torch.nn.Module, *args: torch.Tensor):
    """module(*args) with its intermediates recomputed in backward instead of saved."""
    return checkpoint(module, *args, use_reentrant=False, context_fn=recompute_context)
