"""Before the first update: what would otherwise be found only at the first checkpoint, after
`checkpoint_every` updates of work that could not be saved.

- every name the session writes inside the run folder (run.json, metrics.jsonl, checkpoints/, report/,
  profile/, tensorboard/) is not a symbolic link: pilotrun never writes through one, and a link found at the
  first profile or report would end a session that had already trained;
- the run folder and checkpoints/ take a write: a probe file is created, fsynced and removed in each (a
  read-only mount, a full quota, a folder of another user show here, named);
- the disk under checkpoints/ has room for one checkpoint, its size known from the model and the optimizer:
  every parameter's bytes once for the weights and once per optimizer buffer it will hold (Muon: a momentum
  buffer; AdamW: two moments), in the parameter's dtype. The optimizer's state is created lazily at its first
  step, so it is counted from the groups, not from the (still empty) state.

One line on refusal (PreflightError, exit 2). Rank 0 checks (it owns the run folder, and every rank's
checkpoint shards land in the same checkpoints/ folder); every rank refuses alike.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch

from pilotrun.errors import PilotrunError
from pilotrun.files import open_for_write, plain_folder, refuse_link
from pilotrun.run.record import CHECKPOINTS_DIR, METRICS_JSONL, REPORT_DIR, RUN_JSON

WRITTEN_NAMES = (RUN_JSON, METRICS_JSONL, CHECKPOINTS_DIR, REPORT_DIR, "profile", "tensorboard")
MUON_BUFFERS, ADAMW_BUFFERS = 1, 2  # state tensors per parameter, each of the parameter's size
PROBE_PREFIX = ".preflight-probe-"


class PreflightError(PilotrunError):
    """The run folder cannot take what the session will write: refused before the first update (exit 2)."""


def checkpoint_bytes_estimate(optimizer: torch.optim.Optimizer) -> int:
    """About what one checkpoint of this model and optimizer holds: weights plus optimizer buffers. The
    loader, RNG and counters are a few KiB and are left out. (A DTensor's numel is its global size: the
    estimate is the whole checkpoint, all ranks' shards together, which all land on the one disk.)"""
    total = 0
    for group in optimizer.param_groups:
        buffers = MUON_BUFFERS if group.get("use_muon") else ADAMW_BUFFERS
        for parameter in group["params"]:
            total += parameter.numel() * parameter.element_size() * (1 + buffers)
    return total


def _probe(folder: Path) -> None:
    probe = folder / f"{PROBE_PREFIX}{os.getpid()}"
    try:
        with open_for_write(probe, "wb", exclusive=True) as handle:
            handle.write(b"pilotrun preflight\n")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise PreflightError(f"{folder} is not writable ({exc.strerror or exc}); refused before the first update, "
                             "where a checkpoint could never be saved") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def _free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None  # a filesystem that cannot say: the save itself will tell


def check_run_folder(run_dir: str | Path, checkpoint_bytes: int) -> None:
    """Every check above, or PreflightError naming what and where. A checkpoints/ folder created here for the
    probe is removed again when the session is refused (a refused session leaves nothing behind)."""
    run_dir = Path(run_dir)
    for name in WRITTEN_NAMES:
        refuse_link(run_dir / name)
    checkpoints = run_dir / CHECKPOINTS_DIR
    created = not checkpoints.exists()
    try:
        plain_folder(checkpoints)
        _probe(run_dir)
        _probe(checkpoints)
        free = _free_bytes(checkpoints)
        if free is not None and free < checkpoint_bytes:
            raise PreflightError(f"{checkpoints}: {free / 2**20:,.1f} MiB free on its disk, one checkpoint of this "
                                 f"model and optimizer needs about {checkpoint_bytes / 2**20:,.1f} MiB; refused "
                                 "before the first update (free space, or another --run-dir)")
    except BaseException:
        if created and checkpoints.is_dir() and not checkpoints.is_symlink():
            with contextlib.suppress(OSError):
                checkpoints.rmdir()
        raise
