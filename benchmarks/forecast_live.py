"""bench_forecast's live watch over a finished long run: how early `pilotrun watch --against LOCK` would have
raised each alert had it followed the run while it trained, and which of those name the breakage of a run
broken on purpose.

The benchmark's own watch reads each finished record once, so its rule alerts (skip_rate among them) all read
the last step. Here the record is replayed: its log copied line by line into a fresh folder and watch asked
after each validation evaluation, rules judged each time (a live watch judges them as often as their cost
allows). A replayed record stops mid-session, so watch reads every session before its end as killed: those
alerts (`session_end`, `chain`) are the replay's, not the run's, and are left out.

An alert names the breakage where its class (its key; its kind for a spike, a rollback or a change on
resume, each keyed by its own step or session) is raised on the broken run after its break (its resume at
BREAK_SHARE of the updates) and never after the break on its healthy twin's replay (the same kind, seed, LR
and data trained straight through: the first stretch is the broken run's own): what watch says of the
breakage, not of this recipe.

What each alert reads (`by_evidence`): the loss (the forecast's band, rise or a source's rise, a loss spike,
the pilot's envelope, a spike or rollback the trainer detected in the loss or gradient) or the record (a
change on resume that left the forecast's assumptions, a rule such as skip_rate): counted apart, so that a
breakage the record names is never read as one the loss caught.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from benchmarks.forecast_runs import BREAK_SHARE, Case

REPLAY_ARTEFACTS = ("session_end", "chain")


def first_raised(long: Path, lock: dict) -> dict[str, tuple[int, str, int]]:
    """Each alert class watch raises following `long`'s record live, after each evaluation: (the step of the
    evaluation after which it was first raised, its kind, how many times). A class is the alert's key, or its
    kind where each event is keyed apart (a spike, a rollback)."""
    from pilotrun.report.watch.alerts import Watcher

    first: dict[str, tuple[int, str, int]] = {}
    seen: set[int] = set()
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / long.name
        copy.mkdir()
        shutil.copy(long / "run.json", copy / "run.json")
        watcher = Watcher(copy, lock=lock, holder=lambda path: None)
        with (long / "metrics.jsonl").open() as source, (copy / "metrics.jsonl").open("w") as log:
            for line in source:
                log.write(line)
                event = json.loads(line)
                if event.get("event") != "val":
                    continue
                log.flush()
                watcher.check(final=True)
                for i, alert in enumerate(watcher.raised):
                    if alert.kind in REPLAY_ARTEFACTS or i in seen:
                        continue
                    seen.add(i)
                    name = alert.kind if alert.kind in EACH_EVENT else alert.key
                    step, kind, times = first.get(name, (int(event["step"]), alert.kind, 0))
                    first[name] = (step, kind, times + 1)
    return first


# Kinds keyed one alert per event (a spike's step, a rollback's, a resume's session): a class of their own
EACH_EVENT = ("spike", "rollback", "forecast_change")
# The alert kinds judged on the losses (or the gradient beside them); every other kind reads the record
LOSS_KINDS = ("forecast", "loss_spike", "loss_envelope", "spike", "rollback")


def by_evidence(named: list) -> dict[str, list]:
    """breakage_alerts' [(step, class, times)] split by what each alert reads: {"loss": [...], "record":
    [...]}, each earliest first."""
    out: dict[str, list] = {"loss": [], "record": []}
    for step, name, times in named:
        out["loss" if name.split(":")[0] in LOSS_KINDS else "record"].append((step, name, times))
    return out


def after_break(first: dict[str, tuple[int, str, int]], target: int) -> dict[str, tuple[int, str, int]]:
    return {name: got for name, got in first.items() if got[0] > BREAK_SHARE * target}


def twin_of(case: Case, healthy: list[Case]) -> Case | None:
    """The healthy run a broken one departs from: the same kind, seed, LR and data."""
    return next(
        (h for h in healthy if (h.kind, h.seed, h.lr, h.mixture) == (case.kind, case.seed, case.lr,
                                                                     case.mixture)),
        None,
    )


def breakage_alerts(case: Case, healthy: list[Case], pairs: dict, locks: dict, target: int) -> list:
    """[(step first raised, class, times raised)] of the alerts that name `case`'s breakage: raised on it
    after the break and never after the break on its twin (whose first stretch is the broken run's own),
    earliest first."""
    twin = twin_of(case, healthy)
    if twin is None:
        return []
    broken = after_break(first_raised(pairs[case.name][1], locks[case.name]), target)
    on_twin = after_break(first_raised(pairs[twin.name][1], locks[twin.name]), target)
    return sorted((step, name, times) for name, (step, _, times) in broken.items() if name not in on_twin)
