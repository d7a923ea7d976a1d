"""Which committed checkpoints a save keeps: the retention tiers, decided from steps alone.

Three tiers keep a checkpoint; anything no tier keeps is pruned after the next commit:
- the newest `keep` up to the step just saved (the resume points; `train.checkpoint.keep`);
- every `keep_every`-th step, for good (`train.checkpoint.keep_every`; 0: none): the run's history, a later
  investigation's or evaluation's starting points;
- protected steps, never pruned, each with the reason it is protected: the checkpoint a spike's rollback
  restored from (what the rolled-back timeline started from), the final one of a completed run, and the ones
  the user names (`train.checkpoint.keep_steps`).

Checkpoints *after* the step just saved belong to a timeline abandoned by a resume from an earlier step
(`--from-step`): left in place they would be picked as "newest" by the next `--resume`, so they are removed,
whatever tier would otherwise keep them (a protected step past the resumed point is the abandoned timeline's).

Protection outlives the session that granted it: every marker lists the protected steps known when it was
written (`protected`: {step: reason}), and the checkpointer starts from the union of the committed markers'
lists, so a later session never prunes what an earlier one protected.

`kept_at_most` is the disk's side of the same policy: how many checkpoints the tiers can hold at once by
`max_steps`, for the start-of-session estimate (training/preflight.py's `disk_plan`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

PROTECT_ROLLBACK = "rollback"  # a spike's rollback restored this step
PROTECT_FINAL = "final"  # the last checkpoint of a run that reached max_steps
PROTECT_USER = "keep_steps"  # named by train.checkpoint.keep_steps


def doomed_steps(committed: Iterable[int], newest: int, keep: int, keep_every: int = 0,
                 protected: Mapping[int, str] | None = None) -> list[int]:
    """The committed steps a save at `newest` removes, ascending: later than `newest`, or in no tier."""
    protected = protected or {}
    steps = sorted(set(committed))
    current = [step for step in steps if step <= newest]
    newest_kept = set(current[-keep:]) if keep > 0 else set()
    doomed = []
    for step in steps:
        if step > newest:
            doomed.append(step)
        elif step in newest_kept or step in protected or (keep_every > 0 and step % keep_every == 0):
            continue
        else:
            doomed.append(step)
    return doomed


def kept_at_most(max_steps: int, checkpoint_every: int, keep: int, keep_every: int = 0,
                 protected: Iterable[int] = ()) -> int:
    """An upper bound on the committed checkpoints the tiers hold together once the run reaches `max_steps`:
    the newest `keep`, the `keep_every` multiples up to `max_steps` (the cadence's saves land on them only
    where the two cadences meet, but a resume or stop can save any step), the protected steps and the final
    one. A spike's rollback can protect one more each time; they are not foreseeable and not counted."""
    every_tier = 0
    if keep_every > 0:
        cadence = checkpoint_every if checkpoint_every > 0 else keep_every
        # Only saved steps can be kept: multiples of both cadences (their least common multiple).
        every_tier = max_steps // math.lcm(keep_every, cadence)
    return keep + every_tier + len(set(protected)) + 1


def merge_protected(into: dict[int, str], recorded: object) -> None:
    """Add a marker's `protected` table ({"step": reason}, JSON keys are strings) to `into`; anything that is
    not such a table is ignored (a marker of an older version has none)."""
    if not isinstance(recorded, dict):
        return
    for key, reason in recorded.items():
        if isinstance(key, str) and key.isdigit() and isinstance(reason, str):
            into.setdefault(int(key), reason)
