"""Slowing or holding a checkpoint write, from the test side: the checkpointer itself has no hook for it.

In-process, pass pytest's `monkeypatch` (undone after the test); in a process the test starts, run

    python -m tests.training.checkpoint.checkpoint_faults [--write-delay S] [--commit-delay S] [--hold-file
    PATH] -- ARGS

which installs the faults and then runs `pilotrun ARGS` (pilotrun.commands.cli.main), so a test can SIGKILL a
session inside a checkpoint write deterministically, under torchrun too (`-m
tests.training.checkpoint.checkpoint_faults` in place of `-m pilotrun`). The faults wrap the checkpointer's
own seams:

- write delay: sleep after each file TorchSaveStorage writes, and after DCPStorage's collective write (shards
  written and hashed, before rank 0 renames and commits);
- commit delay: sleep after the step folder's rename, before its marker (`Checkpointer._commit`);
- hold file: while that file exists and holds the step's number (or nothing), wait before the marker; deleting
  the file lets the save finish, however slow or fast the machine is.
- hold background: a background save (checkpoint/background.py) whose temp folder's path contains the file's
  text (all of them when it is empty) waits inside DCP's write, its data files written and .metadata not yet,
  while that file exists; it writes its folder's path to `<file>.reached` when it starts waiting.
- hold staging: the background save whose staging thread is the N-th of the process (N: the file's text)
  waits in that thread before copying, its temp folder made and nothing written, while that file exists; it
  writes `<file>.reached` when it starts waiting.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from pilotrun.training.checkpoint import checkpointer as checkpoint_module
from pilotrun.training.checkpoint import dcp_storage, single_file


def _set(monkeypatch: Any, owner: Any, name: str, value: Any) -> None:
    if monkeypatch is not None:
        monkeypatch.setattr(owner, name, value)
    else:
        setattr(owner, name, value)


def delay_each_file(seconds: float, monkeypatch: Any = None) -> None:
    write_one = single_file.TorchSaveStorage._write_one
    dcp_write = dcp_storage.DCPStorage.write

    def slow_write_one(value, path):
        result = write_one(value, path)
        time.sleep(seconds)
        return result

    def slow_dcp_write(self, state, folder):
        result = dcp_write(self, state, folder)
        time.sleep(seconds)
        return result

    _set(monkeypatch, single_file.TorchSaveStorage, "_write_one", staticmethod(slow_write_one))
    _set(monkeypatch, dcp_storage.DCPStorage, "write", slow_dcp_write)


def _before_commit(wait, monkeypatch: Any = None) -> None:
    commit = checkpoint_module.Checkpointer._commit

    def waiting_commit(self, folder, marker):
        wait(int(marker["step"]))
        return commit(self, folder, marker)

    _set(monkeypatch, checkpoint_module.Checkpointer, "_commit", waiting_commit)


def delay_commit(seconds: float, monkeypatch: Any = None) -> None:
    _before_commit(lambda step: time.sleep(seconds), monkeypatch)


def hold_commit(hold_file: str | Path, monkeypatch: Any = None) -> None:
    hold = Path(hold_file)

    def wait(step: int) -> None:
        while True:
            try:
                wanted = hold.read_text().strip()
            except OSError:  # deleted: let go
                return
            if wanted not in ("", str(step)):
                return
            time.sleep(0.05)

    _before_commit(wait, monkeypatch)


def hold_background_write(hold_file: str | Path, monkeypatch: Any = None) -> None:
    from pilotrun.training.checkpoint import background

    hold = Path(hold_file)
    finish = background._HashingFileSystemWriter.finish

    def held_finish(self, metadata, results):
        try:
            wanted = hold.read_text().strip()
        except OSError:
            wanted = None
        if wanted is not None and wanted in str(self.path):  # "" holds every write, "step-00000004" that one
            # Written aside and renamed, so the test never reads the file made but not yet filled.
            Path(f"{hold}.reaching").write_text(str(self.path))
            os.replace(f"{hold}.reaching", f"{hold}.reached")
            while hold.exists():
                time.sleep(0.05)
        return finish(self, metadata, results)

    _set(monkeypatch, background._HashingFileSystemWriter, "finish", held_finish)


def hold_staging(hold_file: str | Path, monkeypatch: Any = None) -> None:
    from pilotrun.training.checkpoint import host_staging

    hold, copy_later, started = Path(hold_file), host_staging.copy_later, []

    def held_copy(pairs, staged, future):
        started.append(len(started) + 1)
        if hold.exists() and hold.read_text().strip() == str(started[-1]):
            Path(f"{hold}.reached").write_text("")
            while hold.exists():
                time.sleep(0.05)
        return copy_later(pairs, staged, future)

    _set(monkeypatch, host_staging, "copy_later", held_copy)


def command(*faults: str, launcher: list[str] | None = None) -> list[str]:
    """The command line that runs `pilotrun` with `faults` (e.g. "--write-delay", "3"); append its
    arguments."""
    return (launcher or [sys.executable]) + [
        "-m",
        "tests.training.checkpoint.checkpoint_faults",
        *faults,
        "--",
    ]


def main(argv: list[str]) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="checkpoint_faults")
    parser.add_argument("--write-delay", type=float, default=None)
    parser.add_argument("--commit-delay", type=float, default=None)
    parser.add_argument("--hold-file", default=None)
    parser.add_argument("--hold-background", default=None)
    parser.add_argument("--hold-staging", default=None)
    options = parser.parse_args(argv[:split])
    if options.write_delay is not None:
        delay_each_file(options.write_delay)
    if options.commit_delay is not None:
        delay_commit(options.commit_delay)
    if options.hold_file is not None:
        hold_commit(options.hold_file)
    if options.hold_background is not None:
        hold_background_write(options.hold_background)
    if options.hold_staging is not None:
        hold_staging(options.hold_staging)
    from pilotrun.commands.cli import main as pilotrun_main

    return pilotrun_main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
