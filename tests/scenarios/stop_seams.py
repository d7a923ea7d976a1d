"""Test seams for the scheduler-ending scenarios, run in place of `-m pilotrun` (under torchrun or alone):
`python stop_seams.py SEAM ARG... -- ARGS` runs `pilotrun ARGS` with one fault. Ships in no production path.

  slow-save SECONDS MARKER   the session's last save (a stop's) writes MARKER (rank 0), then waits SECONDS
                             before saving: a window in which a test lands a late copy of a stop signal
  stall STEP SECONDS         rank 0 stalls SECONDS before the update after STEP, once (a stuck read that ends)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pilotrun.training.callbacks.checkpointing as checkpointing
import pilotrun.training.loop as loop_module
from pilotrun.commands.cli import main


def slow_last_save(seconds: float, marker: Path) -> None:
    real = checkpointing.save_checkpoint

    def slow(loop, **extra):
        if loop.final:
            if loop.is_main:
                marker.write_text(str(loop.step))
            time.sleep(seconds)
        return real(loop, **extra)

    checkpointing.save_checkpoint = slow


def stall_once(step: int, seconds: float) -> None:
    real = loop_module.train_one_update
    done = []

    def stalled(loop):
        if int(os.environ.get("RANK", "0")) == 0 and loop.step == step and not done:
            done.append(1)
            time.sleep(seconds)
        return real(loop)

    loop_module.train_one_update = stalled


if __name__ == "__main__":
    split = sys.argv.index("--")
    seam, *args = sys.argv[1:split]
    if seam == "slow-save":
        slow_last_save(float(args[0]), Path(args[1]))
    elif seam == "stall":
        stall_once(int(args[0]), float(args[1]))
    else:
        raise SystemExit(f"unknown seam {seam!r}")
    sys.exit(main(sys.argv[split + 1:]))
