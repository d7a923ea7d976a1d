"""`pilotrun pilot` / `make pilot`: the whole rehearsal on the built-in corpus, on a CPU, in minutes.

1. prepare the built-in offline corpus into WORKDIR/data (skipped when a prepared corpus is already there);
2. run `python -m pilotrun train` with the CPU stability recipe as a separate process;
3. once metrics.jsonl shows a step past the midpoint and a checkpoint is committed on disk, kill that
   process with SIGKILL: a real, unannounced interruption (no handler runs, no final checkpoint). The
   process is told that step (train/pilot_handshake.py) and stops itself there, so however fast its updates
   are, the kill lands past the midpoint and before the end, never after its final checkpoint;
4. resume it with `--resume` as a second process, which must reach max_steps;
5. summarize with `--require-step max_steps`, then the verdict and its report; exit 0 GO, 1 NO-GO.

The training runs in child processes on purpose: only a separate process can be killed for real, and
the resumed process then has nothing in memory from the first, exactly like a crashed job on a cluster.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from pilotrun.commands.child_progress import ProgressLine, wait_with_progress
from pilotrun.errors import PilotrunError
from pilotrun.run.record import CHECKPOINTS_DIR, METRICS_JSONL
from pilotrun.training.pilot_handshake import wait_until_stopped

DEFAULT_RECIPE = "stability.yaml"
DEFAULT_TOKENIZER = "bpe:2048"
PILOT_MARKER = ".pilotrun-pilot-run"  # says workdir/run was made by the pilot: only then is it replaced


class PilotError(PilotrunError):
    """The rehearsal could not be carried out (missing recipe, a training process that failed)."""


@dataclass
class PilotResult:
    exit_code: int  # 0 GO, 1 NO-GO
    decision: str
    run_dir: Path
    report_dir: Path
    killed_at_step: int
    committed_checkpoint: int
    seconds: float
    phase_seconds: dict[str, float]  # prepare, train_until_kill, resume, report: where the pilot's time went


def configs_dir() -> Path:
    """The recipes shipped inside the package (the repository's configs/ links to the same folder)."""
    from pilotrun.config import packaged_configs_dir

    folder = packaged_configs_dir()
    if not folder.is_dir():
        raise PilotError(f"packaged recipes not found at {folder} (a broken install? pass --config PATH to use a "
                         "recipe elsewhere)")
    return folder


def _say(out: TextIO, text: str) -> None:
    print(f"[pilot] {text}", file=out, flush=True)


def _committed_checkpoints(run_dir: Path) -> list[int]:
    from pilotrun.training.checkpoint import Checkpointer

    if not (run_dir / CHECKPOINTS_DIR).is_dir():
        return []
    return Checkpointer(run_dir, keep=1).committed_steps()


def _train_command(config: Path, data_dir: Path, run_dir: Path, overrides: list[str], resume: bool,
                   stop_past_step: int | None = None) -> list[str]:
    command = [sys.executable, "-m", "pilotrun", "train", "--config", str(config), "--data", str(data_dir),
               "--run-dir", str(run_dir)]
    for override in overrides:
        command += ["--set", override]
    if stop_past_step is not None:  # the kill point: the process stops itself there (training/pilot_handshake.py)
        command += ["--stop-past-step", str(stop_past_step)]
    return command + (["--resume"] if resume else [])


def _kill_past_midpoint(process: subprocess.Popen, run_dir: Path, midpoint: int, max_steps: int, line: ProgressLine,
                        poll_seconds: float, timeout_seconds: float) -> tuple[int, int]:
    """Wait until metrics.jsonl shows a step past the midpoint and a checkpoint event, then SIGKILL at once.

    The decision reads only metrics.jsonl (a `checkpoint` event is written after its checkpoint is
    committed), so nothing slow sits between seeing the step and killing; which checkpoints are committed on
    disk is read after the kill, and that is what the resume will find.
    """
    def past_midpoint(events: list[dict]) -> bool:
        steps = [e.get("step", 0) for e in events if e.get("event") == "train"]
        return bool(steps) and max(steps) > midpoint and any(e.get("event") == "checkpoint" for e in events)

    try:
        events = wait_with_progress(process, run_dir / METRICS_JSONL, max_steps, line, poll_seconds,
                                    timeout_seconds, stop_when=past_midpoint)
    except TimeoutError:
        raise PilotError(f"training did not pass step {midpoint} within {timeout_seconds:.0f} s") from None
    if not past_midpoint(events):
        raise PilotError(f"the first training process exited (code {process.returncode}) before it could be "
                         f"interrupted past step {midpoint}; see {run_dir.parent / 'train-1.log'}")
    # It stops itself right after writing the line just read; the wait is a guard for a trainer that did not.
    wait_until_stopped(process.pid, timeout_seconds=60)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    committed = _committed_checkpoints(run_dir)
    if not committed:
        raise PilotError(f"no committed checkpoint in {run_dir / CHECKPOINTS_DIR} after the kill")
    return max(e.get("step", 0) for e in events if e.get("event") == "train"), max(committed)


def run_pilot(workdir: str | Path = "pilot-work", config: str | Path | None = None, overrides: list[str] | None = None,
              tokenizer: str = DEFAULT_TOKENIZER, out: TextIO | None = None, poll_seconds: float = 0.1,
              timeout_seconds: float = 1800.0) -> PilotResult:
    from pilotrun.config import load_run_config, resolve_recipe_path
    from pilotrun.errors import ConfigError
    from pilotrun.report.html import write_report
    from pilotrun.report.summarize import format_summary, summarize_run
    from pilotrun.report.verdict import format_verdict, judge_summary

    out = out or sys.stdout
    started = time.monotonic()
    workdir = Path(workdir)
    config_path = Path(config) if config is not None else configs_dir() / DEFAULT_RECIPE
    try:
        config_path = resolve_recipe_path(config_path)  # a packaged recipe may be named: `--config smoke`
    except ConfigError:
        raise PilotError(f"recipe not found: {config_path}") from None
    overrides = list(overrides or [])
    recipe = load_run_config(config_path, overrides)  # bad keys fail here, before anything is written
    pinned_threads = recipe.train.num_threads == 0
    if pinned_threads:
        # Measured on a busy 2-core machine: torch's default intra-op threads ran the stability recipe ~10x
        # slower than one thread (oversubscription); one thread keeps the rehearsal within minutes anywhere.
        overrides.append("train.num_threads=1")
    max_steps = recipe.train.max_steps
    midpoint = max_steps // 2
    if recipe.train.checkpoint_every == 0 or recipe.train.checkpoint_every > midpoint:
        raise PilotError(f"train.checkpoint_every ({recipe.train.checkpoint_every}) must be between 1 and half of "
                         f"max_steps ({midpoint}) so that a checkpoint exists before the kill")
    run_dir = workdir / "run"
    marker = workdir / PILOT_MARKER  # beside the run folder: train refuses a run folder that is not empty
    if os.path.lexists(run_dir):
        # Only a run folder this command made (its marker beside it, a real folder, not a link) is ever deleted.
        if run_dir.is_symlink() or not run_dir.is_dir() or not marker.is_file() or marker.is_symlink():
            raise PilotError(f"{run_dir} exists and was not created by `pilotrun pilot` (no {marker}): move it "
                             "away or choose another --workdir")
    workdir.mkdir(parents=True, exist_ok=True)

    phases: dict[str, float] = {}
    phase_start = time.monotonic()
    data_dir = workdir / "data"
    if (data_dir / "metadata.json").is_file():
        _say(out, f"using the corpus already prepared in {data_dir}")
    else:
        from pilotrun.data.prepare import prepare_corpus

        _say(out, f"preparing the built-in corpus into {data_dir} (tokenizer {tokenizer})")
        manifest = prepare_corpus(data_dir, source="builtin", tokenizer=tokenizer, force=data_dir.exists())
        _say(out, f"prepared: {manifest['splits']['train']['tokens']:,} training tokens, "
                  f"{manifest['splits']['val']['tokens']:,} validation tokens")

    phases["prepare"] = time.monotonic() - phase_start
    if os.path.lexists(run_dir):
        _say(out, f"replacing the previous pilot run in {run_dir}")
        shutil.rmtree(run_dir)
    marker.write_text("the run folder beside this file was created by `pilotrun pilot`; the next pilot in this "
                      "workdir replaces it\n")

    phase_start = time.monotonic()
    if pinned_threads:
        _say(out, "the recipe leaves train.num_threads to torch: the pilot pins 1 (override with --set "
                  "train.num_threads=N)")
    _say(out, f"training {config_path.name} to step {max_steps}; it will be killed (SIGKILL) past step {midpoint} "
              f"(the child's output: {workdir / 'train-1.log'})")
    with open(workdir / "train-1.log", "w") as log:
        first = subprocess.Popen(_train_command(config_path, data_dir, run_dir, overrides, resume=False,
                                                stop_past_step=midpoint),
                                 stdout=log, stderr=subprocess.STDOUT)
        try:
            killed_at, checkpoint = _kill_past_midpoint(first, run_dir, midpoint, max_steps, ProgressLine(out),
                                                        poll_seconds, timeout_seconds)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
    _say(out, f"killed the training process at logged step {killed_at}; newest committed checkpoint: step {checkpoint}")

    phases["train_until_kill"] = time.monotonic() - phase_start
    phase_start = time.monotonic()
    _say(out, f"resuming with --resume to step {max_steps} (the child's output: {workdir / 'train-2.log'})")
    with open(workdir / "train-2.log", "w") as log:
        second = subprocess.Popen(_train_command(config_path, data_dir, run_dir, overrides, resume=True),
                                  stdout=log, stderr=subprocess.STDOUT)  # no kill point: it runs to the end
        try:
            wait_with_progress(second, run_dir / METRICS_JSONL, max_steps, ProgressLine(out), poll_seconds,
                               timeout_seconds)
        except TimeoutError:
            raise PilotError(f"the resumed training did not finish within {timeout_seconds:.0f} s") from None
    if second.returncode != 0:
        tail = (workdir / "train-2.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise PilotError(f"the resumed training process failed (exit {second.returncode}): {' | '.join(tail)}")

    phases["resume"] = time.monotonic() - phase_start
    phase_start = time.monotonic()
    summary = summarize_run(run_dir, require_step=max_steps)
    print(format_summary(summary), file=out, flush=True)
    print(file=out)
    verdict = judge_summary(summary)
    report_dir = write_report(verdict)
    print(format_verdict(verdict), file=out, flush=True)
    phases["report"] = time.monotonic() - phase_start
    seconds = time.monotonic() - started
    print(f"report: {report_dir / 'report.html'}", file=out)
    _say(out, f"done in {seconds:.0f} s wall: " + ", ".join(f"{k.replace('_', ' ')} {v:.0f} s" for k, v in phases.items()))
    return PilotResult(exit_code=0 if verdict.decision == "GO" else 1, decision=verdict.decision, run_dir=run_dir,
                       report_dir=report_dir, killed_at_step=killed_at, committed_checkpoint=checkpoint,
                       seconds=seconds, phase_seconds=phases)
