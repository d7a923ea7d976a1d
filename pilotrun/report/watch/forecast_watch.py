"""watch's hold on the lock's forecast (pilotrun/report/projection/forecast_record.py): a long run's
validation losses against the forecast's band (its 99% band, wider than the 90% interval the lock states,
since a run is held to it at every evaluation).

Judged only beyond the pilot's reach, after the named warm-up (from WATCH_FROM_PILOT_FACTOR x the pilot's
updates: forecast_record.watch_from), and only on CONSECUTIVE evaluations in a row outside the band (one
evaluation outside is the evaluation's own noise as often as the run's). From the pilot's last update on, an
evaluation also counts as out where it has risen (forecast_record.risen) above the law refitted to the pilot's
and the run's own evaluations before it: a band that follows the run's own course, narrower than the
forecast's (a lock written before it has no `rise` and is held to the band alone). On a mixture each
source's own val loss is held to its own course the same way (forecast_record.source_risen; the lock's
`rise.by_source`): the mean under the weights in force falls when a hard source is dropped. A run the
forecast does not apply to (another width, data, schedule family or horizon, recipe) hears it once, as a note,
and is not held to it; a run that changed on resume what the forecast assumed (forecast_changes.py) is still
held to it, and each such resume is said once, at its first evaluation (`changes`, which alerts.py raises); a
lock without a forecast (older, or "no forecast: <why>") is watched as before, except one refused as too
noisy, whose lock still carries the rise check: the run is held to it alone (no band).
"""

from __future__ import annotations

import json
from typing import Any

from pilotrun.report.projection.forecast_changes import as_dicts, describe_changes, forecast_changes
from pilotrun.report.projection.forecast_record import (
    CONSECUTIVE,
    at_step,
    not_applicable,
    outside,
    risen,
    source_risen,
)
from pilotrun.run.recipe_lock import FORECAST_KEY, lock_forecast_of
from pilotrun.run.record import is_finite_number


class ForecastWatch:
    def __init__(self, lock: dict[str, Any] | None, run: dict[str, Any]):
        if lock is not None:
            self.forecast = lock.get(FORECAST_KEY)
            self.lock_recipe, self.lock_data = (
                lock.get("recipe"),
                (lock.get("data") or {}).get("metadata_sha256"),
            )
        else:
            frozen = run.get("frozen") if isinstance(run.get("frozen"), dict) else {}
            self.forecast = lock_forecast_of(run)
            self.lock_recipe, self.lock_data = (
                frozen.get("lock_recipe"),
                frozen.get("lock_data_metadata_sha256"),
            )
        # held: a forecast's curve, or a lock refused a forecast as too noisy that still carries the rise
        # check (no band, no number: the run is held to its own refitted course alone)
        self.applies: bool | None = (
            None
            if isinstance(self.forecast, dict) and ("curve" in self.forecast or "rise" in self.forecast)
            else False
        )
        self.streak: list[tuple[int, float, str]] = []
        self.own: dict[int, float] = {}  # the run's evaluations so far, by step (a redone one replaces its)
        self.own_by_source: dict[str, dict[int, float]] = {}  # a mixture: each source's own, the same way
        self.notes: list[str] = []
        # the sessions seen starting whose updates the run still keeps, in order, each with the step it
        # started at (a later resume from an earlier step undoes a session's updates and its changes)
        self.sessions: dict[str, int] = {}
        # the changes on resume already said (forecast_changes' dicts as JSON, less the session), each with
        # the session that said it
        self.told: dict[str, str] = {}
        self.changes: list[dict[str, Any]] = []  # changes to say now: taken by the caller
        self.undone: list[str] = []  # sessions whose said changes no longer stand: taken by the caller
        # forecast_changes of the sessions kept, computed again only when they or run.json's sessions change
        self._found_for: tuple | None = None
        self._found: list[dict[str, Any]] = []

    def restart(self, session_id: str | None = None, resumed_from: int | None = None) -> None:
        """A session started (from `resumed_from`; None: fresh): the evaluations after its resume point are
        redone, so the streak starts again; a change it made on resume is said at its first evaluation, and
        one made by an earlier session that started at or past that point, whose updates are all redone, is
        not (none of the run's kept updates ran on it)."""
        self.streak = []
        if session_id is None or session_id in self.sessions:
            return
        start = resumed_from if isinstance(resumed_from, int) else 0
        self.sessions = {sid: at for sid, at in self.sessions.items() if at < start}
        self.sessions[session_id] = start

    def _changed(self, run: dict[str, Any], step: int) -> None:
        """The changes on resume that left the forecast's assumptions (forecast_changes.py), made by a session
        seen starting and in effect at `step`, not said before (a later session repeating the same change
        from the same update is the same change), into self.changes; the sessions whose said changes no
        longer stand (a resume from before them redid their updates without those changes), into
        self.undone."""
        recorded = run.get("sessions") if isinstance(run.get("sessions"), list) else []
        key = (tuple(self.sessions), len(recorded))
        if key != self._found_for:
            self._found_for, self._found = key, as_dicts(forecast_changes(run, list(self.sessions)))
        standing = {self._said(change): change for change in self._found}
        gone = {sid for said, sid in self.told.items() if said not in standing}
        self.told = {said: sid for said, sid in self.told.items() if said in standing}
        self.undone.extend(sorted(gone - set(self.told.values())))
        for said, change in standing.items():
            if change["from_update"] <= step and said not in self.told:
                self.told[said] = str(change["session_id"])
                self.changes.append(change)

    @staticmethod
    def _said(change: dict[str, Any]) -> str:
        """A change as said once: its key, values and first update, whichever session made it."""
        return json.dumps({k: v for k, v in change.items() if k != "session_id"}, sort_keys=True, default=str)

    def judge(self, run: dict[str, Any], event: dict[str, Any]) -> dict[str, Any] | None:
        """{"outside": message, "step", "figure", "bound"} while CONSECUTIVE evaluations in a row are outside
        the
        band; {"inside": True} on an evaluation inside it; None where not judged."""
        if self.applies is None:
            differs = not_applicable(self.forecast, self.lock_recipe or {}, self.lock_data, run)
            self.applies = not differs
            if differs:
                self.notes.append(
                    f"note: the lock's forecast does not apply to this run: {'; '.join(differs)} "
                    "(its validation loss is not held to the forecast's band)"
                )
        loss, step = event.get("loss"), event.get("step")
        if self.applies and isinstance(step, int):
            self._changed(run, step)
        if not self.applies or not is_finite_number(loss) or not isinstance(step, int):
            return None
        own = sorted((s, v) for s, v in self.own.items() if s < step)
        self.own[step] = float(loss)
        side = outside(self.forecast, step, float(loss))
        rise = None if side else risen(self.forecast, own, step, float(loss))
        losses, before = self._sources(event, step)
        source = None if side or rise else source_risen(self.forecast, before, step, losses)
        if side is None and rise is None and source is None:
            self.streak = []
            held = at_step(self.forecast, step) is not None or "curve" not in self.forecast
            return {"inside": True} if held else None
        self.streak = (self.streak + [(step, float(loss), side or "risen")])[-CONSECUTIVE:]
        if len(self.streak) < CONSECUTIVE:
            return None
        first = self.streak[0][0]
        if source is not None:
            return {
                "outside": f"val loss of source '{source['source']}' {source['loss']:.6g} at step {step} is "
                f"more than {self.forecast['rise']['share']:.1%} above {source['predicted']:.6g}, what the "
                "forecast's law refitted to the pilot's and this run's own evaluations of that source "
                f"predicts, {CONSECUTIVE} evaluations in a row (outside the band or risen) from step "
                f"{first}: the source is leaving its own course (the mixture's mean, under the weights in "
                "force, may not show it)",
                "step": step,
                "figure": source["loss"],
                "bound": source["bound"],
                "first": first,
            }
        if rise is not None:
            return {
                "outside": f"val loss {float(loss):.6g} at step {step} is more than "
                f"{self.forecast['rise']['share']:.1%} above {rise['predicted']:.6g}, what the forecast's "
                f"law refitted to the pilot's and this run's own evaluations before it predicts, "
                f"{CONSECUTIVE} evaluations in a row (outside the band or risen) from step {first}: the run "
                "is leaving its own course",
                "step": step,
                "figure": float(loss),
                "bound": rise["bound"],
                "first": first,
            }
        return self._left_band(side, step, float(loss), first)

    def change_message(self, changes: list[dict[str, Any]]) -> str:
        """The alert's text for the changes one resume made (self.changes of one session)."""
        first = min(int(c["from_update"]) for c in changes)
        held = (
            "its band is a reference, not a prediction (the run is still held to the band and to its own "
            "course: a change that hurts shows there)"
            if "curve" in self.forecast
            else "the course the lock's rise check holds the run to is a reference, not a prediction (the "
            "run is still held to it: a change that hurts shows there)"
        )
        return (
            f"the run changed on resume what the lock's forecast assumed: {describe_changes(changes)} "
            f"(session {changes[0]['session_id']}); the forecast assumed the lock's recipe and data "
            f"throughout, so from step {first} {held}"
        )

    def _sources(
        self, event: dict[str, Any], step: int
    ) -> tuple[dict[str, float], dict[str, list[tuple[int, float]]]]:
        """A mixture's evaluation: (its losses by source, each source's evaluations before `step`), this one
        kept for the next (a run of one folder: both empty)."""
        losses = event.get("loss_by_source")
        if not isinstance(losses, dict):
            return {}, {}
        before = {
            name: sorted((s, v) for s, v in by_step.items() if s < step)
            for name, by_step in self.own_by_source.items()
        }
        for name, value in losses.items():
            if is_finite_number(value):
                self.own_by_source.setdefault(str(name), {})[step] = float(value)
        return losses, before

    def _left_band(self, side: str, step: int, loss: float, first: int) -> dict[str, Any]:
        row = at_step(self.forecast, step)
        bound = row["band_high"] if side == "above" else row["band_low"]
        return {
            "outside": f"val loss {loss:.6g} at step {step} is {side} the forecast's band "
            f"({row['band_low']:.6g}-{row['band_high']:.6g}, predicted {row['predicted']:.6g}), "
            f"{CONSECUTIVE} evaluations in a row from step {first}: the run is leaving what the "
            "pilot forecast",
            "step": step,
            "figure": loss,
            "bound": bound,
            "first": first,
        }
