"""`python -m pilotrun.commands.tune_child PLAN`: the branches of the pilot's checks (commands/tune.py), each
a `pilotrun train` run one after another in this one process, so that they pay the interpreter's launch and
the imports (torch, the trainer) once instead of once a branch: on a tiny CPU pilot that launch is seconds, as
long as a branch's own updates.

PLAN is a JSON file: {"branches": [{"name", "words", "log"}], "codes": PATH}. Each branch is the command
line's `main(words)`, its output (file descriptors 1 and 2, so the trainer's and torch's own writes too) in
its own log, as a process of its own would have written it; after each branch the exit codes so far are
written to `codes` (atomically), which the parent reads as it would read each process's exit code. An
exception a branch raises ends that branch with code 1 and its traceback in its log, as an uncaught exception
ends a process. Each branch is still its own session of a run in its own folder: only the process is shared.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import traceback
from pathlib import Path

from pilotrun.common import stop_signals


def _run_one(words: list[str], log: Path) -> int:
    from pilotrun.commands.cli import main

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        # Python's writes through `out`, and the file descriptors too (torch's and the C library's own)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            return main(words)
        except Exception:  # a crash ends this branch as it would end its process, and the next one runs
            traceback.print_exc(file=out)
            return 1
        finally:
            out.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _import_once() -> None:
    """The trainer and torch under it, imported before the first branch (which would import them anyway)
    and then left out of the garbage collector's scans: each branch's teardown runs a full collection (to
    free the cycles a finished trainer leaves), which would otherwise walk the whole import graph again
    after every branch, a third of a second a branch on the CPU. Nothing imported is ever freed anyway. Done
    by this module's entry only: run_plan called inside another process leaves that one's collector alone."""
    import pilotrun.commands.cli  # noqa: F401
    import pilotrun.training.trainer  # noqa: F401

    gc.freeze()


def run_plan(plan_path: Path) -> int:
    from pilotrun.common.files import write_text_atomic

    plan = json.loads(plan_path.read_text())
    codes: dict[str, int] = {}
    for branch in plan["branches"]:
        codes[branch["name"]] = _run_one(branch["words"], Path(branch["log"]))
        write_text_atomic(Path(plan["codes"]), json.dumps(codes) + "\n")
    return 0


if __name__ == "__main__":
    stop_signals.held_early()  # as `python -m pilotrun`: a stop signal at launch is kept for the first branch
    _import_once()
    sys.exit(run_plan(Path(sys.argv[1])))
