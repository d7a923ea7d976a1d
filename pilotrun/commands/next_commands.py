"""The commands pilotrun prints for the user to run next: continue a run, start and watch a frozen long run.

Each is built from what the command was actually given, never a template with `...` in it: a printed resume
that left out a `--set` the run was started with would load another recipe and be refused (`cannot resume:
optim.schedule.horizon: 400 -> 80`), and the `--allow-change` that refusal suggests would quietly change the
recipe back. So a resume command repeats the recipe flags (`--config` or `--frozen`, every `--set`), the data
and the run folder, and adds `--resume`. It leaves out what belongs to one session only: `--from-step`, the
pilot's hidden kill point, and a plain run's `--allow-change` (the accepted change is recorded in run.json, so
the next resume finds no difference). A frozen run keeps its `--allow-change`: each session checks the lock
again, and the lock's differences are named the same way every time.

Quoted with shlex, so a path with a space runs as printed. Torch-free: the parser's modules import this.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def shell_line(words: Sequence[str | Path]) -> str:
    return shlex.join(str(w) for w in words)


def train_words(
    *,
    data: str | Path,
    run_dir: str | Path,
    config: str | Path | None = None,
    frozen: str | Path | None = None,
    overrides: Sequence[str] = (),
    allow_changes: Sequence[str] = (),
    resume: bool | str = False,
    extra: Sequence[str] = (),
) -> list[str]:
    """`pilotrun train` with exactly one of `config` and `frozen` (the arguments after `pilotrun`)."""
    words = ["train", *(["--config", str(config)] if frozen is None else ["--frozen", str(frozen)]),
             "--data", str(data), "--run-dir", str(run_dir)]
    for override in overrides:
        words += ["--set", override]
    for key in allow_changes:
        words += ["--allow-change", key]
    words += list(extra)
    if resume:
        words += ["--resume"] + (["auto"] if resume == "auto" else [])
    return words


def resume_command(args: argparse.Namespace) -> str:
    """The `pilotrun train` that continues the run a parsed `train` command was working on."""
    extra = []
    for flag, value in (("--stop-by", args.stop_by), ("--stop-signals", args.stop_signals)):
        if value is not None:
            extra += [flag, value]
    if args.progress != "auto":
        extra += ["--progress", args.progress]
    words = train_words(config=args.config, frozen=args.frozen, data=args.data, run_dir=args.run_dir,
                        overrides=args.overrides, allow_changes=args.allow_change if args.frozen else (),
                        resume=args.resume or True, extra=extra)
    return shell_line(["pilotrun", *words])


def projected_length(lock: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """(`--set`s, `--allow-change`s) that make the long run the one a lock's projection (`freeze
    --target-steps N`) priced: N updates, and a schedule horizon of N where the pilot's recipe tied its
    horizon to its max_steps (a cosine that decays fully over the pilot would otherwise end at update 200 of
    2,000) or where its horizon ends before N (the rest of the run at the floor LR, the expert bias frozen);
    the lock's forecast assumes that horizon too (report/projection/forecast_record.py). Nothing without a
    projection or when N is the pilot's own length."""

    def section(node: Any, name: str) -> dict[str, Any]:
        value = node.get(name) if isinstance(node, dict) else None
        return value if isinstance(value, dict) else {}

    target = section(lock, "projection").get("target_steps")
    recipe = section(lock, "recipe")
    steps = section(recipe, "train").get("max_steps")
    if not isinstance(target, int) or target == steps:
        return [], []
    keys = ["train.max_steps"]
    horizon = section(section(recipe, "optim"), "schedule").get("horizon")
    if horizon == steps or (isinstance(horizon, int) and horizon < target):
        keys.append("optim.schedule.horizon")
    return [f"{key}={target}" for key in keys], keys


def long_run_commands(
    lock: str | Path, data: str | Path | None, run_dir: str | Path = "runs/long",
    lock_content: dict[str, Any] | None = None,
) -> list[str]:
    """The frozen long run and its watch. `--resume auto`: the same line starts the run and continues it after
    any stop (it is what a scheduler's requeue reruns), and it never refuses a folder it already started.
    `lock_content`: the lock itself, whose projection sets the run's length (`projected_length`)."""
    overrides, allow = projected_length(lock_content)
    train = train_words(
        frozen=lock, data=data if data is not None else "DATA", run_dir=run_dir, overrides=overrides,
        allow_changes=allow, resume="auto"
    )
    return [shell_line(["pilotrun", *train]), shell_line(["pilotrun", "watch", run_dir, "--against", lock,
                                                          "--follow"])]


def recorded_data_dir(run_dir: str | Path) -> str | None:
    """The data folder a run recorded (run.json's data.dir), where it still exists."""
    from pilotrun.common.errors import PilotrunError
    from pilotrun.run.record import read_run_json

    try:
        data = read_run_json(run_dir).get("data")
    except PilotrunError:
        return None
    folder = data.get("dir") if isinstance(data, dict) else None
    return folder if isinstance(folder, str) and Path(folder).is_dir() else None
