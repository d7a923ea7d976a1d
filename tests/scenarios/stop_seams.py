"""Test seams for the scheduler-ending scenarios, run in place of `-m pilotrun` (under torchrun or alone):
`python stop_seams.py SEAM ARG... -- ARGS` runs `pilotrun ARGS` with one fault. Ships in no production path.

  slow-save SECONDS MARKER   the session's last save (a stop's) writes MARKER (rank 0), then waits SECONDS
                             before saving: a window in which a test lands a late copy of a stop signal
  kill-after-commit STEP     SIGKILL right after the background save of STEP is committed, before its event
  stall STEP RUN_DIR         rank 0 stalls before the update after STEP until its watchdog has written its
                             stacks to RUN_DIR/hangs/, then goes on (a stuck read that ends just too late)
  fill-disk STEP             right after the background save of STEP made its folder, another writer fills the
                             run folder's file system (a small tmpfs) to within LEFT bytes: DCP's write thread
                             meets a full disk, the record's small appends still fit. On a large file system
                             (no tmpfs to be had) the storage's streams of that save fail with ENOSPC instead
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem

import pilotrun.training.callbacks.checkpointing as checkpointing
import pilotrun.training.loop as loop_module
from pilotrun.commands.cli import main
from pilotrun.training.checkpoint.checkpointer import Checkpointer


def slow_last_save(seconds: float, marker: Path) -> None:
    real = checkpointing.save_checkpoint

    def slow(loop, **extra):
        if loop.final:
            if loop.is_main:
                marker.write_text(str(loop.step))
            time.sleep(seconds)
        return real(loop, **extra)

    checkpointing.save_checkpoint = slow


def stall_until_the_stacks(step: int, run_dir: Path) -> None:
    real = loop_module.train_one_update
    done = []

    def stalled(loop):
        if int(os.environ.get("RANK", "0")) == 0 and loop.step == step and not done:
            done.append(1)
            while not any((run_dir / "hangs").glob("*-rank0.txt")):
                time.sleep(0.01)
        return real(loop)

    loop_module.train_one_update = stalled


LEFT = 256 * 1024


def fill_disk_during(step: int) -> None:
    real = Checkpointer.begin_save

    def begin_then_fill(self, at, meta):
        temp, meta_json = real(self, at, meta)
        if at == step:
            stat = os.statvfs(self.root)
            if stat.f_blocks * stat.f_frsize >= 2**30:  # never fill a real disk: fail the writes instead
                fail_writes_under(temp)
                return temp, meta_json
            with open(self.root.parent / "filler", "wb") as filler:
                filler.truncate(0)
                filler.write(b"\0" * max(0, stat.f_bavail * stat.f_frsize - LEFT))
        return temp, meta_json

    Checkpointer.begin_save = begin_then_fill


def kill_after_commit(step: int) -> None:
    real = checkpointing.finish_background_save

    def commit_then_die(checkpointer, pending):
        path = real(checkpointer, pending)
        if pending.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    checkpointing.finish_background_save = commit_then_die


def fail_writes_under(folder: Path) -> None:
    real = FileSystem.create_stream

    def create_stream(self, path, mode):
        if Path(path).parent == folder:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(self, path, mode)

    FileSystem.create_stream = create_stream


if __name__ == "__main__":
    split = sys.argv.index("--")
    seam, *args = sys.argv[1:split]
    if seam == "slow-save":
        slow_last_save(float(args[0]), Path(args[1]))
    elif seam == "fill-disk":
        fill_disk_during(int(args[0]))
    elif seam == "kill-after-commit":
        kill_after_commit(int(args[0]))
    elif seam == "stall":
        stall_until_the_stacks(int(args[0]), Path(args[1]))
    else:
        raise SystemExit(f"unknown seam {seam!r}")
    sys.exit(main(sys.argv[split + 1:]))
