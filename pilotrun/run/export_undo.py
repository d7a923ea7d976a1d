"""What a failed `export-metrics` leaves where pilotrun chose the place a tracker writes (W&B's RUN/wandb,
MLflow's RUN/mlflow.db and RUN/mlflow-artifacts: their defaults under the run folder): exactly what was there
before it.

`Places.take(paths)` notes each place before the export: a file that exists is copied aside (beside it, so the
copy costs the file's size on the same disk: on a full disk that copy is what fails, before anything is sent),
a folder that exists has every path under it listed (and where each symbolic link pointed). `restore()` after
a failure puts each back: a place the export created is removed, a file is written back from its copy in place
(the same inode, so that a tracker client still holding it open reads the restored bytes), and under a folder
every path the export added is removed and every link it moved is pointed back. `discard()` after success
removes the copies. A file the export changed inside a folder that existed (a tracker's log appended to) is
not restored.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pilotrun.common.files import temp_path


class Places:
    def __init__(self) -> None:
        self.absent: list[Path] = []
        self.copies: dict[Path, Path] = {}  # file -> its copy aside
        self.listed: dict[Path, dict[Path, str | None]] = {}  # folder -> {path under it: link target or None}

    @classmethod
    def take(cls, paths: list[Path]) -> Places:
        places = cls()
        try:
            for path in paths:
                if not os.path.lexists(path):
                    places.absent.append(path)
                elif path.is_dir() and not path.is_symlink():
                    places.listed[path] = {
                        p: os.readlink(p) if p.is_symlink() else None for p in path.rglob("*")
                    }
                else:
                    copy = temp_path(path)
                    places.copies[path] = copy
                    shutil.copy2(path, copy)
        except OSError:
            places.discard()  # a copy half made on a full disk goes; nothing was sent yet
            raise
        return places

    def restore(self) -> list[str]:
        """Every place as it was before; returns what was done, in words."""
        done = []
        for path in self.absent:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                path.unlink()
            done.append(f"{path.name} removed")
        for path, copy in self.copies.items():
            # truncated first: the bytes it grew by are freed before any is written
            shutil.copyfile(copy, path)
            copy.unlink()
            done.append(f"{path.name} restored")
        for folder, before in self.listed.items():
            added = sorted((p for p in folder.rglob("*") if p not in before), key=lambda p: len(p.parts),
                           reverse=True)
            for path in added:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                elif os.path.lexists(path):
                    path.unlink()
            for path, target in before.items():
                if target is not None and (not path.is_symlink() or os.readlink(path) != target):
                    path.unlink(missing_ok=True)
                    path.symlink_to(target)
            done.append(f"{len(added)} new path(s) under {folder.name} removed")
        self.copies = {}
        return done

    def discard(self) -> None:
        for copy in self.copies.values():
            copy.unlink(missing_ok=True)
        self.copies = {}
