"""A torch.profiler window over a few updates, written into the run folder (`train.profile`).

The loop's `ProfileCallback` owns one `ProfileWindow` and calls `before_update(next_step)` before each update
attempt it profiles and `after_update()` after it (and `close()` when the session ends, so a window cut short
by the end of the run, a signal or an error still writes what it captured). The window opens at the attempt
that would make step `train.profile.start_step` and closes after `train.profile.steps` attempts; a session
that starts past that step never profiles. Nothing is done, and nothing imported, while `steps` is 0.

What is written, into RUN/profile/step-<start>/ (per rank under torchrun: the file names carry the rank):
  trace-rank<R>.json          Chrome trace (chrome://tracing, https://ui.perfetto.dev)
  top_operators-rank<R>.txt   torch's operator table, the `top_operators` most expensive rows
  top_operators-rank<R>.json  the same rows as numbers (microseconds), for scripts The files are written into
  a temp folder and renamed, so a crash never leaves a half-written trace behind.

Profiled updates are slower than others (the profiler records every operator), so the caller must charge them
to their own time phase and leave them out of throughput figures; `active` says when that applies. The
callback runs each such attempt in the "profile" phase, together with the profiler's start and the writing of
its files, and counts it in the window (`profiled_attempts`, `profiled_microbatches`), so that neither the
training seconds nor any training-only throughput figure includes it. Every rank profiles the same attempts
(the ranks wait for each other inside an update, so profiling one alone would slow them all anyway) and writes
its own rank-named files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pilotrun.common.files import plain_folder
from pilotrun.config import ProfileConfig
from pilotrun.training.callbacks.base import PRIORITY_PROFILE, Callback, LoopState

PROFILE_FOLDER = "profile"


def profile_folder(run_dir: str | Path, start_step: int) -> Path:
    return Path(run_dir) / PROFILE_FOLDER / f"step-{start_step:08d}"


class ProfileWindow:
    """Runs torch.profiler around the update attempts of one window; see the module docstring."""

    def __init__(self, config: ProfileConfig, run_dir: str | Path, device_type: str = "cpu", rank: int = 0,
                 write: bool = True) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.device_type = device_type
        self.rank = rank
        self.write = write  # False on ranks that should profile but not write (kept for symmetric overhead)
        self.enabled = config.steps > 0
        self._profiler: Any = None
        self._attempts = 0
        self.finished = False
        self.written: list[Path] = []

    @property
    def active(self) -> bool:
        """True between the window's first before_update and its last after_update."""
        return self._profiler is not None

    def profiles(self, next_step: int) -> bool:
        """Whether the attempt that would make step `next_step` runs under the profiler (the window is open or
        opens at it). Pure: lets the loop charge exactly those attempts to their own time phase without
        leaving the training phase for any other."""
        return self.active or (self.enabled and not self.finished and next_step == self.config.start_step)

    def before_update(self, next_step: int) -> bool:
        """Call before an update attempt that, if applied, makes step `next_step`. Returns `active`."""
        if (
            self.enabled
            and not self.finished
            and self._profiler is None
            and next_step == self.config.start_step
        ):
            self._start()
        return self.active

    def after_update(self) -> list[Path]:
        """Call after each update attempt; closes the window after `steps` attempts. Returns files written."""
        if self._profiler is None:
            return []
        self._attempts += 1
        if self._attempts >= self.config.steps:
            return self._stop()
        return []

    def close(self) -> list[Path]:
        """End of session: a window still open is stopped and written (with the attempts it saw)."""
        return self._stop() if self._profiler is not None else []

    # ------------------------------------------------------------------------------------------ internals
    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities, record_shapes=self.config.record_shapes,
                                 profile_memory=self.config.profile_memory, with_stack=self.config.with_stack)
        self._profiler.__enter__()
        self._attempts = 0

    def _stop(self) -> list[Path]:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self.finished = True
        if not self.write:
            return []
        folder = profile_folder(self.run_dir, self.config.start_step)
        plain_folder(folder.parent)  # RUN/profile as a link is refused, never written through
        temp = folder.parent / f".tmp-{folder.name}-rank{self.rank}-{os.getpid()}"
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
        names = self._write_files(profiler, temp)
        plain_folder(folder)
        self.written = []
        for name in names:  # rename one by one: other ranks write their own files into the same folder
            os.replace(temp / name, folder / name)
            self.written.append(folder / name)
        shutil.rmtree(temp, ignore_errors=True)
        return self.written

    def _write_files(self, profiler: Any, folder: Path) -> list[str]:
        suffix = f"rank{self.rank}"
        sort_key = "self_device_time_total" if self.device_type == "cuda" else "self_cpu_time_total"
        averages = profiler.key_averages(group_by_input_shape=self.config.record_shapes)
        table = averages.table(sort_by=sort_key, row_limit=self.config.top_operators)
        header = (
            f"torch.profiler: {self._attempts} update attempt(s) from the one making step "
            f"{self.config.start_step}, rank {self.rank}, device {self.device_type}; sorted by {sort_key}\n"
        )
        (folder / f"top_operators-{suffix}.txt").write_text(header + table + "\n")
        rows = top_operator_rows(averages, self.config.top_operators, self.device_type)
        (folder / f"top_operators-{suffix}.json").write_text(json.dumps(
            {"start_step": self.config.start_step, "update_attempts": self._attempts, "rank": self.rank,
             "device": self.device_type, "sorted_by": sort_key, "unit": "microseconds", "operators": rows},
            indent=1) + "\n")
        profiler.export_chrome_trace(str(folder / f"trace-{suffix}.json"))
        return [f"trace-{suffix}.json", f"top_operators-{suffix}.txt", f"top_operators-{suffix}.json"]


def top_operator_rows(averages: Any, limit: int, device_type: str) -> list[dict[str, Any]]:
    """The `limit` operators with the most self time (device time on CUDA, else CPU time), as plain
    numbers."""
    def self_device(event: Any) -> float:
        return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))

    key = self_device if device_type == "cuda" else (lambda event: float(event.self_cpu_time_total))
    rows = []
    for event in sorted(averages, key=key, reverse=True)[:limit]:
        row = {"name": event.key, "calls": int(event.count), "self_cpu_us": float(event.self_cpu_time_total),
               "cpu_total_us": float(event.cpu_time_total)}
        if device_type == "cuda":
            row["self_device_us"] = self_device(event)
        if getattr(event, "input_shapes", None):
            row["input_shapes"] = str(event.input_shapes)
        rows.append(row)
    return rows


class ProfileCallback(Callback):
    """Runs the attempts `window.profiles` names under torch.profiler, in the "profile" phase; see above."""

    priority = PRIORITY_PROFILE
    phase = "profile"

    def __init__(self, window: ProfileWindow) -> None:
        self.window = window

    @contextlib.contextmanager
    def around_update(self, loop: LoopState) -> Iterator[None]:
        next_step = loop.step + 1
        if not self.window.profiles(next_step):
            yield
            return
        with loop.account.phase("profile"):
            self.window.before_update(next_step)
            microbatches = loop.window.microbatches
            loop.update_profiled = True
            try:
                yield
            finally:
                loop.update_profiled = False
            loop.window.profiled_attempts += 1
            loop.window.profiled_microbatches += loop.window.microbatches - microbatches
            written = self.window.after_update()
        self._report(loop, written)

    def at_end(self, loop: LoopState) -> None:
        if self.window.active:  # a window cut short by a signal, an error or the end of the run
            with loop.account.phase("profile"):
                written = self.window.close()
            self._report(loop, written)

    @staticmethod
    def _report(loop: LoopState, written: list[Path]) -> None:
        if written and loop.is_main:
            with loop.account.phase("report"):
                loop.say(f"profile: {len(written)} file(s) in {written[0].parent} (this rank's: "
                         f"{', '.join(p.name for p in written)})")
