"""TensorBoard: the record's scalars as classic `simple_value` summaries, written with the tensorboard
package's own event-file writer and protobufs (no torch), so that TensorBoard,
`EventAccumulator(...).Scalars(tag)` and the scripts built on it read them; and `pilotrun tensorboard RUN` /
`export-metrics --to tensorboard`.

Values are float32 (what a classic scalar holds); metrics.jsonl keeps the full-precision float. A resumed
session writes a `SessionLog(START)` event at the step after its checkpoint, TensorBoard's own mark of a
restart: its readers drop every earlier point at or after that step, so the rolled-back steps show once, with
the redone (kept) value. The identity goes in as one text summary `run/identity` (TensorBoard's Text tab); the
verdict as scalars `verdict/go` and `verdict/RULE/figure` at the last step. TensorBoard has no artifacts.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path
from typing import Any

from pilotrun.common.errors import ConfigError
from pilotrun.common.files import plain_folder
from pilotrun.run.mirror import MIRRORED_EVENTS, TrackerMirror, exported_events, identity_tags, kept_history

EVENT_FILE_PREFIX = "events.out.tfevents."
TENSORBOARD_FOLDER = "tensorboard"  # RUN/tensorboard/: where the mirror and the converter write by default


def _tensorboard():
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError:
        raise ConfigError(
            "TensorBoard output needs the tensorboard package: pip install 'pilotrun[tensorboard]'"
        ) from None
    return RecordWriter, event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2


_FILE_NUMBERS = itertools.count()


class EventFile:
    """One TensorBoard event file, written in the caller's thread with the package's own record format.

    The package's EventFileWriter writes from a thread of its own, where a failure (a read-only or full disk)
    is a traceback printed by that thread that no caller can catch or name. Here every write happens where the
    event is given, so that a failure is an OSError the caller handles: the live mirror's guard switches it
    off with one warning, and the converter removes its half-written file and names the folder."""

    def __init__(self, log_dir: Path, record_writer: Any, event_pb2: Any) -> None:
        self._event_pb2 = event_pb2
        while True:  # TensorBoard's own name: the reader orders a folder's files by it
            name = (f"{EVENT_FILE_PREFIX}{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
                    f"{next(_FILE_NUMBERS)}")
            try:
                self.handle = open(log_dir / name, "xb")  # never another writer's file
                break
            except FileExistsError:
                continue
        self.path = log_dir / name
        self.records = record_writer(self.handle)
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def add_event(self, event: Any) -> None:
        self.records.write(event.SerializeToString())

    def flush(self) -> None:
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


class TensorBoardSink(TrackerMirror):
    """Mirrors the events named in `events` as classic scalars into a new event file under `log_dir`; the
    identity is read from `run_dir` (default: the folder above `log_dir` when it holds run.json)."""

    name = "tensorboard"

    def __init__(self, log_dir: str | Path, events: tuple[str, ...] = MIRRORED_EVENTS,
                 run_dir: str | Path | None = None) -> None:
        log_dir = Path(log_dir)
        if run_dir is None:
            run_dir = log_dir.parent
        super().__init__(run_dir, events)
        self._writer_class, self._event_pb2, self._summary_pb2, self._tensor_pb2, self._shape_pb2 = (
            _tensorboard()
        )
        self.log_dir = log_dir
        self.writer: Any = None  # opened by the session's first event: nothing is written before the run is
        self.last_step = 0

    def begin(self, resume: int | None) -> None:
        if (self.run_dir / "run.json").is_file():
            super().begin(resume)
        else:  # a bare event folder (no run around it): scalars only
            self.start({}, resume)
            self.started = True

    def start(self, identity: dict[str, Any], resume_step: int | None) -> None:
        plain_folder(self.log_dir)  # RUN/tensorboard as a link is refused, never written through
        self.writer = EventFile(self.log_dir, self._writer_class, self._event_pb2)
        now = time.time()
        if resume_step is not None:
            session_log = self._event_pb2.SessionLog(status=self._event_pb2.SessionLog.START)
            self.writer.add_event(
                self._event_pb2.Event(wall_time=now, step=resume_step + 1, session_log=session_log)
            )
        if identity:
            text = "\n".join(f"- {key}: `{value}`" for key, value in identity_tags(identity).items())
            self._write_text("run/identity", text, max(resume_step or 0, 0), now)
        self.writer.flush()

    def _write_text(self, tag: str, text: str, step: int, wall_time: float) -> None:
        pb, tensor_pb2, shape_pb2 = self._summary_pb2, self._tensor_pb2, self._shape_pb2
        metadata = pb.SummaryMetadata(plugin_data=pb.SummaryMetadata.PluginData(plugin_name="text"))
        tensor = tensor_pb2.TensorProto(dtype=7, string_val=[text.encode("utf-8")],  # 7: DT_STRING
                                        tensor_shape=shape_pb2.TensorShapeProto(dim=[]))
        summary = pb.Summary(value=[pb.Summary.Value(tag=tag, metadata=metadata, tensor=tensor)])
        self.writer.add_event(self._event_pb2.Event(wall_time=wall_time, step=step, summary=summary))

    def log(self, step: int, scalars: dict[str, float], wall_time: float | None) -> None:
        pb = self._summary_pb2
        summary = pb.Summary(
            value=[pb.Summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
        )
        self.writer.add_event(
            self._event_pb2.Event(
                wall_time=wall_time if wall_time is not None else time.time(), step=step, summary=summary
            )
        )
        self.last_step = max(self.last_step, step)
        self.writer.flush()  # live: a TensorBoard watching the folder sees each event as it is recorded

    def log_verdict(self, verdict: dict[str, Any], step: int) -> None:
        self.log(step, verdict["scalars"], None)
        self._write_text(
            "verdict/statement", f"**{verdict['decision']}**: {verdict['statement']}", step, time.time()
        )
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def open_tensorboard(run_dir: Path, log_dir: Path | None) -> TensorBoardSink:
    """The live mirror of the run in `run_dir`, its event files in `log_dir` (default RUN/tensorboard)."""
    run_dir = Path(run_dir)
    return TensorBoardSink(log_dir if log_dir is not None else run_dir / TENSORBOARD_FOLDER, run_dir=run_dir)


def event_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name.startswith(EVENT_FILE_PREFIX))


def convert_run_to_tensorboard(run_dir: str | Path, out: str | Path | None = None, force: bool = False
                               ) -> tuple[Path, int]:
    """Write a run's kept train/val/checkpoint/overflow events (each step once) and its verdict, if one was
    made, as TensorBoard scalars into `out` (default RUN/tensorboard). A folder that holds only event files
    (this converter's or the live mirror's output) is overwritten: the new file is written first, then the
    old ones are removed. Anything else there is refused unless `force`, which still removes only event
    files. Returns (folder, scalars written)."""
    from pilotrun.run.mirror import read_verdict
    from pilotrun.run.record import METRICS_JSONL

    run_dir = Path(run_dir)
    if not (run_dir / METRICS_JSONL).is_file():
        raise ConfigError(f"{run_dir / METRICS_JSONL} not found: is {run_dir} a run folder?")
    out = Path(out) if out is not None else run_dir / TENSORBOARD_FOLDER
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError(f"--out {out} is not a folder")
    created = not out.exists()
    previous = event_files(out) if out.is_dir() else []
    others = sorted(p.name for p in out.iterdir() if p not in previous) if out.is_dir() else []
    if others and not force:
        raise ConfigError(
            f"--out {out} holds files other than TensorBoard event files ({', '.join(others[:3])}): "
            "choose another folder, or --force to replace only its event files"
        )
    events = kept_history(exported_events(run_dir))
    sink = TensorBoardSink(out, run_dir=run_dir)  # not guarded: here a failure is the command's error
    try:
        try:
            sink.begin(None)
            for event in events:
                sink.write(event)
            verdict = read_verdict(run_dir)
            if verdict is not None:
                sink.log_verdict(verdict, sink.last_step)
        finally:
            sink.close()
    except OSError as exc:  # a full or read-only disk: the half-written file goes, the previous files stay
        if sink.writer is not None:
            sink.writer.path.unlink(missing_ok=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise ConfigError(
            f"--out {out}: writing TensorBoard events failed ({exc.strerror or exc}); nothing was "
            f"written, {len(previous)} previous event file(s) kept"
        ) from None
    for old in previous:
        old.unlink()
    return out, sink.scalars_written
