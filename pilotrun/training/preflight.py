"""Before the first update: what would otherwise be found only at the first checkpoint, after
`train.checkpoint.every` updates of work that could not be saved.

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

`disk_plan` is the longer view, stated at the session's start and again after its first save: the bytes one
checkpoint takes (the newest committed one's, measured, else the estimate above), how many the retention tiers
can hold at once by max_steps (checkpoint/retention.py), and the free space of the run folder's file system; a
warning when the policy will not fit (the checkpoints already there count as room, since pruning frees them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch

from pilotrun.common.errors import PilotrunError
from pilotrun.common.files import open_for_write, plain_folder, refuse_link
from pilotrun.config import TrainConfig
from pilotrun.run.record import CHECKPOINTS_DIR, METRICS_JSONL, REPORT_DIR, RUN_JSON
from pilotrun.training.checkpoint.checkpointer import Checkpointer
from pilotrun.training.checkpoint.retention import kept_at_most

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
        raise PreflightError(
            f"{folder} is not writable ({exc.strerror or exc}); refused before the first update, "
            "where a checkpoint could never be saved"
        ) from None
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
            raise PreflightError(
                f"{checkpoints}: {free / 2**20:,.1f} MiB free on its disk, one checkpoint of this "
                f"model and optimizer needs about {checkpoint_bytes / 2**20:,.1f} MiB; refused "
                "before the first update (free space, or another --run-dir)"
            )
    except BaseException:
        if created and checkpoints.is_dir() and not checkpoints.is_symlink():
            with contextlib.suppress(OSError):
                checkpoints.rmdir()
        raise


RECORD_MARGIN_BYTES = 4 << 20  # beside a checkpoint: the record's appends until the session ends


def room_problem(folder: Path, checkpoint_bytes: int) -> str | None:
    """Why `folder`'s disk cannot take one more checkpoint of `checkpoint_bytes` (and the record's margin), or
    None (also when the file system cannot say)."""
    free = _free_bytes(folder if folder.is_dir() else folder.parent)
    if free is None or free >= checkpoint_bytes + RECORD_MARGIN_BYTES:
        return None
    return (
        f"{_size(free)} free on the run folder's file system, a checkpoint takes about "
        f"{_size(checkpoint_bytes)} "
        f"(+ {_size(RECORD_MARGIN_BYTES)} kept for the record)"
    )


def disk_plan(checkpointer: Checkpointer, train: TrainConfig, bytes_each: int, source: str
              ) -> tuple[str, str | None]:
    """(the line stating the plan, a warning or None); see the module docstring."""
    committed = checkpointer.committed()
    protected = set(checkpointer.all_protected()) - {c.step for c in committed if c.step > train.max_steps}
    policy = train.checkpoint
    kept = kept_at_most(train.max_steps, policy.every, policy.keep, policy.keep_every, protected)
    already = sum(
        int(entry.get("bytes", 0))
        for c in committed
        for entry in c.marker.get("files", {}).values()
        if isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
    )
    free = _free_bytes(checkpointer.root if checkpointer.root.is_dir() else checkpointer.run_dir)
    need = (kept + 1) * bytes_each  # one more: the save being written before the next prune
    tiers = f"the newest {policy.keep}"
    if policy.keep_every:
        tiers += f", every {policy.keep_every}-th step"
    tiers += f", {len(protected)} protected and the final one" if protected else " and the final one"
    free_text = "unknown" if free is None else _size(free)
    line = (
        f"checkpoints: {_size(bytes_each)} each ({source}); the retention policy keeps at most {kept} by "
        "step "
        f"{train.max_steps:,} ({tiers}), {_size(need)} with the one being written; {free_text} free on the "
        "run "
        "folder's file system"
    )
    warning = None
    if free is not None and free + already < need:
        warning = (
            f"the checkpoint policy needs about {_size(need)} but the run folder's file system has "
            f"{_size(free)} free (+ {_size(already)} of checkpoints already there): the disk fills before "
            "step "
            f"{train.max_steps:,}; lower train.checkpoint.keep or train.checkpoint.keep_every, or free space"
        )
    return line, warning


def _size(count: int) -> str:
    return f"{count / 2**30:,.2f} GiB" if count >= 2**30 else f"{count / 2**20:,.1f} MiB"
