"""Spikes made on purpose, from the test side (the trainer has no hook for them).

In-process, pass pytest's `monkeypatch`; in a process the test starts (torchrun included), run

    python -m tests.training.spike_faults [--poison-batch N] [--storm] [--poison-rank R]
                                          [--corrupt-rank R --corrupt-call K] -- ARGS

which installs the faults and runs `pilotrun ARGS`:
- poison: the microbatch at global cursor position N (every one from N on with --storm) reads a degenerate
  window instead of the data: one token repeated for inputs, a rare one for every target (on rank R only when
  given). The batch index is the loader's own, so a replay of that batch reads the poison again;
- corrupt: the K-th gradient norm apply_update measures on rank R (1-based) is taken after the gradients were
  multiplied by 1000, once: the replay, which measures its own norm, does not see it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from pilotrun.data import reader
from pilotrun.training import precision

POISON_INPUT, POISON_TARGET = 7, 4000


def _set(monkeypatch: Any, owner: Any, name: str, value: Any) -> None:
    if monkeypatch is not None:
        monkeypatch.setattr(owner, name, value)
    else:
        setattr(owner, name, value)


def poison_batches(
    first: int, *, storm: bool = False, rank: int | None = None, monkeypatch: Any = None
) -> None:
    original = reader.BatchLoader.next_batch

    def next_batch(self):
        index = self.batch_index
        inputs, targets = original(self)
        if (index == first or (storm and index >= first)) and (rank is None or self.rank == rank):
            inputs, targets = torch.full_like(inputs, POISON_INPUT), torch.full_like(targets, POISON_TARGET)
        return inputs, targets

    _set(monkeypatch, reader.BatchLoader, "next_batch", next_batch)


def corrupt_gradient_once(call: int, *, rank: int = 0, monkeypatch: Any = None) -> None:
    original = precision.get_total_norm
    calls = [0]

    def get_total_norm(grads, *args, **kwargs):
        calls[0] += 1
        if calls[0] == call and int(os.environ.get("RANK", "0")) == rank:
            for grad in grads:
                grad.mul_(1000.0)
        return original(grads, *args, **kwargs)

    _set(monkeypatch, precision, "get_total_norm", get_total_norm)


def main(argv: list[str]) -> int:
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--poison-batch", type=int)
    parser.add_argument("--storm", action="store_true")
    parser.add_argument("--poison-rank", type=int)
    parser.add_argument("--corrupt-rank", type=int, default=0)
    parser.add_argument("--corrupt-call", type=int)
    args = parser.parse_args(argv[:split])
    if args.poison_batch is not None:
        poison_batches(args.poison_batch, storm=args.storm, rank=args.poison_rank)
    if args.corrupt_call is not None:
        corrupt_gradient_once(args.corrupt_call, rank=args.corrupt_rank)
    from pilotrun.commands.cli import main as cli_main

    return cli_main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
