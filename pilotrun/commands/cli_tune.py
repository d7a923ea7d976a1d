"""The `tune` command of the command line: argument parsing only; the work is in commands/tune.py."""

from __future__ import annotations

import argparse


def add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="check a finished pilot's learning rates and batch by short branches from its checkpoints",
        description="Branch a finished pilot from its committed checkpoints past warm-up, each branch a "
        "resume into RUN/tune/NAME with an allowed change: --check lr runs the recipe's Muon and AdamW "
        "learning rates times 1/2, 1/sqrt2, 1, sqrt2 and 2 for the same updates on the same batches; "
        "--check batch runs 1/2, 2 and 4 times the recipe's global batch on the same tokens from two "
        "checkpoints. Compared on validation loss with the pilot's own noise as the yardstick: whether the "
        "recipe's learning rates are within one step of the best seen (else the better factor), the "
        "sensitivity, and the critical batch with its band. The cost is printed before anything runs: "
        "updates, and wall seconds projected from the pilot's own record (its seconds per update, and what "
        "each branch pays again beside its updates: the session's start-up, an evaluation, a save, its "
        "bookkeeping, and the process's launch and imports); "
        "K is the most that fits --budget times the pilot's updates and its wall seconds, and a check that "
        "does not fit the seconds even at the fewest updates is refused unless --allow-overrun. "
        "Writes RUN/tune/tune.json and a plot per check; "
        "`pilotrun verdict RUN` shows them as evidence and `freeze` records them in the lock. The pilot's "
        "own files are only read. Exit 0 done, 2 bad input (not a pilot, no checkpoint to branch from, over "
        "budget).",
    )
    p.add_argument("run_dir", metavar="RUN", help="the pilot's run folder")
    p.add_argument("--check", default="lr,batch", metavar="lr,batch", help="which checks (default both)")
    p.add_argument("--updates", type=int, default=None, metavar="K",
                   help="updates per branch at the recipe's batch, a multiple of 4 (default: the most the "
                        "budget and the pilot's checkpoints allow)")
    p.add_argument("--budget", type=float, default=3.0, metavar="X",
                   help="the most the checks may cost, as a multiple of the pilot's own updates and of its "
                        "wall seconds (default 3)")
    p.add_argument("--allow-overrun", action="store_true",
                   help="where the checks fit the budget in updates but not in projected seconds, run them "
                        "anyway at the most updates that fit, the overrun stated (default: refuse)")
    p.add_argument("--data", default=None, help="the pilot's data folder if it moved (default: the recorded)")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="run each branch under torchrun with N processes (default: as the pilot's last "
                        "session ran)")
    p.set_defaults(handler=_run_tune)


def _run_tune(args: argparse.Namespace) -> int:
    from pilotrun.commands.tune import parse_checks, tune

    tune(args.run_dir, parse_checks(args.check), updates=args.updates, budget=args.budget, data=args.data,
         nproc=args.nproc_per_node, allow_overrun=args.allow_overrun)
    return 0
