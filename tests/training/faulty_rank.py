"""A test seam, run under torchrun in place of `-m pilotrun`: `python faulty_rank.py FAULT RANK STEP [MARKER]
-- ARGS` runs `pilotrun ARGS` with rank RANK faulty before the update after STEP: FAULT `stall` sleeps (a rank
stuck in a read, a dead link, a deadlock), `kill` SIGKILLs the rank (an OOM kill, a node's process lost). With
MARKER, a file path, only the first process to reach the fault has it (it creates MARKER): the group torchrun
restarts runs through. Ships in no production path: only tests start it."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pilotrun.training.loop as loop_module
from pilotrun.commands.cli import main


def fault_before(fault: str, rank: int, step: int, marker: Path | None) -> None:
    real = loop_module.train_one_update

    def faulty(loop):
        if int(os.environ.get("RANK", "0")) == rank and loop.step == step:
            if marker is None or not marker.exists():
                if marker is not None:
                    marker.write_text(str(os.getpid()))
                if fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)
        return real(loop)

    loop_module.train_one_update = faulty


if __name__ == "__main__":
    split = sys.argv.index("--")
    fault, rank, step, *marker = sys.argv[1:split]
    fault_before(fault, int(rank), int(step), Path(marker[0]) if marker else None)
    sys.exit(main(sys.argv[split + 1:]))
