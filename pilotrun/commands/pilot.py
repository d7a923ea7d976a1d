"""`pilotrun pilot` / `make pilot`: the whole rehearsal of a candidate; by default the built-in demo on a CPU.

1. the data: `--data DIR` (a prepared folder, read only), or prepared into WORKDIR/data from `--source` and
   `--tokenizer` (default: the built-in offline corpus). A WORKDIR/data already prepared is reused when its
   manifest is what this call would prepare (data/identity.py) and refused, before anything is changed, when
   it is not; `--reprepare` prepares it again;
2. run `pilotrun train` with the recipe (`--config`, default the CPU stability recipe) as a separate process,
   or under torchrun with `--nproc-per-node N`;
3. once metrics.jsonl shows a step past the kill point (`--interrupt-at`, default the midpoint) and a
   checkpoint is committed on disk, kill it with SIGKILL: a real, unannounced interruption (no handler runs,
   no final checkpoint). The training process is told that step (training/callbacks/kill_point.py) and stops
   itself there, so however fast its updates are, the kill lands past the point and before the end. Under
   torchrun every rank stops itself at the same update and the launcher and every worker are killed at once
   (pilot_process.py);
4. resume it with `--resume` as a second process (tree), which must reach max_steps;
5. with `--check lr,batch`, the learning-rate and batch checks (commands/tune.py) on the finished run;
6. summarize with `--require-step max_steps`, then the verdict and its report; with `--freeze LOCK`, a GO is
   frozen into a recipe lock (commands/freeze.py). Exit 0 GO, 1 NO-GO, 128 + the signal's number after a stop
   signal (130 SIGINT, 143 SIGTERM, 129 SIGHUP: pilotrun/common/stop_signals.py).

The training runs in child processes on purpose: only a separate process can be killed for real, and the
resumed process then has nothing in memory from the first, exactly like a crashed job on a cluster.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from pilotrun.commands.child_progress import ProgressLine, read_complete_events, wait_with_progress
from pilotrun.commands.next_commands import long_run_commands, shell_line, train_words
from pilotrun.commands.pilot_process import PilotStopped, StopForwarding, TrainingChild
from pilotrun.common.errors import PilotrunError
from pilotrun.common.stop_signals import signal_name
from pilotrun.run.record import CHECKPOINTS_DIR, METRICS_JSONL

DEFAULT_RECIPE = "stability.yaml"
DEFAULT_SOURCE = "builtin"
DEFAULT_TOKENIZER = "bpe:2048"
PILOT_MARKER = ".pilotrun-pilot-run"  # says workdir/run was made by the pilot: only then is it moved aside
# What the pilot asks prepare for besides --source and --tokenizer (prepare's defaults), spelled out: a reused
# WORKDIR/data is compared with exactly what this pilot would prepare, whatever prepare's defaults become.
PREPARE_OPTIONS = {
    "train_tokens": None,
    "val_fraction": 0.01,
    "shard_tokens": 2**24,
    "seed": 0,
    "shuffle_buffer": 10000,
    "shuffle_buffer_bytes": 64 << 20,
    "text_field": "text",
    "eos": None,
}


class PilotError(PilotrunError):
    """The rehearsal could not be carried out (missing recipe, a training process that failed)."""


class PilotInterrupted(PilotrunError):
    """A stop signal stopped the rehearsal; the message says where it stood and how to continue."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


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
    killed_pids: list[int]  # every process of the first training tree, each SIGKILLed and gone
    lock: Path | None = None  # the recipe lock written by --freeze after a GO


def configs_dir() -> Path:
    """The recipes shipped inside the package (the repository's configs/ links to the same folder)."""
    from pilotrun.config import packaged_configs_dir

    folder = packaged_configs_dir()
    if not folder.is_dir():
        raise PilotError(
            f"packaged recipes not found at {folder} (a broken install? pass --config PATH to use a "
            "recipe elsewhere)"
        )
    return folder


def _say(out: TextIO, text: str) -> None:
    print(f"[pilot] {text}", file=out, flush=True)


def _committed_checkpoints(run_dir: Path) -> list[int]:
    from pilotrun.training.checkpoint.checkpointer import Checkpointer

    if not (run_dir / CHECKPOINTS_DIR).is_dir():
        return []
    return Checkpointer(run_dir, keep=1).committed_steps()


def _train_args(config: Path, data_dir: Path, run_dir: Path, overrides: list[str], resume: bool,
                stop_past_step: int | None = None) -> list[str]:
    # The kill point: the process stops itself there (training/callbacks/kill_point.py).
    kill = ["--stop-past-step", str(stop_past_step)] if stop_past_step is not None else []
    return train_words(
        config=config, data=data_dir, run_dir=run_dir, overrides=overrides, resume=resume, extra=kill
    )


def kill_point_step(interrupt_at: int, max_steps: int, log_every: int, checkpoint_every: int) -> int | None:
    """The step the first training process stops itself at (training/callbacks/kill_point.py SelfStopPoint):
    the first step past `interrupt_at` that closes a window (every `log_every`, and at every checkpoint) once
    a checkpoint exists, with updates left; None when no step qualifies."""
    for step in range(max(interrupt_at + 1, checkpoint_every), max_steps):
        if (log_every > 0 and step % log_every == 0) or step % checkpoint_every == 0:
            return step
    return None


def _kill_point(recipe, interrupt_at: int | None) -> tuple[int, int]:
    """(the --stop-past-step handed to the first process, the step it will stop at), or a PilotError."""
    t = recipe.train
    point = t.max_steps // 2 if interrupt_at is None else interrupt_at
    if not 0 <= point < t.max_steps:
        raise PilotError(f"--interrupt-at {point}: must be between 0 and max_steps - 1 ({t.max_steps - 1})")
    if t.checkpoint.every <= 0:
        raise PilotError(
            f"train.checkpoint.every ({t.checkpoint.every}) must be at least 1 so that a checkpoint "
            "exists before the kill"
        )
    stop = kill_point_step(point, t.max_steps, t.log.every, t.checkpoint.every)
    if stop is None:
        raise PilotError(f"the kill cannot land past step {point}: no logged step after it has a committed "
                         f"checkpoint (train.checkpoint.every {t.checkpoint.every}) and updates left before "
                         f"max_steps {t.max_steps}; lower --interrupt-at or train.checkpoint.every")
    return point, stop


def _kill_past_point(
    child: TrainingChild,
    run_dir: Path,
    point: int,
    max_steps: int,
    line: ProgressLine,
    stops: StopForwarding,
    poll_seconds: float,
    timeout_seconds: float,
) -> tuple[int, int, list[int]]:
    """Wait until metrics.jsonl shows a step past the point and a checkpoint event, wait for every training
    process to have stopped itself there, then SIGKILL the whole tree at once.

    The decision reads only metrics.jsonl (a `checkpoint` event is written after its checkpoint is committed);
    which checkpoints are committed on disk is read after the kill, and that is what the resume will find."""
    def past_point(events: list[dict]) -> bool:
        steps = [e.get("step", 0) for e in events if e.get("event") == "train"]
        return bool(steps) and max(steps) > point and any(e.get("event") == "checkpoint" for e in events)

    try:
        events = wait_with_progress(
            child.process,
            run_dir / METRICS_JSONL,
            max_steps,
            line,
            poll_seconds,
            timeout_seconds,
            stop_when=lambda ev: past_point(ev) or stops.signum is not None,
        )
    except TimeoutError:
        child.kill_tree()
        raise PilotError(
            f"training did not pass step {point} within {timeout_seconds:.0f} s (its last line: "
            f"{child.cause()}; see {child.log})"
        ) from None
    if stops.signum is not None:
        return 0, 0, []
    if not past_point(events):
        raise PilotError(f"the first training process exited (code {child.poll()}) before it could be "
                         f"interrupted past step {point}: {child.cause()} (its output: {child.log})")
    # Every rank stops itself right after the line just read; the wait is a guard for a trainer that did not.
    child.wait_until_stopped(timeout_seconds=60)
    killed = child.kill_tree()
    committed = _committed_checkpoints(run_dir)
    if not committed:
        raise PilotError(f"no committed checkpoint in {run_dir / CHECKPOINTS_DIR} after the kill")
    return max(e.get("step", 0) for e in events if e.get("event") == "train"), max(committed), killed


def _prepare_data(workdir: Path, data: str | Path | None, source: str, tokenizer: str, out: TextIO,
                  progress: str = "auto", reprepare: bool = False, val_warnings=None) -> Path:
    if data is not None:
        data_dir = Path(data)
        if data_dir.is_file():  # a mixture file: checked here, its sources opened by train
            from pilotrun.data.mixture import parse_mixture

            parse_mixture(data_dir)
            _say(out, f"using the data mixture {data_dir}")
            return data_dir
        if not (data_dir / "metadata.json").is_file():
            raise PilotError(
                f"--data {data_dir}: no metadata.json there (prepare it with `pilotrun prepare --out "
                f"{data_dir} ...`)"
            )
        _say(out, f"using the prepared data in {data_dir}")
        return data_dir
    data_dir = workdir / "data"
    if (data_dir / "metadata.json").is_file() and not reprepare:
        _say(out, _reused(data_dir, source, tokenizer))
        return data_dir
    from pilotrun.data.prepare import prepare_corpus

    _say(out, f"preparing {source} into {data_dir} (tokenizer {tokenizer})")
    manifest = prepare_corpus(data_dir, source=source, tokenizer=tokenizer, force=data_dir.exists(),
                              progress=progress, val_warnings=val_warnings, **PREPARE_OPTIONS)
    _say(out, f"prepared: {manifest['splits']['train']['tokens']:,} training tokens, "
              f"{manifest['splits']['val']['tokens']:,} validation tokens")
    return data_dir


def _reused(data_dir: Path, source: str, tokenizer: str) -> str:
    """The line saying WORKDIR/data is reused; a PilotError naming each difference when it holds other data
    than this call asks for (raised before the run folder or anything else is touched)."""
    from pilotrun.data.identity import prepared_differences, request_options
    from pilotrun.data.shards import load_manifest, metadata_sha256

    manifest = load_manifest(str(data_dir))
    found = prepared_differences(manifest, source, tokenizer, request_options(**PREPARE_OPTIONS))
    if found:
        raise PilotError(
            f"{data_dir} was prepared from other inputs than this call asks for ({'; '.join(found)}): "
            f"choose another --workdir, or pass --reprepare to prepare {data_dir} again (it is replaced "
            "once the new data is complete)"
        )
    return (
        f"reusing the data already prepared in {data_dir}: the same source, tokenizer and options as this "
        f"call (metadata_sha256 {metadata_sha256(manifest)[:16]}; --reprepare prepares it again)"
    )


def _check_run_dir(run_dir: Path, marker: Path, freeze: str | Path | None = None) -> None:
    if os.path.lexists(run_dir):
        # Only a run folder this command made (its marker beside it, a real folder, not a link) is ever moved.
        if run_dir.is_symlink() or not run_dir.is_dir() or not marker.is_file() or marker.is_symlink():
            raise PilotError(
                f"{run_dir} exists and was not created by `pilotrun pilot` (no {marker}): move it "
                "away or choose another --workdir"
            )
        lock = _lock_naming(run_dir, freeze)
        if lock is not None:
            raise PilotError(
                f"{run_dir} is the pilot run the recipe lock {lock} was frozen from: a new pilot in this "
                "workdir would move that evidence from where the lock says it is; choose another "
                "--workdir"
            )


def _lock_naming(run_dir: Path, freeze: str | Path | None = None) -> Path | None:
    """A recipe lock whose pilot is `run_dir`, looked for where pilots put their locks: the workdir, the
    folder that holds it (the README's layout: `--workdir runs/pilot --freeze runs/recipe.lock.json`) and the
    folder of this call's `--freeze`. A lock elsewhere cannot be found; it still names its run folder."""
    folders = [run_dir.parent, run_dir.parent.parent] + ([Path(freeze).parent] if freeze is not None else [])
    seen: set[Path] = set()
    for folder in folders:
        if folder.resolve() in seen or not folder.is_dir():
            continue
        seen.add(folder.resolve())
        found = _lock_in_folder(folder, str(run_dir.resolve()))
        if found is not None:
            return found
    return None


def _lock_in_folder(folder: Path, where: str) -> Path | None:
    """The first recipe lock among `folder`'s JSON files whose pilot run folder is `where`."""
    import json

    from pilotrun.run.recipe_lock import LOCK_FORMAT

    for path in sorted(folder.iterdir()):
        if (
            path.suffix != ".json"
            or path.is_symlink()
            or not path.is_file()
            or path.stat().st_size > 64 << 20
        ):
            continue
        try:
            lock = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(lock, dict) and lock.get("format") == LOCK_FORMAT and \
                isinstance(lock.get("pilot"), dict) and lock["pilot"].get("run_dir") == where:
            return path
    return None


def _keep_previous_run(workdir: Path, run_dir: Path) -> Path:
    """Moves the previous pilot's run folder (and its children's logs) to the first free `run-N` beside it:
    an earlier pilot is evidence, never deleted by the next one."""
    number = 1
    while any(os.path.lexists(workdir / name) for name in (f"run-{number}", f"run-{number}-train-1.log")):
        number += 1
    kept = workdir / f"run-{number}"
    os.rename(run_dir, kept)
    for log in ("train-1.log", "train-2.log"):
        if (workdir / log).is_file():
            os.rename(workdir / log, workdir / f"{kept.name}-{log}")
    return kept


def _where_it_stood(run_dir: Path, max_steps: int) -> str:
    events = read_complete_events(run_dir / METRICS_JSONL)
    steps = [e.get("step", 0) for e in events if e.get("event") == "train"]
    committed = _committed_checkpoints(run_dir)
    return (f"step {max(steps) if steps else 0} of {max_steps}; newest committed checkpoint: "
            f"{f'step {committed[-1]}' if committed else 'none'}")


def run_pilot(
    workdir: str | Path = "pilot-work",
    config: str | Path | None = None,
    overrides: list[str] | None = None,
    tokenizer: str = DEFAULT_TOKENIZER,
    out: TextIO | None = None,
    poll_seconds: float = 0.1,
    timeout_seconds: float = 1800.0,
    *,
    data: str | Path | None = None,
    source: str = DEFAULT_SOURCE,
    interrupt_at: int | None = None,
    nproc_per_node: int | None = None,
    freeze: str | Path | None = None,
    progress: str = "auto",
    reprepare: bool = False,
    check: tuple[str, ...] = (),
) -> PilotResult:
    from pilotrun.common.errors import ConfigError
    from pilotrun.config import load_run_config, resolve_recipe_path

    out = out or sys.stdout
    workdir = Path(workdir)
    config_path = Path(config) if config is not None else configs_dir() / DEFAULT_RECIPE
    try:
        # a packaged recipe may be named: `--config smoke`
        config_path = resolve_recipe_path(config_path).resolve()
    except ConfigError:
        raise PilotError(f"recipe not found: {config_path}") from None
    overrides = list(overrides or [])
    recipe = load_run_config(config_path, overrides)  # bad keys fail here, before anything is written
    if nproc_per_node is not None and nproc_per_node < 1:
        raise PilotError(f"--nproc-per-node {nproc_per_node}: must be at least 1")
    if freeze is not None and Path(freeze).exists():
        raise PilotError(
            f"--freeze {freeze}: already exists; a lock is never overwritten (choose another path)"
        )
    point, stop = _kill_point(recipe, interrupt_at)
    run_dir = workdir / "run"
    marker = workdir / PILOT_MARKER  # beside the run folder: train refuses a run folder that is not empty
    _check_run_dir(run_dir, marker, freeze)
    stops = StopForwarding()
    with stops.installed():
        try:
            return _rehearse(
                workdir,
                run_dir,
                marker,
                config_path,
                overrides,
                recipe,
                data,
                source,
                tokenizer,
                point,
                stop,
                nproc_per_node,
                freeze,
                progress,
                stops,
                out,
                poll_seconds,
                timeout_seconds,
                demo=config is None,
                reprepare=reprepare,
                check=check,
            )
        except PilotStopped as stopped:
            stops.signum = stopped.signum
            raise _interrupted(
                stops, "between its steps", run_dir, recipe.train.max_steps, config_path
            ) from None


def _interrupted(stops: StopForwarding, doing: str, run_dir: Path, max_steps: int, config: Path,
                 data_dir: Path | None = None, overrides: list[str] = (), nproc: int | None = None
                 ) -> PilotInterrupted:
    name = signal_name(stops.signum)
    if data_dir is None:
        how = (
            "rerun the same `pilotrun pilot` command to continue (the prepare continues from its last commit)"
        )
    else:
        how = (
            f"continue the run with `{_resume_line(config, data_dir, run_dir, overrides, nproc)}` and judge "
            "it with "
            f"`{shell_line(['pilotrun', 'verdict', run_dir])}`, or rerun `pilotrun pilot` to rehearse again "
            "from the start"
        )
    where = f" ({_where_it_stood(run_dir, max_steps)})" if (run_dir / METRICS_JSONL).is_file() else ""
    return PilotInterrupted(f"pilotrun pilot: stopped by {name} {doing}{where}; {how}", stops.exit_code)


def _resume_line(config: Path, data_dir: Path, run_dir: Path, overrides: list[str], nproc: int | None) -> str:
    """The `pilotrun train --resume` that continues the pilot's run: the second child's own command, every
    `--set` the pilot was given (and the demo's thread pin) included, so that it loads the same recipe; under
    torchrun on as many processes (another world size is refused)."""
    launcher = (
        ["torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", "pilotrun"] if nproc else ["pilotrun"]
    )
    return shell_line([*launcher, *_train_args(config, data_dir, run_dir, overrides, resume=True)])


def _rehearse(workdir: Path, run_dir: Path, marker: Path, config_path: Path, overrides: list[str], recipe,
              data, source: str, tokenizer: str, point: int, stop: int, nproc: int | None, freeze,
              progress: str, stops: StopForwarding, out: TextIO, poll_seconds: float,
              timeout_seconds: float, demo: bool, reprepare: bool = False,
              check: tuple[str, ...] = ()) -> PilotResult:
    from pilotrun.data.prepare_state import PrepareInterrupted

    started = time.monotonic()
    max_steps = recipe.train.max_steps
    workdir.mkdir(parents=True, exist_ok=True)
    phases: dict[str, float] = {}
    phase_start = time.monotonic()
    try:
        data_dir = _prepare_data(workdir, data, source, tokenizer, out, progress, reprepare,
                                 _val_warnings_for(recipe, config_path, nproc))
    except PrepareInterrupted as exc:
        stops.signum = exc.signum
        raise _interrupted(stops, f"while preparing the data in {workdir / 'data'}", run_dir, max_steps,
                           config_path) from None
    phases["prepare"] = time.monotonic() - phase_start

    if demo and recipe.train.num_threads == 0:
        # The built-in demo runs on whatever machine `make pilot` is typed on, often a small one shared with
        # other work, where two threads can run far slower than one (spinning OpenMP threads losing their time
        # slices; BENCHMARKS.md, "Intra-op threads"); one thread keeps it within minutes anywhere. A user's
        # own recipe with train.num_threads 0 has its count chosen by the training process itself from what it
        # can use (training/thread_choice.py: the cores free at start, a short timing of its update), recorded
        # in run.json and kept by the resume.
        overrides = [*overrides, "train.num_threads=1"]
        _say(
            out,
            "the demo recipe leaves train.num_threads at its default: the pilot pins 1 (override with --set "
            "train.num_threads=N)",
        )
    if os.path.lexists(run_dir):
        _say(
            out, f"kept the previous pilot run as {_keep_previous_run(workdir, run_dir)} (its logs beside it)"
        )
    marker.write_text(
        "the run folder beside this file was created by `pilotrun pilot`; the next pilot in this "
        "workdir moves it to the first free run-N beside it\n"
    )

    phase_start = time.monotonic()
    ranks = f" under torchrun on {nproc} processes" if nproc else ""
    _say(
        out,
        f"training {config_path.name} to step {max_steps}{ranks}; it will be killed (SIGKILL) past step "
        f"{point}, at step {stop} (the child's output: {workdir / 'train-1.log'})",
    )
    first = TrainingChild(
        _train_args(config_path, data_dir, run_dir, overrides, resume=False, stop_past_step=point),
        workdir / "train-1.log",
        nproc,
    )
    try:
        with stops.running(first):
            killed_at, checkpoint, killed = _kill_past_point(first, run_dir, point, max_steps,
                                                             ProgressLine(out, mode=progress), stops,
                                                             poll_seconds, timeout_seconds)
            if stops.signum is not None:
                _wait_stopped_child(first, timeout_seconds)
                raise _interrupted(stops, "while training the first session", run_dir, max_steps, config_path,
                                   data_dir, overrides, nproc)
    finally:
        if first.poll() is None:
            first.kill_tree()
    _say(out, _threads_line(run_dir))
    tree = f" and its {len(killed) - 1} descendant(s), every one by pid" if nproc else ""
    _say(
        out,
        f"killed the training process{tree} at logged step {killed_at}; newest committed checkpoint: step "
        f"{checkpoint}",
    )

    phases["train_until_kill"] = time.monotonic() - phase_start
    phase_start = time.monotonic()
    _say(out, f"resuming with --resume to step {max_steps} (the child's output: {workdir / 'train-2.log'})")
    sessions_before = sum(
        e.get("event") == "session_start" for e in read_complete_events(run_dir / METRICS_JSONL)
    )
    second = TrainingChild(_train_args(config_path, data_dir, run_dir, overrides, resume=True),
                           workdir / "train-2.log", nproc)  # no kill point: it runs to the end
    try:
        with stops.running(second):
            wait_with_progress(
                second.process,
                run_dir / METRICS_JSONL,
                max_steps,
                ProgressLine(out, mode=progress),
                poll_seconds,
                timeout_seconds,
                resume_line=_resume_line(config_path, data_dir, run_dir, overrides, nproc),
                sessions_before=sessions_before,
            )
    except TimeoutError:
        raise PilotError(
            f"the resumed training did not finish within {timeout_seconds:.0f} s (its last line: "
            f"{second.cause()}; see {second.log})"
        ) from None
    finally:
        if second.poll() is None:
            second.kill_tree()
    if stops.signum is not None:
        raise _interrupted(
            stops,
            "while the resumed session trained",
            run_dir,
            max_steps,
            config_path,
            data_dir,
            overrides,
            nproc,
        )
    if second.process.returncode != 0:
        raise PilotError(
            f"the resumed training process failed (exit {second.process.returncode}): {second.cause()} "
            f"(its output: {second.log})"
        )
    phases["resume"] = time.monotonic() - phase_start
    if check:
        _run_checks(run_dir, check, data_dir, nproc, out, phases)
    return _judge(run_dir, max_steps, freeze, out, started, phases, killed_at, checkpoint, killed, data_dir)


def _run_checks(run_dir: Path, check: tuple[str, ...], data_dir: Path | None, nproc: int | None, out: TextIO,
                phases: dict[str, float]) -> None:
    """`--check lr,batch`: `pilotrun tune` on the finished pilot, before the verdict, so that its findings are
    in the verdict, the report and a `--freeze` lock. A pilot the checks cannot branch (too short, no
    checkpoint past warm-up kept) is said in one line and judged as it is."""
    from pilotrun.commands.tune import TuneError, tune

    phase_start = time.monotonic()
    try:
        tune(run_dir, check, data=data_dir, nproc=nproc, out=out)
    except TuneError as exc:
        _say(out, f"checks not run: {exc}")
    phases["checks"] = time.monotonic() - phase_start


def _val_warnings_for(recipe, config_path: Path, nproc: int | None):
    """The prepare's check of its val split against this pilot's recipe (its evaluation size on its ranks),
    not the packaged stability recipe's; none where the recipe does not evaluate."""
    from pilotrun.data.reader import val_split_warnings

    t = recipe.train
    return lambda val_tokens: (
        []
        if t.eval.every <= 0
        else val_split_warnings(
            val_tokens,
            t.batch_size,
            t.seq_len,
            t.eval.batches,
            nproc or 1,
            what=f"the recipe {config_path.name}",
        )
    )


def _threads_line(run_dir: Path) -> str:
    """The thread count the first training session ran with and where it came from (run.json), for the person
    at the terminal: the children's own plan lines go to their logs."""
    from pilotrun.common.errors import PilotrunError
    from pilotrun.run.record import read_run_json

    try:
        sessions = read_run_json(run_dir).get("sessions") or [{}]
        threads = (sessions[0].get("hardware") or {}).get("threads") or {}
    except (PilotrunError, AttributeError):
        threads = {}
    how = {"measured": "measured on the recipe's update: " + ", ".join(
        f"{k} thread(s) {v:.3g} s/update" for k, v in (threads.get("seconds_per_update") or {}).items()),
        "set": "train.num_threads"}.get(threads.get("how"), threads.get("why") or "not recorded")
    return f"the training ran {threads.get('threads', '?')} intra-op thread(s) ({how})"


def _wait_stopped_child(child: TrainingChild, timeout_seconds: float) -> None:
    """A stop signal was passed on: the child finishes its update and checkpoint and exits."""
    deadline = time.monotonic() + timeout_seconds
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if child.poll() is None:
        child.kill_tree()


def _judge(run_dir: Path, max_steps: int, freeze, out: TextIO, started: float, phases: dict[str, float],
           killed_at: int, checkpoint: int, killed: list[int], data_dir: Path | None = None) -> PilotResult:
    from pilotrun.commands.card import write_card
    from pilotrun.report.drawing.html import write_report
    from pilotrun.report.record_check.summarize import format_summary, summarize_run
    from pilotrun.report.verdict.verdict import format_verdict, judge_summary

    phase_start = time.monotonic()
    summary = summarize_run(run_dir, require_step=max_steps)
    print(format_summary(summary), file=out, flush=True)
    print(file=out)
    verdict = judge_summary(summary)
    report_dir = write_report(verdict)
    print(format_verdict(verdict), file=out, flush=True)
    print(f"report: {report_dir / 'report.html'}", file=out)
    card = write_card(summary, "pilotrun pilot")  # the pilot's run has its card as any summarized run does
    if card is not None:
        print(f"report card: {card}", file=out)
    lock = None
    if freeze is not None:
        if verdict.decision == "GO":
            from pilotrun.commands.freeze import freeze_run

            _code, written, _verdict = freeze_run(run_dir, freeze)
            lock = Path(freeze)
            train, watch = long_run_commands(lock, data_dir)
            _say(out, f"frozen: {lock} (sha256 {written['sha256']}); the long run: `{train}`, watched with "
                      f"`{watch}`")
        else:
            _say(out, f"not frozen: the pilot is {verdict.decision}; nothing written to {freeze}")
    phases["report"] = time.monotonic() - phase_start
    seconds = time.monotonic() - started
    _say(
        out,
        f"done in {seconds:.0f} s wall: "
        + ", ".join(f"{k.replace('_', ' ')} {v:.0f} s" for k, v in phases.items()),
    )
    return PilotResult(
        exit_code=0 if verdict.decision == "GO" else 1,
        decision=verdict.decision,
        run_dir=run_dir,
        report_dir=report_dir,
        killed_at_step=killed_at,
        committed_checkpoint=checkpoint,
        seconds=seconds,
        phase_seconds=phases,
        killed_pids=killed,
        lock=lock,
    )


# ---------------------------------------------------------------------------------------------- the command
# line
def add_pilot_arguments(p: argparse.ArgumentParser) -> None:
    """`pilotrun pilot`'s options (cli.py keeps only the parser's name and help)."""
    p.add_argument(
        "--workdir",
        default="pilot-work",
        help="folder for the run, the children's logs and the data it prepares",
    )
    p.add_argument("--config", default=None,
                   help="recipe path or packaged name (none: the packaged CPU stability recipe)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument(
        "--data",
        default=None,
        metavar="DIR",
        help="a data folder written by `pilotrun prepare` (read only); none: WORKDIR/data, prepared from "
        "--source and --tokenizer",
    )
    p.add_argument(
        "--source", default=None, help=f"with no --data: the source to prepare (default {DEFAULT_SOURCE})"
    )
    p.add_argument("--tokenizer", default=None,
                   help=f"with no --data: the tokenizer to prepare with (default {DEFAULT_TOKENIZER})")
    p.add_argument(
        "--reprepare",
        action="store_true",
        help="with no --data: prepare WORKDIR/data again even when it exists (without it, existing data "
        "is reused when it was prepared from the same source, tokenizer and options, else refused)",
    )
    p.add_argument("--interrupt-at", type=int, default=None, metavar="STEP",
                   help="kill the first training past this step (default: half of max_steps)")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="train under torchrun with N processes (gloo on the CPU); the kill takes every one")
    p.add_argument("--freeze", default=None, metavar="LOCK", help="after a GO, write the recipe lock to LOCK")
    p.add_argument("--check", default=None, metavar="lr,batch",
                   help="after the resumed run, check the learning rates and the batch by branches from the "
                        "pilot's checkpoints (`pilotrun tune`), at up to 3x the pilot's updates and wall "
                        "seconds")
    p.add_argument(
        "--progress",
        choices=("auto", "plain"),
        default="auto",
        help="auto: a line redrawn on a terminal, plain lines elsewhere; plain: plain lines, the first at "
        "once, then at most one every 10 s, and the last (the prepare's progress too; each training child's "
        "own log has one line per log window)",
    )


def run_pilot_from_cli(args: argparse.Namespace) -> int:
    from pilotrun.commands.tune import parse_checks

    if args.data is not None and (args.source is not None or args.tokenizer is not None):
        raise PilotError(
            "--data names a prepared folder; --source and --tokenizer prepare one: give one or the other"
        )
    if args.data is not None and args.reprepare:
        raise PilotError(
            "--reprepare prepares WORKDIR/data again; --data names a folder the pilot only reads: give "
            "one or the other"
        )
    try:
        return run_pilot(args.workdir, config=args.config, overrides=args.overrides,
                         tokenizer=args.tokenizer or DEFAULT_TOKENIZER, data=args.data,
                         source=args.source or DEFAULT_SOURCE, interrupt_at=args.interrupt_at,
                         nproc_per_node=args.nproc_per_node, freeze=args.freeze, progress=args.progress,
                         reprepare=args.reprepare,
                         check=parse_checks(args.check) if args.check else ()).exit_code
    except PilotInterrupted as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return exc.exit_code
