"""The pilot's view of a training child process: one updating line read from the child's metrics.jsonl.

The pilot runs `pilotrun train` in a child process whose console output goes to a log file; the person at the
terminal sees this line instead: step, the latest window's training loss, wall-clock tokens/s (what the person
waits on, not the training-only figure the verdict uses) and an ETA from this session's wall-clock rate.
`wait_with_progress` polls the child and the record until the child exits or a caller's condition is met; the
record is read as it grows (run/follow.py), each byte once, so a poll costs what the child appended since the
last one, not the whole log again.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from pilotrun.common.errors import PilotrunError
from pilotrun.common.progress import PlainLine
from pilotrun.run.follow import RecordFollower
from pilotrun.run.record import read_metrics_tolerant


class ChildInterrupted(PilotrunError):
    """Ctrl-C reached the pilot while a training child ran; the child saved its checkpoint and stopped."""

    exit_code = 130


def read_complete_events(path: Path) -> list[dict]:
    """The complete events of a metrics.jsonl being written, through the record's tolerant reader (a partial
    last line is a note there, not an event): one read of the whole file, for a look after the child is
    done."""
    if not path.is_file():
        return []
    return read_metrics_tolerant(path.parent).events


class GrowingEvents:
    """The complete events of a child's metrics.jsonl so far, read incrementally: each poll reads only the
    bytes appended since the last (a line being written waits for its newline). The pilot judges nothing here,
    so the follower reads no run.json (the child may not have written it yet) and checks no chain."""

    def __init__(self, metrics: Path) -> None:
        self.follower = RecordFollower(metrics.parent, chained=False)
        self.events: list[dict[str, Any]] = []

    def read(self) -> list[dict[str, Any]]:
        before = self.follower.offset
        found = self.follower.poll()
        # the file was rewritten: the follower reads it again from the start
        if self.follower.offset < before:
            self.events = []
        self.events.extend(found.events)
        return self.events


def progress_figures(events: list[dict], max_steps: int, sessions_before: int = 0
                     ) -> dict[str, float | int | None] | None:
    """step, loss, wall tokens/s and ETA seconds of the newest session in `events`; None before its first
    train window, and None while the record holds no more than `sessions_before` sessions (a resumed child's
    record starts with the killed session's windows, which are not its progress). The ETA divides the updates
    left by this session's rate of updates per wall-clock second."""
    starts = [i for i, e in enumerate(events) if e.get("event") == "session_start"]
    if len(starts) <= sessions_before and sessions_before:
        return None
    session = events[starts[-1]:] if starts else events
    windows = [e for e in session if e.get("event") == "train"]
    if not windows:
        return None
    last, start = windows[-1], session[0]
    done = int(last["step"]) - int(start.get("step", 0))
    elapsed = float(last["time"]) - float(start["time"])
    eta = (max_steps - int(last["step"])) * elapsed / done if done > 0 and elapsed > 0 else None
    return {"step": int(last["step"]), "loss": last.get("loss"),
            "wall_tokens_per_s": (last.get("throughput") or {}).get("wall_tokens_per_s"), "eta_seconds": eta}


def format_progress(figures: dict, max_steps: int) -> str:
    loss = f"{figures['loss']:.4f}" if isinstance(figures.get("loss"), float) else "-"
    tps = figures.get("wall_tokens_per_s")
    eta = figures.get("eta_seconds")
    return (f"step {figures['step']}/{max_steps}  loss {loss}  "
            f"{f'{tps:,.0f}' if tps else '-'} tok/s (wall)  ETA {f'{eta:.0f} s' if eta is not None else '-'}")


class ProgressLine:
    """One line rewritten in place on a terminal; elsewhere (a log, a pipe) or with `mode="plain"`, plain
    lines at every command's cadence (pilotrun/common/progress.py): the first figures at once, then at most
    one line per `interval` seconds, and the last when the child is done."""

    def __init__(
        self,
        out: TextIO,
        prefix: str = "[pilot] ",
        interval: float | None = None,
        mode: str = "auto",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out, self.prefix = out, prefix
        self.tty = mode != "plain" and bool(getattr(out, "isatty", lambda: False)())
        self.plain = PlainLine(out, interval, clock)
        self.last_text = ""
        self.width = 0

    def show(self, text: str) -> None:
        if text == self.last_text:
            return
        self.last_text = text
        line = self.prefix + text
        if self.tty:
            self.out.write("\r" + line.ljust(self.width))
            self.width = max(self.width, len(line))
            self.out.flush()
        else:
            self.plain.offer(line, lambda now: line)

    def finish(self) -> None:
        """Ends the updating line so that what follows starts on a new one; plain, writes the last figures."""
        if self.tty and self.width:
            self.out.write("\n")
            self.out.flush()
        self.width = 0
        if not self.tty:
            self.plain.close()


def wait_with_progress(process: subprocess.Popen, metrics: Path, max_steps: int, line: ProgressLine,
                       poll_seconds: float, timeout_seconds: float,
                       stop_when: Callable[[list[dict]], bool] | None = None, resume_line: str | None = None,
                       sessions_before: int = 0) -> list[dict]:
    """Poll until the child exits (or `stop_when(events)` holds), showing its progress; returns the events
    last read. On timeout the child is killed and TimeoutError raised. On Ctrl-C (which the terminal also
    sends to the child, in the same process group) it waits for the child to finish its update and checkpoint,
    then raises ChildInterrupted naming `resume_line`, the command that continues the run; a second Ctrl-C
    propagates at once."""
    started = time.monotonic()
    try:
        return _poll(process, metrics, max_steps, line, poll_seconds, timeout_seconds, stop_when, started,
                     sessions_before)
    except KeyboardInterrupt:
        line.finish()
        print(
            f"{line.prefix}Ctrl-C: the training process is finishing its update and saving a checkpoint; "
            "Ctrl-C "
            "again stops it now without one",
            file=line.out,
            flush=True,
        )
        code = process.wait()
        how = f"`{resume_line}`" if resume_line else "its own `pilotrun train` command with --resume"
        raise ChildInterrupted(
            f"interrupted: the training process stopped with exit code {code}; its run folder "
            f"{metrics.parent} continues with {how}"
        ) from None
    finally:
        line.finish()


def _poll(process: subprocess.Popen, metrics: Path, max_steps: int, line: ProgressLine, poll_seconds: float,
          timeout_seconds: float, stop_when: Callable[[list[dict]], bool] | None, started: float,
          sessions_before: int = 0) -> list[dict]:
    record = GrowingEvents(metrics)
    while True:
        exited = process.poll() is not None  # asked before reading: a read after the exit holds all it wrote
        events = record.read()
        figures = progress_figures(events, max_steps, sessions_before)
        if figures is not None:
            line.show(format_progress(figures, max_steps))
        if exited or (stop_when is not None and stop_when(events)):
            return events
        if time.monotonic() - started > timeout_seconds:
            process.kill()
            process.wait()
            raise TimeoutError(f"no end within {timeout_seconds:.0f} s")
        time.sleep(poll_seconds)
