"""The changes a long run made on resume that leave what the lock's forecast assumed.

The forecast assumes the lock's recipe, data and schedule from the first update to the last. A run started so
is held to it (forecast_record.not_applicable undoes changes on resume on purpose: such a run is still held to
the band and to its own course, which is how a change that hurts shows in the loss). A change on resume that
alters what the forecast assumed (a recipe key, a mixture's weights, the schedule's horizon; never a cadence,
the length or a machine key: IGNORED) makes the forecast, from the update it took effect, a reference rather
than a prediction. A change that costs nothing in loss on a small model (the LR doubled on the forecast
benchmark's) ends no worse than its healthy twin: no loss-based check can see it, the run's record does.
watch raises it once, and summarize's grade names it.

- `forecast_changes(run, sessions)`: those changes made by the given sessions, each with the update it took
  effect from (run/changes.py), ordered by that update.
- `describe_changes(changes)`: them (as_dicts') in one line, grouped by the update they took effect from.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pilotrun.config import MACHINE_KEYS, RESUME_FREE_KEYS, current_key
from pilotrun.run.changes import RecipeChange, recipe_changes_in_history

# Keys the forecast does not depend on: how long and how often (its own target and curve say), the machine,
# the seed (a seed's spread is within the interval). The evaluation's batches stay: they are the measured
# loss.
IGNORED = tuple(
    current_key(k) for k in (*MACHINE_KEYS, *RESUME_FREE_KEYS) if current_key(k) != "train.eval.batches"
) + ("optim.schedule.horizon", "train.seed")
# Keys in IGNORED that a change on resume still moves the forecast's assumptions by: the horizon is ignored
# against the lock (the pilot's is its own length), but a long run's horizon changed on resume changes the
# schedule the forecast's curve was computed for.
RESUME_CHANGES_ALSO = ("optim.schedule.horizon",)


def changes_the_forecast(key: str) -> bool:
    """Whether a change of `key` on resume leaves what the forecast assumed: a recipe key the forecast does
    not ignore, the horizon, or a data key beyond the recipe (a mixture's weights)."""
    key = current_key(key)
    return key.startswith("data.") or key in RESUME_CHANGES_ALSO or key not in IGNORED


def forecast_changes(run: dict[str, Any], sessions: list[str]) -> list[RecipeChange]:
    """The allowed and free changes the `sessions` (their ids, in order) made on resume that change the
    forecast's assumptions (changes_the_forecast), each with its first update, ordered by it."""
    found = [
        change
        for kind in ("allowed", "free")
        for change in recipe_changes_in_history(run, sessions, kind)
        if changes_the_forecast(change.key)
    ]
    return sorted(found, key=lambda change: change.from_update)


def describe_changes(changes: list[dict[str, Any]]) -> str:
    """'KEY OLD -> NEW, KEY OLD -> NEW from update N; ...': the changes (as_dicts'), grouped by the update
    they took effect from."""
    groups: dict[int, list[str]] = {}
    for change in changes:
        said = RecipeChange(**change).describe().rsplit(" from update ", 1)[0]
        groups.setdefault(int(change["from_update"]), []).append(said)
    return "; ".join(f"{', '.join(said)} from update {update}" for update, said in groups.items())


def as_dicts(changes: list[RecipeChange]) -> list[dict[str, Any]]:
    """The changes as the record's JSON holds them (summarize's grade, watch's alert)."""
    return [dataclasses.asdict(change) for change in changes]
