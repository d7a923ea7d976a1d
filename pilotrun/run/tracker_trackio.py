"""trackio: one trackio run per pilotrun run, named by the run_id, so every session of the run resumes it.

Configured as trackio is: its local store is `TRACKIO_DIR` (default ~/.cache/huggingface/trackio; `trackio
show` reads it), `TRACKIO_SPACE_ID` / `TRACKIO_SERVER_URL` send it elsewhere; the project is `TRACKIO_PROJECT`
(default "pilotrun"). Scalars go in with `step` = the record's step, as JSON numbers (float64), one row per
step (a step's events are sent together when the next step begins). trackio keeps every point it is sent, so
after a resume a rolled-back step has two points, the redone (kept) one last; `export-metrics` of a finished
run sends each step once. The identity and the recipe are the run's config (given again at each resume:
trackio replaces a run's config with the one its latest init names), the verdict's decision and figures go
into the config and, as numbers, the log at the last step; the report is one artifact of type "report".
trackio's console lines are kept out of the training's output.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any

from pilotrun.common.errors import ConfigError
from pilotrun.run.mirror import MIRRORED_EVENTS, PROJECT, TrackerMirror, flat_recipe, identity_tags


def _trackio():
    try:
        import trackio
    except ImportError:
        raise ConfigError(
            "trackio output needs the trackio package: pip install 'pilotrun[trackio]'"
        ) from None
    return trackio


@contextlib.contextmanager
def _quiet():
    """trackio prints where it logs at init and finish; the trainer's output is its own."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


class TrackioSink(TrackerMirror):
    name = "trackio"

    def __init__(self, run_dir: str | Path, events: tuple[str, ...] = MIRRORED_EVENTS) -> None:
        super().__init__(run_dir, events)
        self.trackio = _trackio()
        self.run: Any = None
        self.config: dict[str, Any] = {}
        self.pending_step: int | None = None
        self.pending: dict[str, float] = {}
        self.project = os.environ.get("TRACKIO_PROJECT") or PROJECT
        self.where = ""
        self.created = False  # this sink's start created the trackio run (in the local store)
        self.run_name = ""

    def _init(self, name: str) -> None:
        with _quiet():
            self.run = self.trackio.init(project=self.project, name=name, config=self.config, resume="allow",
                                         embed=False, auto_log_gpu=False, auto_log_cpu=False)

    def start(self, identity: dict[str, Any], resume_step: int | None) -> None:
        self.config = {**identity_tags(identity), **flat_recipe(identity.get("recipe") or {})}
        if resume_step is not None:
            self.config["resumed_at_step"] = resume_step
        self.run_name = identity.get("run_id") or PROJECT
        if not self._remote():
            self.created = self.run_name not in self.trackio.SQLiteStorage.get_runs(self.project)
        self._init(self.run_name)
        self.where = f"trackio project {self.project} run {self.run.name}"

    def log(self, step: int, scalars: dict[str, float], wall_time: float | None) -> None:
        # One trackio row per step: trackio keeps one of several rows logged at one step in the same instant
        # (seen with the val and checkpoint events that follow a step's train event), so a step's events are
        # merged and sent when the next step begins, or at the end.
        if self.pending_step is not None and step != self.pending_step:
            self.flush()
        self.pending_step = step
        self.pending.update(scalars)

    def flush(self) -> None:
        if self.pending_step is not None and self.pending:
            self.run.log(dict(self.pending), step=self.pending_step)
        self.pending_step, self.pending = None, {}

    def log_verdict(self, verdict: dict[str, Any], step: int) -> None:
        # trackio takes a run's config at init and stores it with the rows logged after: finish this init,
        # resume the run with the verdict in its config, then log the verdict's figures.
        self.flush()
        self.config.update(
            {
                "verdict/decision": verdict["decision"],
                "verdict/statement": verdict["statement"],
                **verdict["status"],
            }
        )
        name = self.run.name
        with _quiet():
            self.run.finish()
        self._init(name)
        self.log(step, verdict["scalars"], None)
        self.flush()

    def log_files(self, files: list[Path]) -> None:
        if not files:
            return
        artifact = self.trackio.Artifact(f"report-{self.run.name}", type="report")
        for path in files:
            artifact.add_file(str(path), name=path.name)
        with _quiet():
            self.run.log_artifact(artifact)

    @staticmethod
    def _remote() -> bool:
        return bool(os.environ.get("TRACKIO_SPACE_ID") or os.environ.get("TRACKIO_SERVER_URL"))

    def store(self) -> str:
        """The project's database in trackio's local store (TRACKIO_DIR), or where the remote one is."""
        if self._remote():
            return self.where or f"trackio project {self.project}"
        return str(self.trackio.SQLiteStorage.get_project_db_path(self.project))

    def undo_export(self) -> str | None:
        """trackio's store is its own (TRACKIO_DIR), not a place pilotrun chose; a run this export created
        there is removed with trackio's own storage call (a run that was there before keeps what the export
        added)."""
        if not self.created:
            return None
        try:
            removed = self.trackio.SQLiteStorage.delete_run(self.project, self.run_name)
        except Exception:  # on a full disk the deletion may fail too: said, not raised
            return None
        return f"the trackio run {self.run_name} it created removed" if removed else None

    def close(self) -> None:
        if self.run is not None:
            try:
                self.flush()
            finally:  # finished even when the last rows fail: trackio would otherwise send its queue at exit
                with _quiet():
                    self.run.finish()
                self.run = None
