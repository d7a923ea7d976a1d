"""The run's plan at a session's start: what the researcher commits to before the first update.

One block, printed by rank 0 before the first update and kept as run.json's `plan` (the latest session's; a
resume writes its own): the model's total and active parameters and training FLOP per token (run.json's
`model` section: model/accounting.py's counts, not computed again), the tokens planned (max_steps x
tokens_per_update) and the passes over the training data they mean, per source for a mixture, the mixture's
weights, the lock's accepted differences (a run started with `train --frozen`), and the projected wall time
left with its end.

Passes are counted as the loaders read: one pass over a folder's training split is `batches_per_pass` global
batches (data/reader.py, the incomplete tail dropped), the same figure the verdict's data_passes rule divides
by; a mixture's source restarts alone by its windows, and the rows each source serves up to the planned
update are the mixture's own schedule (data/mixture.py's `rows_planned`), so the plan names what the run will
read, not an estimate from the weights (to the row; within a row per source where a source is owed less than a
row a batch, which the schedule would have to walk batch by batch: 10 s for 200,000 batches). Batches a
rollback or `train.skip_data` steps over are read in addition, and are not in the plan.

The wall time left: from the lock's projection (its `total_wall` for its target, scaled to the updates left)
when the run was started from a lock that has one, else from the record of the earlier sessions (the median
training-only seconds per update of their latest windows, those in the log's last RECENT_BYTES
(run/record.py), times the updates left: saves, evaluations and restarts come on top), else unknown until the
first window.
"""

from __future__ import annotations

import datetime
import statistics
from typing import Any

from pilotrun.data.mixed_reader import MixedLoader
from pilotrun.data.reader import BatchLoader

UNKNOWN_WALL = "unknown until the first window"


def data_plan(loader: BatchLoader | MixedLoader, run: dict[str, Any], max_steps: int, accumulation: int
              ) -> dict[str, Any]:
    """The tokens planned and the passes over the training data they mean (module docstring)."""
    tokens_per_update = int(run["tokens_per_update"])
    planned = {"tokens": max_steps * tokens_per_update, "updates": max_steps,
               "global_batches": max_steps * accumulation}
    if loader.mode == "repeat_batch":
        return {**planned, "passes": None,
                "why": f"data_mode repeat_batch: one batch read {planned['global_batches']} times"}
    if isinstance(loader, MixedLoader):
        rows, exact = loader.schedule.rows_planned(planned["global_batches"])
        sources = []
        for source, served, windows in zip(run["data"]["sources"], rows, loader.windows, strict=True):
            sources.append({"name": source["name"], "weight": source["weight"],
                            "train_tokens": source["train"]["tokens"],
                            "pass_tokens": windows * loader.seq_len, "tokens": served * loader.seq_len,
                            "passes": served / windows})
        passes = max(s["passes"] for s in sources)
        how = "" if exact else " (within a row of each: a source owed under a row a batch)"
        return {**planned, "passes": passes, "sources": sources, "seed": run["data"]["mixture"]["seed"],
                "exact": exact, "why": f"per source: its rows up to the planned update by the mixture's "
                f"schedule{how}, over its windows; passes: the most-read source's"}
    per_batch = loader.global_batch_windows * loader.seq_len
    pass_tokens = loader.batches_per_epoch * per_batch
    return {**planned, "passes": planned["tokens"] / pass_tokens, "pass_tokens": pass_tokens,
            "train_tokens": run["data"]["train"]["tokens"],
            "why": f"one pass = {loader.batches_per_epoch:,} global batches of {per_batch:,} tokens"}


def wall_plan(run: dict[str, Any], start_step: int, max_steps: int, seconds_per_update: list[float],
              now: float) -> dict[str, Any]:
    """The projected wall seconds left and the end they mean (module docstring)."""
    left = max(0, max_steps - start_step)
    projection = (run.get("frozen") or {}).get("lock_projection")
    total = (projection or {}).get("total_wall") if isinstance(projection, dict) else None
    target = (projection or {}).get("target_steps") if isinstance(projection, dict) else None
    seconds, band = None, None
    if isinstance(total, dict) and isinstance(total.get("seconds"), int | float) and isinstance(target, int) \
            and target > 0:
        share = left / target
        seconds = float(total["seconds"]) * share
        if isinstance(total.get("band"), list) and len(total["band"]) == 2:
            band = [float(b) * share for b in total["band"]]
        basis = (f"the lock's projection: total_wall {float(total['seconds']):.0f} s for its {target} "
                 f"updates, scaled to the {left} left")
    elif seconds_per_update:
        median = statistics.median(seconds_per_update)
        seconds = median * left
        basis = (f"the record: median {median:.4g} training seconds per update over "
                 f"{len(seconds_per_update)} recent window(s) x {left} updates left; saves, evaluations and "
                 "restarts come on top")
    else:
        basis = UNKNOWN_WALL
    end = None
    if seconds is not None:
        end = datetime.datetime.fromtimestamp(now + seconds, datetime.UTC).isoformat(timespec="seconds")
    return {"updates_left": left, "seconds": seconds, "band": band, "end": end, "from": basis}


def run_plan(run: dict[str, Any], loader: BatchLoader | MixedLoader, *, session_id: str, start_step: int,
             max_steps: int, accumulation: int, seconds_per_update: list[float], now: float
             ) -> dict[str, Any]:
    """run.json's `plan`: `run` is run.json as this session opened it (model, data, frozen)."""
    model = run.get("model") or {}
    frozen = run.get("frozen") if isinstance(run.get("frozen"), dict) else None
    lock = None
    if frozen is not None:
        lock = {"lock_sha256": frozen.get("lock_sha256"), "pilot_run_id": frozen.get("pilot_run_id"),
                "allowed": list(frozen.get("allowed") or []),
                "differences": list(frozen.get("differences") or [])}
    return {
        "session_id": session_id,
        "start_step": start_step,
        "model": {k: model.get(k) for k in ("parameters", "active_parameters", "flops_per_token")},
        "data": data_plan(loader, run, max_steps, accumulation),
        "lock": lock,
        "wall": wall_plan(run, start_step, max_steps, seconds_per_update, now),
    }


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    if minutes < 1:
        return f"{seconds:.3g} s"
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def plan_lines(plan: dict[str, Any]) -> list[str]:
    """The block printed before the first update (run.json `plan` says the same)."""
    model, data, wall = plan["model"], plan["data"], plan["wall"]
    lines = [f"plan: model {model['parameters']:,} parameters, {model['active_parameters']:,} active per "
             f"token, {model['flops_per_token']:.4g} training FLOP per token"]
    if data["passes"] is None:
        reads = data["why"]
    elif "sources" in data:
        reads = f"{data['passes']:.3g} passes over the most-read source"
    else:
        reads = (f"{data['passes']:.3g} passes over the training split ({data['train_tokens']:,} tokens; "
                 f"{data['why']})")
    lines.append(f"plan: {data['tokens']:,} tokens in {data['updates']:,} updates = {reads}")
    for s in data.get("sources", []):
        lines.append(f"plan:   source {s['name']}: weight {s['weight']:g}, {s['tokens']:,} tokens of its "
                     f"{s['train_tokens']:,} = {s['passes']:.3g} passes")
    if plan["lock"] is not None:
        lock = plan["lock"]
        accepted = "; ".join(f"{d['key']} {d['lock']!r} -> {d['run']!r}" for d in lock["differences"])
        lines.append(f"plan: lock {str(lock['lock_sha256'])[:12]} (pilot {lock['pilot_run_id']}); accepted "
                     f"differences: {accepted or 'none'}")
    if wall["seconds"] is None:
        lines.append(f"plan: wall time {wall['from']}")
    else:
        band = f" (band {_duration(wall['band'][0])} .. {_duration(wall['band'][1])})" if wall["band"] else ""
        lines.append(f"plan: wall time left {_duration(wall['seconds'])}{band}, ending about {wall['end']} "
                     f"({wall['from']})")
    return lines
