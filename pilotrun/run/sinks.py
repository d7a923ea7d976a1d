"""Metrics sinks: the hook through which trackers mirror the run record (`MetricsSink`), the guard that keeps
a failing one from touching the run (`GuardedSink`), and the trackers of `train.trackers` (registered in
run/trackers.py), live or after the fact (`pilotrun export-metrics RUN --to TRACKER`).

metrics.jsonl stays the record; a sink only mirrors it. The hook any tracker implements is `MetricsSink`:
`write(event)` receives each event dict right after its line is written to metrics.jsonl (a deep copy, so a
sink cannot change what was recorded), and `close()` at the end of the session. Wrap every sink in
`GuardedSink`: a sink that raises (a full disk, a tracker's server down) warns once and is switched off, and
training goes on with the record untouched. The trainer checks `check_trackers_available(names)` before it
writes anything (a missing package is a `ConfigError`: one line, exit 2) and opens `tracker_sinks(names, RUN)`
on rank 0; `Trainer(..., sinks=[...])` / `pilotrun.train(..., sinks=[...])` add any others (wrapped in a
GuardedSink unless they already are). The time they take is the session's "report" phase.

Scalars: every number in an event becomes the tag `EVENT/PATH` (nested dicts and lists joined by "/", e.g.
`train/loss`, `train/moe/maxvio/0`, `val/loss`) at x = the event's `step`, the same names in every tracker;
"NaN"/"Infinity" strings (how the record writes non-finite floats) become those floats; other strings,
booleans and nulls are not scalars and are skipped.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import importlib.util
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from pilotrun.common.errors import ConfigError
from pilotrun.run.export_undo import Places
from pilotrun.run.mirror import (
    TrackerMirror,
    exported_events,
    kept_history,
    read_verdict,
    report_files,
)
from pilotrun.run.tracker_tensorboard import TensorBoardSink
from pilotrun.run.trackers import tracker_named


class MetricsSink(Protocol):
    """What a tracker implements to receive the run's events as they are recorded."""

    def write(self, event: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class GuardedSink:
    """Runs a sink so that it can never stop training: the first failure (in construction, `write` or
    `close`) warns once, naming the sink and the cause, and every later call does nothing."""

    def __init__(self, name: str, open_sink: Callable[[], MetricsSink]) -> None:
        self.name = name
        self.sink: MetricsSink | None = None
        self.failure: str | None = None
        self._guard(lambda: setattr(self, "sink", open_sink()))

    def _guard(self, call: Callable[[], Any]) -> None:
        if self.failure is not None:
            return
        try:
            call()
        except Exception as exc:  # any failure of a mirror: the record and the run go on
            self.failure = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"metrics sink '{self.name}' failed and is switched off for this session "
                          f"(metrics.jsonl is unaffected): {self.failure}", RuntimeWarning, stacklevel=3)

    def write(self, event: dict[str, Any]) -> None:
        if self.sink is not None:
            snapshot = copy.deepcopy(event)
            self._guard(lambda: self.sink.write(snapshot))

    def close(self) -> None:
        if self.sink is not None:
            self._guard(self.sink.close)
            self.sink = None


def guarded_tensorboard_sink(log_dir: str | Path) -> GuardedSink:
    """A live TensorBoard mirror under `log_dir`, failures warned once and ignored."""
    return GuardedSink("tensorboard", lambda: TensorBoardSink(log_dir))


def check_trackers_available(names: Iterable[str]) -> None:
    """Refuse, before anything is written, a tracker that is unknown or whose package is not installed: one
    `ConfigError` naming the tracker, the missing package and the extra that installs it."""
    for name in names:
        packages = tracker_named(name, "train.trackers: ").packages
        missing = [m for m in packages if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(f"train.trackers: {name} needs the {', '.join(missing)} package"
                              f"{'s' if len(missing) > 1 else ''}: pip install 'pilotrun[{name}]'")


def open_tracker(name: str, run_dir: str | Path, log_dir: str | Path | None = None) -> TrackerMirror:
    """One tracker's mirror of the run in `run_dir`, configured as that tracker is (module docstrings of
    run/tracker_*.py); `log_dir` is TensorBoard's event folder (default RUN/tensorboard)."""
    return tracker_named(name).open(Path(run_dir), None if log_dir is None else Path(log_dir))


def tracker_sinks(names: Iterable[str], run_dir: str | Path) -> list[GuardedSink]:
    """The live mirrors of `train.trackers` for rank 0, each guarded; each opens its tracker run at the
    session's `session_start` (a resumed session resumes the tracker's run)."""
    return [GuardedSink(name, lambda name=name: open_tracker(name, run_dir)) for name in names]


def disk_full(exc: BaseException) -> bool:
    """A write refused for want of space (or quota, or a read-only disk): an OSError, or the same failure as a
    tracker's SQLite store reports it (MLflow wraps it in its own exception, "database or disk is full")."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
    return "database or disk is full" in str(exc)


def _why(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) and exc.strerror else "database or disk is full")


def _abandon(sink: TrackerMirror) -> None:
    """The tracker's run closed if it can be (closing writes too: on a full disk it may fail again)."""
    with contextlib.suppress(Exception):
        sink.close()


def export_metrics(run_dir: str | Path, name: str, *, log_dir: str | Path | None = None, force: bool = False
                   ) -> dict[str, Any]:
    """`pilotrun export-metrics RUN --to NAME`: a finished run's kept history (each step once), its identity,
    its verdict and report files (where a verdict was made) into one tracker. Not guarded: a failure is the
    command's error. Returns {tracker, events, scalars, verdict, files, where}."""
    from pilotrun.run.record import METRICS_JSONL

    run_dir = Path(run_dir)
    if not (run_dir / METRICS_JSONL).is_file():
        raise ConfigError(f"{run_dir / METRICS_JSONL} not found: is {run_dir} a run folder?")
    check_trackers_available([name])
    verdict = read_verdict(run_dir)
    files = report_files(run_dir)
    own_export = tracker_named(name).export
    if own_export is not None:  # TensorBoard: the whole run rewritten as one folder of event files
        out, scalars = own_export(run_dir, log_dir, force=force)
        return {"tracker": name, "events": None, "scalars": scalars, "verdict": verdict is not None,
                "files": 0, "where": str(out)}
    events = kept_history(exported_events(run_dir))
    sink = open_tracker(name, run_dir)
    try:
        places = Places.take(sink.export_places())
    except OSError as exc:  # the copy aside did not fit: nothing was sent
        if not disk_full(exc):
            raise
        raise ConfigError(f"export-metrics --to {name}: writing {exc.filename or sink.store()} failed "
                          f"({_why(exc)}); nothing was written") from None
    try:
        try:
            sink.begin(None)
            for event in events:
                sink.write(event)
            if verdict is not None:
                sink.log_verdict(verdict, max((int(e.get("step", 0)) for e in events), default=0))
            sink.log_files(files)
        finally:
            sink.close()
    except Exception as exc:  # whatever failed, the places pilotrun chose hold nothing of a half export
        _abandon(sink)
        undone = [*places.restore(), sink.undo_export()]
        if not disk_full(exc):
            raise
        done = ", ".join(u for u in undone if u)
        left = (
            f"nothing of this export was kept ({done})"
            if done
            else f"what it sent before stays in {sink.store()}, the tracker's own store (not a place "
                 "pilotrun chose)"
        )
        raise ConfigError(
            f"export-metrics --to {name}: writing {getattr(exc, 'filename', None) or sink.store()} "
            f"failed ({_why(exc)}); {left}"
        ) from None
    places.discard()
    return {
        "tracker": name,
        "events": len(events),
        "scalars": sink.scalars_written,
        "verdict": verdict is not None,
        "files": len(files),
        "where": getattr(sink, "where", ""),
    }
