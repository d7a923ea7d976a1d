"""The `evaluate` command of the command line: argument parsing only; the work is in commands/evaluate.py."""

from __future__ import annotations

import argparse

from pilotrun.common.parsing import one_line
from pilotrun.common.strict_json import strict_dumps


def add_evaluate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="score a committed checkpoint on multiple-choice tasks, bound to its hashes",
        description="Score a committed checkpoint (rehashed first) on multiple-choice tasks: local "
        "task files (JSONL: context, choices, label) scored in-process the way the training loop "
        "scores train.downstream.tasks, or with --harness lm-eval EleutherAI's lm-evaluation-harness "
        "(the [eval] extra) on its own task names too, answered by pilotrun's own model. Writes "
        "RUN/evals/step-N/<id>.json (results, and the identity: the checkpoint's step and marker "
        "sha256, the harness version, each task's version and data sha256, shots, limit, seed) and "
        "appends an `evaluation` event to metrics.jsonl, which summarize reconciles with the "
        "checkpoint. Never writes into a checkpoint; a run held by a live session is refused. Exit "
        "0 written, 2 bad input.",
    )
    p.add_argument("run_dir", help="run folder")
    p.add_argument(
        "--tasks",
        required=True,
        metavar="T,...",
        help="comma-separated task files (.jsonl) and, with --harness lm-eval, the harness's task names",
    )
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest committed)")
    p.add_argument("--harness", default="pilotrun", choices=("pilotrun", "lm-eval"),
                   help="pilotrun (task files, the in-loop scoring; default) or lm-eval")
    p.add_argument("--limit", type=int, default=0, help="first examples of each task; 0: all")
    p.add_argument("--shots", type=int, default=0, help="lm-eval: few-shot examples in each prompt")
    p.add_argument("--seed", type=int, default=0, help="lm-eval: the seed of its few-shot sampling")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--data", default=None, help="the run's data folder if it moved (default: the recorded path)"
    )
    p.add_argument("--json", action="store_true", help="print the event as JSON")
    p.set_defaults(handler=_run_evaluate)


def _run_evaluate(args: argparse.Namespace) -> int:
    from pilotrun.commands.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(args.run_dir, args.tasks, step=args.step, harness=args.harness,
                                 data_dir=args.data, limit=args.limit, shots=args.shots, seed=args.seed,
                                 device=args.device)
    if args.json:
        print(strict_dumps(result, sort_keys=True, default=str))
        return 0
    for name, figures in result["tasks"].items():
        acc, norm, chance = figures.get("acc"), figures.get("acc_norm"), figures.get("chance")
        # an accuracy read against guessing's: 0.26 is nothing on 4 choices, something on 10
        against = f" (chance {chance:.4f})" if isinstance(chance, int | float) else ""
        # A task's name is its file's stem: quoted on one line, never as commands to the terminal.
        print(one_line(f"{name}: acc {acc:.4f}, acc_norm {norm:.4f}{against} over {figures.get('examples')} "
                       f"examples (step {result['step']}, {result['harness']} {result['harness_version']})"))
    print(one_line(f"written: {result['written']}; an evaluation event appended to metrics.jsonl"))
    return 0
