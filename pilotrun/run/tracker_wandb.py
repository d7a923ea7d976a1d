"""Weights & Biases: one W&B run per pilotrun run, its id the run_id, so every session of the run is that same
W&B run resumed.

Configured as W&B is: `WANDB_PROJECT` (default "pilotrun"), `WANDB_ENTITY`, `WANDB_MODE` (`offline` writes
the run under RUN/wandb/ for a later `wandb sync`), `WANDB_DIR` (default: the run folder, so that nothing is
written outside the folders pilotrun was given). Scalars go in with `step` = the record's step. A resumed
session rewinds the W&B run to its checkpoint's step (`resume_from="RUN_ID?_step=S"`, W&B's rewind): the
points a crash rolled back are dropped and the redone steps show once, with the kept value. The identity and
the recipe are the run's config; the verdict's decision and rule figures its summary; the report (HTML,
plots, summary.json) one artifact of type "report".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pilotrun.common.errors import ConfigError
from pilotrun.run.mirror import MIRRORED_EVENTS, PROJECT, TrackerMirror, flat_recipe, identity_tags


def _wandb():
    try:
        import wandb
    except ImportError:
        raise ConfigError("W&B output needs the wandb package: pip install 'pilotrun[wandb]'") from None
    return wandb


class WandbSink(TrackerMirror):
    name = "wandb"

    def __init__(self, run_dir: str | Path, events: tuple[str, ...] = MIRRORED_EVENTS) -> None:
        super().__init__(run_dir, events)
        self.wandb = _wandb()
        self.run: Any = None
        self.where = ""

    def start(self, identity: dict[str, Any], resume_step: int | None) -> None:
        wandb = self.wandb
        run_id = identity.get("run_id") or "pilotrun"
        config = {**identity_tags(identity), **flat_recipe(identity.get("recipe") or {})}
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
        common = {"project": os.environ.get("WANDB_PROJECT") or PROJECT, "name": run_id,
                  "dir": os.environ.get("WANDB_DIR") or str(self.run_dir), "settings": settings}
        if resume_step is None:
            self.run = wandb.init(id=run_id, resume="allow", config=config, **common)
        else:
            self.run = wandb.init(resume_from=f"{run_id}?_step={resume_step}", **common)
            # a resume may change the recipe's free keys
            self.run.config.update(config, allow_val_change=True)
        self.where = str(getattr(self.run, "dir", "") or "")

    def log(self, step: int, scalars: dict[str, float], wall_time: float | None) -> None:
        self.run.log(scalars, step=step)

    def log_verdict(self, verdict: dict[str, Any], step: int) -> None:
        self.run.summary.update({"verdict/decision": verdict["decision"],
                                 "verdict/statement": verdict["statement"],
                                 **verdict["status"], **verdict["scalars"]})

    def log_files(self, files: list[Path]) -> None:
        if not files:
            return
        artifact = self.wandb.Artifact(f"report-{self.run.id}", type="report")
        for path in files:
            artifact.add_file(str(path), name=path.name)
        self.run.log_artifact(artifact)

    def export_places(self) -> list[Path]:
        """RUN/wandb, where W&B writes when WANDB_DIR names no other folder (the run folder is its dir)."""
        return [] if os.environ.get("WANDB_DIR") else [self.run_dir / "wandb"]

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
