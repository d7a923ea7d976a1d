"""What every tracker mirror sends, whatever the tracker: the scalars of an event, the run's identity, the
kept history after a resume, the verdict's figures and the report's files. Torch-free, like the rest of run/.

`TrackerMirror` is the base each tracker module builds on (run/tracker_*.py): it turns the record's events
into four calls a tracker implements — `start(identity, resume_step)`, `log(step, scalars, wall_time)`,
`log_verdict(verdict)`, `log_files(files)` — and `close()`. A `session_start` that resumes from a checkpoint
at step S means the steps after S that earlier sessions logged were rolled back and are about to be redone:
`resume_step` = S, so the tracker can drop them (TensorBoard purges them, W&B rewinds the run to S) or, where
it keeps every point it was sent (MLflow, trackio), at least receive the redone value after the rolled-back
one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pilotrun.common.files import canonical_sha256
from pilotrun.run.events import EVENT_KINDS
from pilotrun.run.record import (
    METRICS_JSONL,
    NONFINITE_STRINGS,
    RUN_JSON,
    RecordError,
    read_metrics_tolerant,
    read_run_json,
    record_integrity_problems,
)

MIRRORED_EVENTS = tuple(name for name, kind in EVENT_KINDS.items() if kind.mirrored)  # run/events.py
# Identity and clock fields that every event carries: not metrics.
NOT_SCALARS = frozenset({"event", "time", "session_id"})
REPORT_FOLDER = "report"  # what `pilotrun verdict` writes: summary.json, report.html, the plots
PROJECT = "pilotrun"  # the project / experiment a run lands in unless the tracker's own setting names another


def scalar_fields(event: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """(tag, value) for every number of an event, tags `EVENT/PATH`, in the event's own key order."""
    name = str(event.get("event", "event"))

    def walk(value: Any, path: str) -> Iterator[tuple[str, float]]:
        if isinstance(value, bool) or value is None:
            return
        if isinstance(value, int | float):
            yield path, float(value)
        # the record's spelling of a non-finite float
        elif isinstance(value, str) and value in NONFINITE_STRINGS:
            yield path, NONFINITE_STRINGS[value]
        elif isinstance(value, dict):
            for key, item in value.items():
                yield from walk(item, f"{path}/{key}")
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                yield from walk(item, f"{path}/{index}")

    for key, value in event.items():
        # "_line" and the like: the reader's, not the record's
        if key not in NOT_SCALARS and not key.startswith("_"):
            yield from walk(value, f"{name}/{key}")


def resume_step(event: dict[str, Any]) -> int | None:
    """The checkpoint step a `session_start` resumes from (None for a fresh session or any other event)."""
    if event.get("event") == "session_start" and event.get("resumed_from") is not None:
        return int(event.get("step", event["resumed_from"]))
    return None


def exported_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """The events of a run folder a tracker may be sent, or RecordError naming the damage: a tracker shows a
    record to people who will not see its metrics.jsonl, so a record summarize calls damaged (an unreadable
    line, a broken hash chain, run.json rewritten) is refused whole, never exported as if it were intact. A
    bare log with no run.json beside it (an event folder's source) is checked line by line only."""
    run_dir = Path(run_dir)
    parsed = read_metrics_tolerant(run_dir)
    reasons = list(parsed.damage)
    if (run_dir / RUN_JSON).is_file():
        reasons += record_integrity_problems(read_run_json(run_dir), parsed)
    if reasons:
        more = (
            f" (and {len(reasons) - 1} more; pilotrun summarize {run_dir} lists them)"
            if len(reasons) > 1
            else ""
        )
        raise RecordError(f"{run_dir / METRICS_JSONL}: damaged record, not exported: {reasons[0]}{more}")
    return parsed.events


def kept_history(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The mirrored events each step keeps: a resume from step S drops what earlier sessions logged after S
    (the rolled-back steps), so every step shows once, with the value the run kept. This is the rule the live
    mirrors apply as the resume happens, so a run exported afterwards reads the same as one mirrored live."""
    kept: list[dict[str, Any]] = []
    for event in events:
        step = resume_step(event)
        if step is not None:
            kept = [e for e in kept if int(e.get("step", 0)) <= step]
        elif event.get("event") in MIRRORED_EVENTS:
            kept.append(event)
    return kept


def read_identity(run_dir: str | Path) -> dict[str, Any]:
    """The run's identity as every tracker gets it: run_id, the recipe's sha256 (canonical JSON of run.json's
    recipe), the data's metadata_sha256 and the latest session's git commit; plus the recipe itself."""
    run = read_run_json(run_dir)
    sessions = run.get("sessions") or [{}]
    latest = sessions[-1] if isinstance(sessions[-1], dict) else {}
    git = latest.get("git") if isinstance(latest.get("git"), dict) else {}
    data = run.get("data") if isinstance(run.get("data"), dict) else {}
    recipe = run.get("recipe")
    return {"run_id": str(run.get("run_id", "")),
            "recipe_sha256": canonical_sha256(recipe) if recipe is not None else None,
            "data_metadata_sha256": data.get("metadata_sha256"),
            "git_commit": git.get("commit"),
            "git_dirty": git.get("dirty"),
            "session_id": latest.get("session_id"),
            "sessions": len(run.get("sessions") or []),
            "recipe": recipe if isinstance(recipe, dict) else {}}


IDENTITY_KEYS = ("run_id", "recipe_sha256", "data_metadata_sha256", "git_commit")


def identity_tags(identity: dict[str, Any]) -> dict[str, str]:
    """The identity as flat strings (tags, params, text): the four keys every tracker carries, then the
    rest."""
    keys = IDENTITY_KEYS + ("git_dirty", "session_id", "sessions")
    return {key: str(identity.get(key)) for key in keys}


def flat_recipe(recipe: dict[str, Any], prefix: str = "recipe") -> dict[str, Any]:
    """{'train': {'seq_len': 32}} -> {'recipe/train/seq_len': 32}: the recipe as one level of config keys."""
    out: dict[str, Any] = {}
    for key, value in recipe.items():
        name = f"{prefix}/{key}"
        if isinstance(value, dict):
            out.update(flat_recipe(value, name))
        else:
            out[name] = value
    return out


def read_verdict(run_dir: str | Path) -> dict[str, Any] | None:
    """RUN/report/summary.json as the mirrors use it, or None where no verdict was made: `decision` ("GO" or
    "NO-GO"), `statement`, `status` {verdict/RULE/status: PASS|WARN|FAIL} and `scalars` {verdict/go: 1.0 or
    0.0, verdict/RULE/figure and verdict/RULE/threshold where they are numbers}."""
    path = Path(run_dir) / REPORT_FOLDER / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text(encoding="utf-8"))
    decision = str(summary.get("decision"))
    scalars: dict[str, float] = {"verdict/go": 1.0 if decision == "GO" else 0.0}
    status: dict[str, str] = {}
    for rule in summary.get("rules") or []:
        name = str(rule.get("name"))
        status[f"verdict/{name}/status"] = str(rule.get("status"))
        for field in ("figure", "threshold"):
            value = rule.get(field)
            if isinstance(value, int | float) and not isinstance(value, bool):
                scalars[f"verdict/{name}/{field}"] = float(value)
    return {"decision": decision, "statement": str(summary.get("statement", "")), "status": status,
            "scalars": scalars}


def report_files(run_dir: str | Path) -> list[Path]:
    """The report's files a tracker keeps as artifacts: report.html, the plots and summary.json."""
    folder = Path(run_dir) / REPORT_FOLDER
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink()
                  and p.suffix in (".html", ".png", ".json"))


class TrackerMirror:
    """The record -> tracker translation every tracker module shares. Subclasses implement `start`, `log`,
    `log_verdict`, `log_files` and `close`; `write(event)` is the `MetricsSink` side the trainer calls."""

    name = "tracker"

    def __init__(self, run_dir: str | Path, events: tuple[str, ...] = MIRRORED_EVENTS) -> None:
        self.run_dir = Path(run_dir)
        self.events = events
        self.started = False
        self.scalars_written = 0

    def write(self, event: dict[str, Any]) -> None:
        if event.get("event") == "session_start" and not self.started:
            self.begin(resume_step(event))
            return
        if event.get("event") not in self.events:
            return
        if not self.started:  # handed events without their session_start: a fresh run as far as we know
            self.begin(None)
        scalars = dict(scalar_fields(event))
        if scalars:
            self.log(int(event.get("step", 0)), scalars, event.get("time"))
            self.scalars_written += len(scalars)

    def begin(self, resume: int | None) -> None:
        self.start(read_identity(self.run_dir), resume)
        self.started = True

    def start(self, identity: dict[str, Any], resume_step: int | None) -> None:
        raise NotImplementedError

    def log(self, step: int, scalars: dict[str, float], wall_time: float | None) -> None:
        raise NotImplementedError

    def log_verdict(self, verdict: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def log_files(self, files: list[Path]) -> None:
        """Artifacts; a tracker without them ignores the call."""

    def export_places(self) -> list[Path]:
        """The files and folders this tracker writes where pilotrun chose the place (its default under the run
        folder, when its own setting names no other): a failed export leaves them as they were
        (export_undo.py)."""
        return []

    def undo_export(self) -> str | None:
        """After a failed export, what the tracker itself can take back of it outside `export_places` (a run
        the export created in the tracker's own store), in words; None: nothing."""
        return None

    def store(self) -> str:
        """Where this tracker writes, in words, for a line that names it."""
        places = self.export_places()
        return str(places[0] if places else getattr(self, "where", "") or self.run_dir)

    def close(self) -> None:
        raise NotImplementedError
