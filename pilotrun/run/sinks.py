"""Metrics sinks: mirrors of the run record's events for live trackers (TensorBoard here), and the converter
`pilotrun tensorboard RUN` for a finished run.

metrics.jsonl stays the record; a sink only mirrors it. The hook any tracker implements is `MetricsSink`:
`write(event)` receives each event dict right after its line is written to metrics.jsonl (a deep copy, so a
sink cannot change what was recorded), and `close()` at the end of the session. Wrap every sink in
`GuardedSink`: a sink that raises (a full disk, a missing package, a tracker's server down) warns once and is
switched off, and training goes on with the record untouched. The trainer does both: `train.tensorboard: true`
opens `guarded_tensorboard_sink(RUN/tensorboard)` on rank 0, and `Trainer(..., sinks=[...])` /
`pilotrun.train(..., sinks=[...])` add any others (wrapped in a GuardedSink unless they already are); the
time they take is the session's "report" phase. Another tracker fits in a few lines, with
no dependency for pilotrun (W&B shown; trackio and MLflow's `log_metrics(metrics, step=)` are alike):

    class WandbSink:
        def __init__(self, **init):
            import wandb
            self.run = wandb.init(**init)
        def write(self, event):
            if event["event"] in MIRRORED_EVENTS:
                self.run.log(dict(scalar_fields(event)), step=event["step"])
        def close(self):
            self.run.finish()

    sink = GuardedSink("wandb", lambda: WandbSink(project="pilot"))

Scalars: every number in an event becomes the tag `EVENT/PATH` (nested dicts and lists joined by "/", e.g.
`train/loss`, `train/moe/maxvio/0`, `val/loss`), at x = the event's `step`, with the event's `time` as wall
time. Values are stored as float64 (TensorBoard's "new style" scalar with double precision) so that they
read back equal to the JSON value; "NaN"/"Infinity" strings (how the record writes non-finite floats) become
those floats; other strings, booleans and nulls are not scalars and are skipped.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from pilotrun.errors import ConfigError

MIRRORED_EVENTS = ("train", "val", "checkpoint", "overflow")
# Identity and clock fields that every event carries: not metrics.
NOT_SCALARS = frozenset({"event", "time", "session_id"})
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class MetricsSink(Protocol):
    """What a tracker implements to receive the run's events as they are recorded."""

    def write(self, event: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalar_fields(event: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """(tag, value) for every number of an event, tags `EVENT/PATH`, in the event's own key order."""
    name = str(event.get("event", "event"))

    def walk(value: Any, path: str) -> Iterator[tuple[str, float]]:
        if isinstance(value, bool) or value is None:
            return
        if isinstance(value, int | float):
            yield path, float(value)
        elif isinstance(value, str) and value in NON_FINITE:
            yield path, NON_FINITE[value]
        elif isinstance(value, dict):
            for key, item in value.items():
                yield from walk(item, f"{path}/{key}")
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                yield from walk(item, f"{path}/{index}")

    for key, value in event.items():
        if key not in NOT_SCALARS and not key.startswith("_"):  # "_line" and the like: the reader's, not the record's
            yield from walk(value, f"{name}/{key}")


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


def _summary_writer_class():
    try:
        import tensorboard  # noqa: F401  torch.utils.tensorboard needs the package itself
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("TensorBoard output needs the tensorboard package: pip install 'pilotrun[tensorboard]'"
                          ) from None
    return SummaryWriter


class TensorBoardSink:
    """Mirrors the events named in `events` as float64 scalars into event files under `log_dir`."""

    def __init__(self, log_dir: str | Path, events: tuple[str, ...] = MIRRORED_EVENTS) -> None:
        self.events = events
        self.writer = _summary_writer_class()(log_dir=str(log_dir))
        self.scalars_written = 0

    def write(self, event: dict[str, Any]) -> None:
        if event.get("event") not in self.events:
            return
        step, wall_time = int(event.get("step", 0)), event.get("time")
        for tag, value in scalar_fields(event):
            self.writer.add_scalar(tag, value, global_step=step, walltime=wall_time, new_style=True,
                                   double_precision=True)
            self.scalars_written += 1
        self.writer.flush()  # live: a TensorBoard watching the folder sees each event as it is recorded

    def close(self) -> None:
        self.writer.close()


def guarded_tensorboard_sink(log_dir: str | Path) -> GuardedSink:
    """The live mirror the trainer opens: TensorBoard under `log_dir`, failures warned once and ignored."""
    return GuardedSink("tensorboard", lambda: TensorBoardSink(log_dir))


def convert_run_to_tensorboard(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, int]:
    """Write a run's recorded train/val/checkpoint/overflow events as TensorBoard scalars into `out`
    (default RUN/tensorboard, which must be new or empty). Returns (folder, scalars written)."""
    from pilotrun.run.record import METRICS_JSONL, read_metrics_strict

    run_dir = Path(run_dir)
    if not (run_dir / METRICS_JSONL).is_file():
        raise ConfigError(f"{run_dir / METRICS_JSONL} not found: is {run_dir} a run folder?")
    out = Path(out) if out is not None else run_dir / "tensorboard"
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty folder (event files would be appended to): "
                          "choose a new one or remove it")
    sink = TensorBoardSink(out)  # not guarded: here a failure is the command's error, not a warning
    try:
        for event in read_metrics_strict(run_dir):
            sink.write(event)
    finally:
        sink.close()
    return out, sink.scalars_written
