"""MLflow: one MLflow run per pilotrun run (found again by its tag `pilotrun.run_id`), so every session of the
run logs into that same MLflow run.

Configured as MLflow is: `MLFLOW_TRACKING_URI` (default: a local SQLite store in the run folder,
`sqlite:///RUN/mlflow.db`, artifacts under RUN/mlflow-artifacts/: nothing outside the folders pilotrun was
given; `mlflow ui --backend-store-uri sqlite:///RUN/mlflow.db` shows it) and `MLFLOW_EXPERIMENT_NAME`
(default "pilotrun"). Scalars are metrics at `step` = the record's step with the event's time, stored as
float64. MLflow keeps every point it is sent and cannot remove one, so after a resume a rolled-back step has
two points: the rolled-back one, then the redone (kept) one, later in time, which is the one MLflow reports as
the step's latest; the tag `pilotrun.resumed_at_steps` lists where sessions resumed. `export-metrics` of a
finished run sends each step once. The identity is tags (`pilotrun.run_id`, `pilotrun.recipe_sha256`, ...)
and params (set once, when the MLflow run is created: params cannot change); the verdict is the tag
`pilotrun.verdict` plus metrics `verdict/...`; the report is artifacts under `report/`.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from pilotrun.common.errors import ConfigError
from pilotrun.run.mirror import IDENTITY_KEYS, MIRRORED_EVENTS, PROJECT, TrackerMirror, identity_tags

TAG_PREFIX = "pilotrun."
BATCH = 1000  # MLflow's largest log_batch
STORE = "mlflow.db"
ARTIFACTS = "mlflow-artifacts"


def _mlflow():
    try:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ConfigError("MLflow output needs the mlflow package: pip install 'pilotrun[mlflow]'") from None
    return MlflowClient, Metric, Param, RunTag


class MlflowSink(TrackerMirror):
    name = "mlflow"

    def __init__(self, run_dir: str | Path, events: tuple[str, ...] = MIRRORED_EVENTS) -> None:
        super().__init__(run_dir, events)
        self._client_class, self._metric, self._param, self._tag = _mlflow()
        self.client: Any = None
        self.mlflow_run_id: str | None = None
        self.uri = ""
        self.where = ""

    def start(self, identity: dict[str, Any], resume_step: int | None) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        local = not uri
        if local:
            uri = f"sqlite:///{self.run_dir.resolve() / STORE}"
        self.uri = uri
        self.client = client = self._client_class(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            location = (self.run_dir.resolve() / ARTIFACTS).as_uri() if local else None
            experiment_id = client.create_experiment(name, artifact_location=location)
        run_id = identity.get("run_id") or ""
        tags = {f"{TAG_PREFIX}{key}": value for key, value in identity_tags(identity).items()}
        found = client.search_runs([experiment_id], f"tags.`{TAG_PREFIX}run_id` = '{run_id}'", max_results=1)
        if found:
            self.mlflow_run_id = found[0].info.run_id
            client.update_run(self.mlflow_run_id, status="RUNNING")
        else:
            run = client.create_run(experiment_id, tags=tags, run_name=run_id)
            self.mlflow_run_id = run.info.run_id
            params = [self._param(key, str(identity.get(key))) for key in IDENTITY_KEYS]
            client.log_batch(self.mlflow_run_id, params=params)
        if resume_step is not None:
            current = client.get_run(self.mlflow_run_id).data.tags.get(f"{TAG_PREFIX}resumed_at_steps")
            tags[f"{TAG_PREFIX}resumed_at_steps"] = (
                f"{current},{resume_step}" if current else str(resume_step)
            )
        client.log_batch(self.mlflow_run_id, tags=[self._tag(key, value) for key, value in tags.items()])
        self.where = f"{uri} run {self.mlflow_run_id}"

    def log(self, step: int, scalars: dict[str, float], wall_time: float | None) -> None:
        stamp = int((wall_time if wall_time is not None else time.time()) * 1000)
        metrics = [self._metric(key, value, stamp, step) for key, value in scalars.items()]
        for start in range(0, len(metrics), BATCH):
            self.client.log_batch(self.mlflow_run_id, metrics=metrics[start:start + BATCH])

    def log_verdict(self, verdict: dict[str, Any], step: int) -> None:
        self.log(step, verdict["scalars"], None)
        tags = {
            f"{TAG_PREFIX}verdict": verdict["decision"],
            f"{TAG_PREFIX}verdict_statement": verdict["statement"],
            **{f"{TAG_PREFIX}{key}": value for key, value in verdict["status"].items()},
        }
        self.client.log_batch(self.mlflow_run_id, tags=[self._tag(key, value) for key, value in tags.items()])

    def log_files(self, files: list[Path]) -> None:
        for path in files:
            self.client.log_artifact(self.mlflow_run_id, str(path), "report")

    def export_places(self) -> list[Path]:
        """The local store pilotrun chooses when MLFLOW_TRACKING_URI names none: RUN/mlflow.db and its
        artifacts."""
        return (
            [] if os.environ.get("MLFLOW_TRACKING_URI") else [self.run_dir / STORE, self.run_dir / ARTIFACTS]
        )

    def undo_export(self) -> str | None:
        """MLflow keeps one store per URI for the life of the process, its database open: after the local
        store was put back as it was (export_undo.py), that store is let go, so that a later use in this
        process opens the file as it is now, not the one a failed export wrote."""
        with contextlib.suppress(Exception):  # MLflow's own cache, reached where this MLflow version keeps it
            from mlflow.tracking._tracking_service.utils import _get_store, _tracking_store_registry

            if self.client is not None or self.mlflow_run_id is not None:
                _get_store(self.uri).engine.dispose()
            _tracking_store_registry._get_store_with_resolved_uri.cache_clear()
        return None

    def close(self) -> None:
        if self.client is not None and self.mlflow_run_id is not None:
            self.client.set_terminated(self.mlflow_run_id)
            self.client = None
