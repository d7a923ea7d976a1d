"""The trackers a run can be mirrored into (`train.trackers`, `pilotrun export-metrics --to`): one entry each
in TRACKERS, the only place a tracker is registered.

An entry names the tracker, the modules its extra installs (`pip install 'pilotrun[NAME]'`, checked before
anything is written), a one-line description for the command line's help, and how to open its mirror of a run
(`open(run_dir, log_dir)`; `log_dir` is TensorBoard's event folder, None elsewhere). A tracker that exports a
finished run its own way rather than through its mirror names that in `export`. Every tracker's code is its
own module, run/tracker_NAME.py, which imports its client only inside its functions: this table imports
those modules, never a tracker's library, so run/ stays light and torch-free. The help text, the choices of
`--to`, the package check and the dispatch in run/sinks.py all read this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pilotrun.common.errors import ConfigError
from pilotrun.run.mirror import TrackerMirror
from pilotrun.run.tracker_mlflow import MlflowSink
from pilotrun.run.tracker_tensorboard import convert_run_to_tensorboard, open_tensorboard
from pilotrun.run.tracker_trackio import TrackioSink
from pilotrun.run.tracker_wandb import WandbSink


@dataclass(frozen=True)
class Tracker:
    name: str
    packages: tuple[str, ...]  # the modules its extra installs
    description: str  # one line, for the command line's help
    open: Callable[[Path, Path | None], TrackerMirror]
    export: Callable[..., tuple[Path, int]] | None = None  # (run_dir, log_dir, force=) -> (where, scalars)


def _registered(*trackers: Tracker) -> dict[str, Tracker]:
    return {tracker.name: tracker for tracker in trackers}


# MLflow's local store (the default, RUN/mlflow.db) is SQLite through SQLAlchemy and alembic.
TRACKERS: dict[str, Tracker] = _registered(
    Tracker("tensorboard", ("tensorboard",), "event files under RUN/tensorboard", open_tensorboard,
            export=convert_run_to_tensorboard),
    Tracker("wandb", ("wandb",), "Weights & Biases, configured by WANDB_*",
            lambda run_dir, log_dir: WandbSink(run_dir)),
    Tracker("mlflow", ("mlflow", "sqlalchemy", "alembic"), "MLflow, by default SQLite in the run folder",
            lambda run_dir, log_dir: MlflowSink(run_dir)),
    Tracker("trackio", ("trackio",), "trackio, configured by TRACKIO_*",
            lambda run_dir, log_dir: TrackioSink(run_dir)),
)


def tracker_names() -> tuple[str, ...]:
    return tuple(TRACKERS)


def tracker_named(name: str, prefix: str = "") -> Tracker:
    """The registered tracker `name`, or the one-line ConfigError naming the known ones."""
    if name not in TRACKERS:
        raise ConfigError(f"{prefix}unknown tracker '{name}' (known: {', '.join(TRACKERS)})")
    return TRACKERS[name]
