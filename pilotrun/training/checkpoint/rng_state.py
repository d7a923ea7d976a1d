"""Every random number generator a training step can draw from, captured and restored exactly.

Exact continuation (a resumed run equals one that never stopped) needs the *next* draw after a resume to equal
the next draw of a run that never stopped, for every generator: Python's `random`, NumPy's global generator,
torch's CPU generator and each CUDA device's generator. `capture_rng_state()` returns them as a state dict
made only of tensors, ints, floats, strings and None: what `torch.load(weights_only=True)` accepts and what
torch.distributed.checkpoint can store, so the same dict travels through either storage.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from pilotrun.common.errors import CheckpointError


def _python_state() -> dict[str, Any]:
    # random.getstate() = (version, tuple of 625 ints (624 words + position), gauss_next)
    version, internal, gauss_next = random.getstate()
    return {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next}


def _numpy_state() -> dict[str, Any]:
    # The legacy global generator (np.random.*); Generator objects owned by other code travel in their owners.
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "kind": str(kind),
        "key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def capture_rng_state() -> dict[str, Any]:
    """The state of every global generator, as plain tensors and numbers (a copy, safe to keep)."""
    state: dict[str, Any] = {
        "python": _python_state(),
        "numpy": _numpy_state(),
        "torch_cpu": torch.get_rng_state().clone(),
        "cuda": [],
    }
    # Only when CUDA is already in use: querying it otherwise would initialise a context as a side effect.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> list[str]:
    """Set every generator from `capture_rng_state()`'s dict. Returns notes on what could not be restored
    exactly (e.g. a different number of CUDA devices), so the caller can record them; a malformed state
    raises CheckpointError naming the part."""
    notes: list[str] = []
    for part in ("python", "numpy", "torch_cpu"):
        if part not in state:
            raise CheckpointError(f"checkpoint RNG state lacks the '{part}' generator")
    try:
        py = state["python"]
        internal = tuple(int(v) for v in py["internal"].tolist())
        random.setstate((int(py["version"]), internal, py["gauss_next"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint RNG state 'python' is malformed: {exc}") from None
    try:
        npst = state["numpy"]
        key = npst["key"].numpy().astype(np.uint32)
        np.random.set_state((npst["kind"], key, int(npst["pos"]), int(npst["has_gauss"]),
                             float(npst["cached_gaussian"])))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint RNG state 'numpy' is malformed: {exc}") from None
    cpu = state["torch_cpu"]
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8:
        raise CheckpointError("checkpoint RNG state 'torch_cpu' is not a uint8 tensor")
    torch.set_rng_state(cpu.clone())

    saved_cuda = list(state.get("cuda") or [])
    if saved_cuda:
        if not torch.cuda.is_available():
            notes.append(f"checkpoint holds RNG states for {len(saved_cuda)} CUDA device(s) but CUDA is not "
                         "available; they were not restored")
        else:
            count = torch.cuda.device_count()
            if count != len(saved_cuda):
                notes.append(
                    f"checkpoint holds RNG states for {len(saved_cuda)} CUDA device(s), this machine has "
                    f"{count}; restored the first {min(count, len(saved_cuda))}"
                )
            for index in range(min(count, len(saved_cuda))):
                torch.cuda.set_rng_state(saved_cuda[index].clone(), device=index)
    return notes


def seed_every_generator(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (CPU and every CUDA device) from the recipe's seed, so
    that two fresh runs start from the same RNG state, and a resumed run (which restores the checkpoint's)
    draws exactly what a run that never stopped draws."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
